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

SMALL = "smollm2-135m"  # the pair a command that would load one names


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
    not_a_folder = tmp_path / "cache-file"
    not_a_folder.write_text("")
    for cache in (not_a_folder, Path("/dev/null")):
        result = runner.invoke(app, ["generate", "hi", "--pair", SMALL, "-n", "1"], env={"EDGE_SPEC_CACHE": str(cache)})
        assert_one_line_error(result, f"the cache {cache} is not a folder", "EDGE_SPEC_CACHE")
    result = runner.invoke(app, ["generate", "-", "--pair", SMALL], input=b"caf\xe9\n")
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
    (["--seed", "-1"], "--seed must be 0 to 2^63 - 1"),
    (["--seed", str(2**64)], "--seed must be 0 to 2^63 - 1"),
    (["--repeat-penalty", "1e-300", "--temperature", "0.8"], "--repeat-penalty must be 0.01 to 100"),
    (["--temperature", "inf"], "finite"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--threads", "1000000"], "--threads must be at most"),
    (["--gpu-layers", "-5"], "--gpu-layers must be 0 or more"),
    (["--accept", "best"], "--accept must be one of match, residual, coupled, auto"),
])
def test_invalid_sampling_values(smollm2: Pair, flags: list[str], fragment: str) -> None:
    assert_one_line_error(run("generate", "hi", *flags), fragment)


def test_prompt_longer_than_the_context(smollm2: Pair) -> None:
    assert_one_line_error(run("generate", "word " * 400, "--pair", SMALL, "--ctx", "256"), "context holds 256", "--ctx")
    # llama.cpp sizes contexts in steps of 256 tokens: a smaller one is refused rather than silently grown
    assert_one_line_error(run("generate", "hi", "--pair", SMALL, "--ctx", "64"), "--ctx must be at least 256")


def test_base_model_needs_raw(gemma3: Pair) -> None:
    assert_one_line_error(run("generate", "hi", "--pair", "gemma3-270m"), "no chat template", "--raw")
    result = run("generate", "The sky is", "--pair", "gemma3-270m", "--raw", "-n", "8", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["stats"]["new_tokens"] == 8


def test_bad_bench_budgets(smollm2: Pair) -> None:
    assert_one_line_error(run("bench", "--budgets", "1,x"), "--budgets")
    assert_one_line_error(run("bench", "--methods", "plain,beam"), "--methods")
    assert_one_line_error(run("bench", "--accept", "match,best"), "--accept takes match, residual, coupled, auto")


def test_careless_names_and_files_are_one_line(tmp_path: Path) -> None:
    """A missing model file, an empty or overlong name, and --models or --acceptance naming a FIFO or a device:
    one clear line each, at once (a FIFO or /dev/zero was read forever)."""
    import os

    assert_one_line_error(run("plan", str(tmp_path / "nope.gguf")), "nope.gguf: no such file")
    assert_one_line_error(run("pull", ""), "the model's name is empty")
    assert_one_line_error(run("generate", "hi", "-m", "x" * 300 + ".gguf"), "longer than a file name may be")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_one_line_error(run("--models", str(fifo), "models"), "is not a regular file")
    assert_one_line_error(run("--models", "/dev/zero", "models"), "is not a regular file")
    assert_one_line_error(run("plan", SMALL, "--acceptance", str(fifo)), "is not a regular file")
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop-back")
    (tmp_path / "loop-back").symlink_to(loop)
    assert_one_line_error(run("--models", str(loop), "models"), "Too many levels of symbolic links")
    for target, said in ((loop, "is a loop of symbolic links"), (fifo, "is a FIFO, not a regular file"),
                         (Path("/dev/zero"), "is a device, not a regular file")):
        assert_one_line_error(run("generate", "hi", "--target", str(target)), f"model file {target} {said}")


@pytest.mark.parametrize("stdin", ["random bytes", "closed"])
def test_a_prompt_from_standard_input_that_is_not_text_is_one_line(stdin: str) -> None:
    """`head -c 3000 /dev/urandom | edge-spec generate -` under the C locale (Python would read the bytes as
    surrogates), and `generate -` with standard input closed: one line, exit 1, before anything loads."""
    import os
    import random
    import subprocess
    import sys

    command = [sys.executable, "-c", "from edge.cli.main import main; main()", "generate", "-n", "4", "-"]
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}
    if stdin == "closed":
        run_ = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                              timeout=120, pass_fds=(), preexec_fn=lambda: os.close(0))
    else:
        rng = random.Random(3)
        data = bytes(rng.getrandbits(8) for _ in range(3000))
        run_ = subprocess.run(command, input=data, capture_output=True, env=env, timeout=120)
    err = run_.stderr if isinstance(run_.stderr, str) else run_.stderr.decode()
    lines = [line for line in err.splitlines() if line.strip()]
    assert run_.returncode == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert "standard input" in lines[0], lines[0]


def test_a_prompts_file_that_is_not_prompts_is_one_line(tmp_path: Path) -> None:
    """`bench --prompts` given a device, a FIFO, a file past the size bound, a line nested past the JSON parser's depth
    or a number past its digits: one line each, before a model loads (it used to OOM, hang or print a traceback)."""
    import os

    from edge.models.bench import MAX_PROMPTS_BYTES, read_prompts

    from edge.errors import UserError

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    large = tmp_path / "large.txt"
    large.write_bytes(b"a" * (MAX_PROMPTS_BYTES + 1))
    deep, digits = tmp_path / "deep.txt", tmp_path / "digits.txt"
    deep.write_text("[" * 100_000 + "\n")
    digits.write_text("[" + "7" * 5000 + "]\n")
    for path, said in ((Path("/dev/zero"), "not a regular file"), (fifo, "not a regular file"),
                       (large, "larger than 16 MiB"), (deep, "nested too deep"), (digits, "a number too long")):
        with pytest.raises(UserError, match=said):
            read_prompts(path)
    assert_one_line_error(run("bench", "--prompts", str(fifo)), "not a regular file")


def test_unbounded_or_undecodable_input_is_one_line(smollm2: Pair) -> None:
    """A prompt argument that is not UTF-8 (a C locale passes its bytes as lone surrogates), and standard input past
    16 MiB with no end of line (/dev/zero): one line each, where they used to end in a traceback or an OOM kill."""
    from edge.cli.options import MAX_INPUT_BYTES

    assert_one_line_error(run("generate", "caf\udce9", "--pair", SMALL), "the prompt is not UTF-8 text (character 4)",
                          "C.UTF-8")
    endless = b"a" * (MAX_INPUT_BYTES + 1)
    assert_one_line_error(runner.invoke(app, ["generate", "-", "--pair", SMALL], input=endless),
                          "standard input is longer than 16 MiB")
    chat = runner.invoke(app, ["chat", SMALL, "-n", "1", "--temperature", "0"], input=endless)
    assert "line 1 of standard input is longer than 16 MiB" in chat.stderr and "Traceback" not in chat.output
