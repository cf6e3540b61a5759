"""The library's face (edge.load / edge.generate / edge.stream_generate) on the real small pair (smollm2-135m),
against the command line, and its load options."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from edge.cli.main import app
from edge.models.pair import Pair
from typer.testing import CliRunner

import edge
from edge.errors import UserError
from tests.conftest import REPO
from tests.isolation import share


@pytest.fixture(scope="module")
def small_pair() -> Pair:
    """smollm2-135m as a user loads it: models.toml's drafter (the ONNX one), --budget auto."""
    with edge.load("smollm2-135m") as pair:
        yield share(pair)


def test_generate_equals_the_command_line(small_pair: Pair) -> None:
    text = edge.generate(small_pair, "Name three colors.", max_tokens=16, temperature=0).text
    result = CliRunner().invoke(app, ["generate", "Name three colors.", "--pair", "smollm2-135m", "-n", "16",
                                      "--temperature", "0", "--json"])
    assert result.exit_code == 0, result.output
    assert text and text == json.loads(result.stdout)["text"]


def test_stream_generate_yields_steps_then_a_finish(small_pair: Pair) -> None:
    steps = list(edge.stream_generate(small_pair, "Name three colors.", max_tokens=5))
    assert [s.finish_reason for s in steps] == [None] * 5 + ["length"]
    assert all(s.token is not None for s in steps[:-1]) and steps[-1].token is None
    reply = edge.generate(small_pair, "Name three colors.", max_tokens=5)
    assert reply.tokens == [s.token for s in steps[:-1]] and reply.text == "".join(s.text for s in steps)
    assert reply.finish_reason == "length" and reply.stats.new_tokens == 5 and reply.stats.prefill_s > 0


def test_chat_messages_are_rendered_with_the_template(small_pair: Pair) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    assert edge.generate(small_pair, messages, max_tokens=8).tokens == \
        edge.generate(small_pair, "Name three colors.", max_tokens=8).tokens
    raw = small_pair.prompt_tokens("Name three colors.", raw=True)
    assert edge.generate(small_pair, raw, max_tokens=4).tokens == \
        edge.generate(small_pair, "Name three colors.", max_tokens=4, raw=True).tokens
    with pytest.raises(UserError, match="chat message"):
        edge.generate(small_pair, [{"role": "user"}], max_tokens=4)


@pytest.mark.parametrize("prompt, options, said, option", [
    ([49152], {}, "token id 49152 is not in smollm2-135m's vocabulary (ids 0 to 49151)", "prompt"),
    ([1, 2**31], {}, "token id 2147483648", "prompt"),
    ([-1], {}, "token id -1", "prompt"),
    (b"hi", {}, "not bytes", "prompt"),
    ("hi", {"seed": 1.5}, "seed must be a whole number (got 1.5)", "seed"),
    ("hi", {"max_tokens": "5"}, "max_tokens must be a whole number of tokens (got '5')", "max_tokens"),
    ("hi", {"temperature": "hot"}, "temperature must be a number", "temperature"),
    ("hi", {"top_k": True}, "top_k must be a whole number", "top_k"),
])
def test_wrong_values_from_python_are_one_user_error_naming_the_parameter(small_pair: Pair, prompt, options: dict,
                                                                        said: str, option: str) -> None:
    with pytest.raises(UserError, match=re.escape(said)) as raised:
        edge.generate(small_pair, prompt, **options)
    assert raised.value.option == option


