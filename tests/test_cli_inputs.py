"""Bad input to the `edge-spec` command: one line on stderr, exit code 1, no traceback (a wrong model path, a
drafter of another vocabulary, a truncated GGUF, a broken models.toml, bad flags, a prompt longer than the
context)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from edge.cli.main import app
from edge.models.pair import Pair

from tests.cli_helpers import assert_one_line_error, run, runner


def test_missing_model_file(tmp_path: Path) -> None:
    assert_one_line_error(run("generate", "hi", "--target", str(tmp_path / "nope.gguf")), "not found")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_text("this is not a model")
    assert_one_line_error(run("generate", "hi", "--target", str(bogus)), "not a GGUF file")


def test_truncated_gguf(tmp_path: Path, files: dict[str, Path]) -> None:
    cut = tmp_path / "cut.gguf"
    with files["smol"].open("rb") as source, cut.open("wb") as out:
        out.write(source.read(20_000_000))
    assert_one_line_error(run("generate", "hi", "--target", str(cut)), "truncated")


def test_unknown_pair() -> None:
    assert_one_line_error(run("generate", "hi", "--model", "nope"), "unknown model 'nope'", "smollm2-135m")


def test_drafter_with_another_vocabulary(files: dict[str, Path]) -> None:
    result = run("generate", "hi", "--target", str(files["smol"]), "--drafter", str(files["gemma"]))
    assert_one_line_error(result, "does not share the target's vocabulary", "differ")


def test_broken_models_toml(tmp_path: Path) -> None:
    broken = tmp_path / "models.toml"
    broken.write_text('default = "x"\n[pairs.x\n')
    assert_one_line_error(run("--models", str(broken), "generate", "hi"), "not valid TOML")
    wrong_key = tmp_path / "wrong.toml"
    wrong_key.write_text('[pairs.x]\ntarget.path = "a.gguf"\ntarget.quantise = "q4_0"\ndrafter.from = "target"\n')
    assert_one_line_error(run("--models", str(wrong_key), "models"), "pair 'x'", "quantise")


def test_broken_inputs_get_one_line(tmp_path: Path) -> None:
    """Mistakes that used to end in a traceback (issue 20): each is one line and exit 1."""
    assert_one_line_error(run("--models", str(tmp_path), "models"), "is a directory")
    latin = tmp_path / "latin1.toml"
    latin.write_bytes('[pairs.caf\xe9]\ntarget.path = "a.gguf"\ndrafter.from = "target"\n'.encode("latin-1"))
    assert_one_line_error(run("--models", str(latin), "models"), "not UTF-8 text")
    dots = tmp_path / "dots.toml"
    dots.write_text('[pairs.x]\ntarget.pypi = ["p==1"]\ntarget.files = ["p/m.gguf"]\ntarget.name = ".."\n'
                    'drafter.from = "target"\n')
    assert_one_line_error(run("--models", str(dots), "models"), "'name' must be a plain file name")
    escape = tmp_path / "escape.toml"
    escape.write_text('[pairs.x]\ntarget.hf = "a/b:../../x.gguf"\ndrafter.from = "target"\n')
    assert_one_line_error(run("--models", str(escape), "models"), "a path inside the repo")
    result = runner.invoke(app, ["generate", "-"], input=b"caf\xe9\n")
    assert_one_line_error(result, "standard input is not UTF-8 text")
    # user-supplied text is printed as it is, never read as rich markup
    marked = tmp_path / "[/x]" / "[bold]m.gguf"
    assert_one_line_error(run("generate", "hi", "--target", str(marked)), "[/x]/[bold]m.gguf", "not found")
    named = tmp_path / "named.toml"
    named.write_text('[pairs."[bold]x"]\nabout = "[red]a"\ntarget.path = "[/]t.gguf"\ndrafter.from = "target"\n')
    listing = run("--models", str(named), "models")
    assert listing.exit_code == 0 and "[bold]x" in listing.stdout and "[red]a" in listing.stdout


@pytest.mark.parametrize("flags, fragment", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "2"], "--top-p"),
    (["--min-p", "1.5"], "--min-p"),
    (["--budget", "0"], "--budget"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--seed", "-1"], "--seed must be 0 or more"),
    (["--temperature", "inf"], "finite"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--gpu-layers", "-5"], "--gpu-layers must be 0 or more"),
    (["--accept", "best"], "--accept must be one of match, residual, auto"),
])
def test_invalid_sampling_values(smollm2: Pair, flags: list[str], fragment: str) -> None:
    assert_one_line_error(run("generate", "hi", *flags), fragment)


def test_prompt_longer_than_the_context(smollm2: Pair) -> None:
    assert_one_line_error(run("generate", "word " * 400, "--ctx", "256"), "context holds 256", "--ctx")
    # llama.cpp sizes contexts in steps of 256 tokens: a smaller one is refused rather than silently grown
    assert_one_line_error(run("generate", "hi", "--ctx", "64"), "--ctx must be at least 256")


def test_base_model_needs_raw(gemma3: Pair) -> None:
    assert_one_line_error(run("generate", "hi", "--pair", "gemma3-270m"), "no chat template", "--raw")
    result = run("generate", "The sky is", "--pair", "gemma3-270m", "--raw", "-n", "8", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["stats"]["new_tokens"] == 8


def test_bad_bench_budgets(smollm2: Pair) -> None:
    assert_one_line_error(run("bench", "--budgets", "1,x"), "--budgets")
    assert_one_line_error(run("bench", "--methods", "plain,beam"), "--methods")
    assert_one_line_error(run("bench", "--accept", "match,best"), "--accept takes match, residual, auto")