def test_a_chats_next_turn_runs_only_its_new_tokens(small_pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    first = [{"role": "user", "content": "Name three colors."}]
    reply = edge.generate(small_pair, first, max_tokens=12).text
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And two more?"}]
    prefilled: list[int] = []
    target = small_pair.target
    real_prefill = type(target).prefill
    monkeypatch.setattr(target, "prefill", lambda tokens: prefilled.append(len(tokens)) or real_prefill(target, tokens))
    again = edge.generate(small_pair, second, max_tokens=12)
    kept = len(small_pair.prompt_tokens(second)) - 1 - prefilled[0]
    assert kept >= len(small_pair.prompt_tokens(first))  # the first turn stayed in the caches
    fresh = small_pair.decoder(edge.SamplingConfig())  # a decoder of its own starts from empty caches
    fresh.load(small_pair.prompt_tokens(second))
    assert prefilled[-1] == len(small_pair.prompt_tokens(second)) - 1
    assert [s.token for s in fresh.generate(12) if s.token is not None and s.finish_reason is None] == again.tokens


def test_load_options_are_checked_before_anything_loads() -> None:
    """In the library's own words: the option as edge.load names it (the command line says --budget: test_cli)."""
    for options, fragment in [({"budget": "lots"}, "budget takes"), ({"budget": 0}, "at least 1"),
                              ({"placement": "cloud"}, "placement must be"),
                              ({"ctx": 64}, "ctx must be at least 256"),
                              ({"provider": "tpu"}, "provider must be"), ({"target_dtype": "q3"}, "target_dtype"),
                              ({"drafter": "x.gguf"}, "drafter goes with a model file"),
                              ({"placement": "ssd", "mlock": True}, "not with mlock")]:
        with pytest.raises(UserError, match=re.escape(fragment)) as raised:
            edge.load("smollm2-135m", **options)
        assert "--" not in str(raised.value)
    with pytest.raises(UserError, match="unknown model 'nope': name a pair of models"):
        edge.load("nope")
    with pytest.raises(UserError, match="not found"):
        edge.load(target="/nonexistent/model.gguf")


def test_close_frees_the_models(smollm2: Pair) -> None:
    with edge.load("smollm2-135m", budget=4, gpu_layers=0) as pair:
        assert edge.generate(pair, "Hi", max_tokens=3).stats.new_tokens == 3
        target, drafter = pair.target, pair.drafter
    assert pair.drafter is None and target.ctx._ptr is None and target.model._ptr is None
    assert drafter.session is None


MISUSE = """
import threading
import edge
from edge.errors import UserError

pair = edge.load("smollm2-135m", budget=4, gpu_layers=0, threads=1)
alone = edge.generate(pair, "Name three colors.", max_tokens=12).text

# Two threads on one pair: each waits its turn, and each gets the text it gets alone.
texts = []
threads = [threading.Thread(target=lambda: texts.append(edge.generate(pair, "Name three colors.", max_tokens=12).text))
           for _ in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("threads", texts == [alone, alone])

# Two generators on one thread, stepped in turn: the second is refused, never interleaved.
first = edge.stream_generate(pair, "Name three colors.", max_tokens=12)
next(first)
try:
    next(edge.stream_generate(pair, "Count to three.", max_tokens=4))
    print("second ran")
except UserError as problem:
    print("second refused", "one generation at a time" in str(problem))
rest = "".join(step.text for step in first)
print("first whole", rest != "")
# A generator dropped unfinished ends its turn.
dropped = edge.stream_generate(pair, "Count to three.", max_tokens=8)
next(dropped)
del dropped
print("after a dropped one", edge.generate(pair, "Name three colors.", max_tokens=12).text == alone)

# Closed: a new generation, and one resumed after close, raise UserError; nothing crashes.
resumed = edge.stream_generate(pair, "Name three colors.", max_tokens=12)
next(resumed)
pair.close()
for attempt in (lambda: next(resumed), lambda: edge.generate(pair, "Hi", max_tokens=4)):
    try:
        attempt()
        print("ran after close")
    except UserError as problem:
        print("closed said", "is closed" in str(problem))
pair.close()
"""


def test_a_misused_pair_waits_refuses_or_says_it_is_closed() -> None:
    """In a child process (a crash must not take the test run with it): two threads on one pair take turns and get
    their own text; a second generator on the same thread is refused, a dropped one ends its turn; after close(),
    a new generation and a resumed one raise UserError, and closing twice is harmless."""
    run = subprocess.run([sys.executable, "-c", MISUSE], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[:-1] == ["threads True", "second refused True", "first whole True",
                                           "after a dropped one True", "closed said True", "closed said True"]


def test_a_model_file_changed_under_a_loaded_pair_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    """`cp new.gguf live.gguf` under a running process changes what its mapped weights compute (or truncates them:
    SIGBUS): a generation checks the file's size and time first and says so in one line."""
    import os
    import shutil

    from edge.errors import ModelFault

    live = tmp_path / "live.gguf"
    shutil.copyfile(files["smol"], live)
    with edge.load(target=live, drafter="none", lookup="off", ctx=512) as pair:
        assert edge.generate(pair, "Hi", max_tokens=2).stats.new_tokens == 2
        stat = live.stat()
        os.utime(live, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        with pytest.raises(ModelFault, match="changed on disk since"):
            edge.generate(pair, "Hi", max_tokens=2)


def test_a_file_edited_in_place_is_refused_and_its_sha256_stamp_hashed_again(files: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    """A byte of the tensor data rewritten in place (same size, same inode): the loaded pair refuses to generate on
    it. Then, with the mtime put back as it was, the cache's sha256 stamp still sees the change (the ctime) and
    hashes the file again rather than trusting the stamp."""
    import os
    import shutil

    from edge.models.cache import sha256_file
    from edge.models.sources import _digest

    from edge.errors import ModelFault

    live = tmp_path / "live.gguf"
    shutil.copyfile(files["smol"], live)
    stamp = tmp_path / "live.gguf.sha256"
    assert _digest(live, stamp) == sha256_file(live)
    with edge.load(target=live, drafter="none", lookup="off", ctx=512) as pair:
        assert edge.generate(pair, "Hi", max_tokens=2).stats.new_tokens == 2
        before = live.stat()
        time.sleep(0.05)  # past the filesystem's timestamp granularity
        with live.open("r+b") as f:  # one byte of the tensor data flipped
            f.seek(before.st_size - 4096)
            byte = f.read(1)
            f.seek(before.st_size - 4096)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(ModelFault, match="changed on disk since"):
            edge.generate(pair, "Hi", max_tokens=2)
    os.utime(live, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (live.stat().st_size, live.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert _digest(live, stamp) == sha256_file(live) != sha256_file(files["smol"])


TRUNCATED_MID_PASS = """
import os, sys
from pathlib import Path
import edge
live = Path(sys.argv[1])
pair = edge.load(target=live, drafter="none", lookup="off", ctx=512)
edge.generate(pair, "Hi", max_tokens=2)
os.truncate(live, 4096)  # what `cp new.gguf live.gguf` does first
pair._stamps.clear()  # as if the change landed mid-pass, after the generation's own check
edge.generate(pair, "Tell me about the sea.", max_tokens=4)
print("not reached")
"""


def test_a_model_file_truncated_mid_pass_is_one_line_not_a_silent_crash(files: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    """The mapped weights' pages are gone: the read is a bus error. The process says which file changed, in one
    line, and exits with 135 (as a shell reports SIGBUS)."""
    import shutil

    live = tmp_path / "live.gguf"
    shutil.copyfile(files["smol"], live)
    run = subprocess.run([sys.executable, "-c", TRUNCATED_MID_PASS, str(live)], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert run.returncode == 135, (run.returncode, run.stderr[-3000:])
    said = [line for line in run.stderr.splitlines() if line.startswith("edge-spec:")]
    assert len(said) == 1 and f"{live} changed on disk while it was in use" in said[0], run.stderr[-3000:]
    assert "not reached" not in run.stdout


def test_a_text_of_many_special_tokens_is_tokenized_in_runs(files: dict[str, Path]) -> None:
    """llama.cpp's split of a text on special tokens is quadratic in their count: a text of 16,000 is tokenized
    SPECIAL_RUN of them at a time, to exactly llama.cpp's tokens in one call."""
    from edge.runtimes.llama_cpp._native import SPECIAL_RUN, Model

    model = Model(files["smol"], vocab_only=True)
    text = "<|im_end|>x" * 16_000 + "<|im_start|>user\nHi <|im_end|>\n"
    whole = model._tokenize(text, True, True)
    seen: list[int] = []
    one_call = model._tokenize

    def counted(piece: str, add_special: bool, parse_special: bool) -> list[int]:
        seen.append(piece.count("<|im_"))
        return one_call(piece, add_special, parse_special)

    model._tokenize = counted  # type: ignore[method-assign]
    assert model.tokenize(text, True, True) == whole
    assert len(seen) > 200 and max(seen) <= SPECIAL_RUN + 1
    model.close()


def test_lookup_keep_carries_past_replies_to_the_next_run() -> None:
    """lookup="keep": the replies a run drafted from are saved when the pair closes and read by the next load of the
    same target file; a damaged file is said and started over; lookup="on" starts empty."""
    from edge.models.kept import corpus_path

    with edge.load("smollm2-135m", lookup="keep", budget=4) as pair:
        saved = corpus_path(pair.target.path)
        saved.unlink(missing_ok=True)
        reply = edge.generate(pair, "Name three colors.", max_tokens=8).tokens
    try:
        assert saved.is_file()
        with edge.load("smollm2-135m", lookup="keep", budget=4) as pair:
            assert pair.corpus is not None and pair.corpus.replies[-1][:len(reply)] == reply  # (and a stop token)
        with edge.load("smollm2-135m", budget=4) as pair:
            assert pair.corpus is not None and pair.corpus.replies == []
        saved.write_bytes(b"not an array")
        said: list[str] = []
        with edge.load("smollm2-135m", lookup="keep", budget=4, report=said.append) as pair:
            assert pair.corpus is not None and pair.corpus.replies == []
        assert any("cannot be read" in line for line in said), said
    finally:
        saved.unlink(missing_ok=True)


def test_a_pairs_rule_yields_carry_to_the_next_run(fresh_cache: Path) -> None:
    """What each acceptance rule yielded when sampling is kept when the pair closes (rule-yields.json, one entry a
    pair of files) and starts the next load's measurements: `--accept auto` begins on the rule that yielded more. A
    seeded reply keeps nothing."""
    import json

    with edge.load("smollm2-135m", budget=8, accept="auto") as pair:
        edge.generate(pair, "Name three colors.", max_tokens=32, temperature=0.8, seed=1)
        assert pair.rule_choices.to_json() == {}  # a seeded reply keeps nothing: the next run's same seed repeats it
        edge.generate(pair, "Name three colors.", max_tokens=32, temperature=0.7)  # (what a seed measured: held)
        measured = pair.rule_choices.to_json()
    [(key, yields)] = measured.items()
    assert set(yields) == {"residual", "coupled"}, yields  # auto tried both
    [entry] = json.loads((fresh_cache / "rule-yields.json").read_text()).values()
    assert entry["yields"] == measured
    with edge.load("smollm2-135m", budget=8, accept="auto") as pair:
        assert pair.rule_choices.kept(key) == yields
        assert pair.rule_choices.afresh().kept(key) == yields  # a benchmark's rows start from it too


def test_the_readme_python_example_runs() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    example = re.search(r"## Python\n.*?```python\n(.*?)```", readme, re.DOTALL)
    assert example is not None, "README.md has no Python example"
    run = subprocess.run([sys.executable, "-c", example.group(1)], capture_output=True, text=True, cwd=Path.cwd(),
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "tokens per target pass" in run.stdout


def test_a_prompt_that_cannot_fit_is_refused_before_passes_are_timed(small_pair: Pair,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(small_pair, "_decoders", {})
    monkeypatch.setattr(Pair, "auto_budget", lambda self: pytest.fail("timed the passes for a prompt that cannot fit"))
    with pytest.raises(UserError, match="context holds"):
        edge.generate(small_pair, "word " * 5000, max_tokens=4)


def test_pass_times_keep_the_newest_entries() -> None:
    from edge.models.kept import PASS_TIMES_KEPT, _newest

    entries = {f"file {i}": {"target_ms": {}, "measured": float(i)} for i in range(PASS_TIMES_KEPT + 6)}
    entries["undated"] = {"target_ms": {}}
    kept = _newest(entries)
    assert len(kept) == PASS_TIMES_KEPT and "undated" not in kept and "file 5" not in kept and f"file {69}" in kept


def test_cache_json_nested_past_the_parsers_depth_is_damaged_and_measured_again(fresh_cache: Path) -> None:
    """pass-times.json, machine.json or a sha256 stamp of 100,000 `[`: read as nothing (measured or hashed again),
    not a RecursionError on every run until the file is deleted."""
    from edge.models.cache import read_json
    from edge.models.kept import pass_times
    from edge.models.sources import _digest

    for name in ("pass-times.json", "machine.json"):
        (fresh_cache / name).write_text("[" * 100_000)
        assert read_json(fresh_cache / name) == {}
    assert pass_times() == {}
    model, stamp = fresh_cache / "model.bin", fresh_cache / "model.bin.sha256"
    model.write_bytes(b"weights")
    stamp.write_text("[" * 100_000)
    assert _digest(model, stamp) == hashlib.sha256(b"weights").hexdigest()
