"""The `edge-spec` command as users type it (typer's CliRunner), on the real small pair, smollm2-135m, which each
command names (the default pair is 1.6 GB)."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from edge.models.pair import Pair

from edge.chat import ChatSession
from edge.errors import UserError
from edge.generate import Decoder
from edge.grow import GrowConfig
from tests.cli_helpers import assert_one_line_error, missing_flags, run

SMALL = "smollm2-135m"  # the pair each command names


def test_generate_json(smollm2: Pair) -> None:
    result = run("generate", "What is 2 + 2?", "--pair", SMALL, "--max-tokens", "24", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) >= {"text", "tokens", "finish_reason", "stats"}
    assert set(out["stats"]) >= {"new_tokens", "target_passes", "tokens_per_pass", "draft_s", "verify_s",
                                 "tokens_per_s"}
    assert out["finish_reason"] in ("stop", "length") and out["lossless_warning"] is None
    assert len(out["tokens"]) == out["stats"]["new_tokens"] - (out["finish_reason"] == "stop")
    assert {"plain_rounds", "mean_budget"} <= set(out["stats"])  # --budget auto, the default
    plain = json.loads(run("generate", "What is 2 + 2?", "--pair", SMALL, "--max-tokens", "24", "--json",
                           "--no-spec").stdout)
    if out["stats"]["mean_budget"] > 0:  # auto kept the drafter: its target on the pair's settings, as --no-spec's
        assert plain["tokens"] == out["tokens"] and plain["text"] == out["text"]
    # (else it may have decoded plainly on llama.cpp's own settings, an f16 KV cache among them, whose greedy text
    # differs from the bf16 cache's on an AVX2 CPU: tests/test_transcripts.py pins both)
    tree = json.loads(run("generate", "What is 2 + 2?", "--pair", SMALL, "--max-tokens", "24", "--json", "--budget",
                          "16").stdout)
    assert tree["tokens"] == plain["tokens"]
    assert tree["stats"]["target_passes"] < plain["stats"]["target_passes"]


def test_generate_streams_text_and_stats(smollm2: Pair) -> None:
    result = run("generate", "Say hello.", "--pair", SMALL, "-n", "12", "--budget", "16")
    assert result.exit_code == 0
    assert result.stdout.strip()
    assert "tokens/pass" in result.stderr


def test_piped_chat_fails_when_no_prompt_was_answered(smollm2: Pair) -> None:
    result = run("chat", SMALL, "--ctx", "256", input="word " * 400 + "\n" + "more " * 400 + "\n")
    assert result.exit_code == 1 and result.stderr.count("error:") == 2, result.output


def test_piped_chat_transcript(smollm2: Pair) -> None:
    result = run("chat", SMALL, "--max-tokens", "20", input="What is the capital of France?\n/stats\nAnd of Italy?\n")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("tokens/pass") == 3  # two replies and /stats
    greedy = run("chat", SMALL, "--max-tokens", "20", "--temperature", "0",
                 input="What is the capital of France?\n/stats\nAnd of Italy?\n")
    import edge

    # the pair as the command line loads it (speculate auto: in RAM, the target alone on llama.cpp's own kernels)
    with edge.load(smollm2.name, speculate="auto", report=lambda line: None) as same:
        expected = chat_replies(same, ["What is the capital of France?", "And of Italy?"], 20)
    assert_transcript(greedy.stdout, expected)


def chat_replies(pair: Pair, prompts: list[str], max_tokens: int) -> list[str]:
    """The greedy replies of one conversation, by the library's chat session over `pair`'s own decoder."""
    from edge.sampling import SamplingConfig

    session = ChatSession(pair.decoder(SamplingConfig()), pair.template, pair.target.tokenizer, None)
    return ["".join(step.text for step in session.send(text, max_tokens)) for text in prompts]


def assert_transcript(stdout: str, replies: list[str]) -> None:
    """Piped chat prints each reply, then a line break: nothing else on stdout, nothing left out."""
    assert replies and all(reply.strip() for reply in replies)
    assert stdout == "".join(reply + "\n" for reply in replies)


def assert_rounds_add_up(row: dict) -> None:
    """A row's rounds: each plain, or a tree under some rule, and at least one."""
    assert row["rounds"] > 0 and row["plain_rounds"] + sum(row["rule_rounds"].values()) == row["rounds"]


def test_bench_json(smollm2: Pair, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\nCount to five.\n")
    result = run("bench", "--pair", SMALL, "--prompts", str(prompts), "--budgets", "1,8", "--max-tokens", "16",
                 "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["pair"] == "smollm2-135m" and out["machine"]["cores"] >= 1
    assert [(r["method"], r["budget"]) for r in out["rows"]] == [("plain", 0), ("tree", 1), ("tree", 8)]
    for row in out["rows"]:
        assert row["matches_plain"] and row["target_passes"] == row["rounds"]
        assert set(row) >= {"tokens_per_pass", "grow_s_per_round", "draft_s_per_round", "verify_s_per_round",
                            "tokens_per_s"}
        assert row["grow_s_per_round"] <= row["draft_s_per_round"]


def test_bench_methods_auto_and_plot(smollm2: Pair, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\n")
    plot = tmp_path / "bench.png"
    result = run("bench", "--pair", SMALL, "--prompts", str(prompts), "--methods", "plain,chain,tree", "--budgets",
                 "auto,4", "--max-tokens", "12", "--json", "--plot", str(plot))
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert [(r["method"], r["budget"]) for r in out["rows"]] == [("plain", 0), ("chain", 4), ("tree", "auto"),
                                                                  ("tree", 4)]
    assert out["placement"] == "ram" and out["auto_costs"]["warm_ms"] is None  # nothing to read ahead in RAM
    for row in out["rows"]:
        assert row["matches_plain"] and row["speedup"] > 0 and "bytes_read_per_pass" in row
    auto = out["rows"][2]
    assert_rounds_add_up(auto)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sampled_generation_by_rule(smollm2: Pair) -> None:
    """match and coupled: a seed gives --no-spec's exact text with the same --accept; residual and auto (which runs
    both residual and coupled rounds as their yields say): a seed gives the same text run after run (their trees are
    the drafter's draws, so not plain sampling's), from trees that yield more tokens per pass."""
    def text_and_stats(*flags: str) -> tuple[str, dict]:
        result = run("generate", "Write a short poem about the sea.", "--pair", SMALL, "-n", "48", "--temperature",
                     "0.8", "--seed", "3", "--budget", "16", "--json", *flags)
        assert result.exit_code == 0, result.output
        reply = json.loads(result.stdout)
        return reply["text"], reply["stats"]

    plain, _ = text_and_stats("--no-spec", "--accept", "match")
    assert text_and_stats("--accept", "match")[0] == plain
    coupled, stats = text_and_stats("--accept", "coupled")
    assert coupled == text_and_stats("--no-spec", "--accept", "coupled")[0] != plain  # by the noise, not as match
    assert stats["tokens_per_pass"] > 1.5
    residual, stats = text_and_stats("--accept", "residual")
    assert text_and_stats("--accept", "residual")[0] == residual
    assert stats["residual_rounds"] == stats["rounds"] > 0
    auto, stats = text_and_stats()
    assert text_and_stats()[0] == auto and stats["tokens_per_pass"] > 1.5
    assert_one_line_error(run("generate", "hi", "--pair", SMALL, "--budget", "fast"), "--budget", "auto")
    assert_one_line_error(run("generate", "hi", "--pair", SMALL, "--placement", "disk"), "--placement")
    assert_one_line_error(run("generate", "hi", "--pair", SMALL, "--target-dtype", "q3"), "--target-dtype")
    assert_one_line_error(run("bench", "--pair", SMALL, "--drafters", "onnx@q4"), "--drafters", "@QUANT")
    assert_one_line_error(run("bench", "--pair", SMALL, "--drafters", "llama_cpp:8192"), "--drafters")
    # a vocabulary not prepared yet is named before any drafter runs
    assert_one_line_error(run("bench", "--pair", SMALL, "--drafters", "onnx,onnx:12345", "--budgets", "1", "-n", "1"),
                          "12345-token vocabulary", "prepare")


def test_drafters_name_a_runtime_a_head_and_a_requantization() -> None:
    from edge.cli.benchmark import DrafterChoice, parse_drafters

    choices = parse_drafters("llama_cpp@q4_0, onnx, onnx:32768@q8_0")
    assert choices == [DrafterChoice("llama_cpp", None, "q4_0"), DrafterChoice("onnx"),
                       DrafterChoice("onnx", 32768, "q8_0")]
    assert [c.label for c in choices] == ["llama_cpp@q4_0", "onnx", "onnx:32768@q8_0"]


def test_ctrl_c_stops_the_reply_and_keeps_the_session(smollm2: Pair) -> None:
    """A real SIGINT mid-reply: the reply ends 'interrupted', the chat and its caches stay usable."""
    from edge.cli.repl import interruptible

    decoder = Decoder(smollm2.target, smollm2.drafter, GrowConfig.for_budget(16))
    session = ChatSession(decoder, smollm2.template, smollm2.target.tokenizer)
    with interruptible() as stopped:
        steps = []
        for step in session.send("Write a long story about a dragon.", 400, should_stop=stopped):
            steps.append(step)
            if len(steps) == 5:
                os.kill(os.getpid(), signal.SIGINT)
    assert steps[-1].finish_reason == "interrupted" and 5 <= len(steps) < 100
    assert len(session.messages) == 2
    calls = []
    original = smollm2.target.prefill
    smollm2.target.prefill = lambda tokens: (calls.append(len(tokens)), original(tokens))[1]
    try:
        reply = list(session.send("Thanks. Now say goodbye.", 16))
    finally:
        smollm2.target.prefill = original
    assert reply[-1].finish_reason in ("stop", "length")
    assert sum(calls) < 40  # only the new turn ran, not the whole history
    assert smollm2.target.n_past + len(smollm2.target._pending) == len(decoder.context) - 1


def test_help_does_not_load_llama_cpp() -> None:
    import subprocess
    import sys

    code = "import sys, cli.main; cli.main.app(['--help'], standalone_mode=False); print('llama_cpp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False")


def test_ctrl_c_stops_reading_a_long_prompt(smollm2: Pair, tmp_path: Path) -> None:
    """SIGINT to a real `edge-spec generate` while it reads a long prompt: it stops at the next prefill chunk and exits
    130, with no traceback (it used to read the whole prompt first: minutes for a few thousand tokens). The signal
    goes once the process has spent more CPU than loading takes, into a prompt of ~60 prefill chunks: whatever the
    machine's speed, it lands while the prompt is read."""
    import subprocess
    import sys
    import time

    import psutil

    command = [sys.executable, "-c", "from edge.cli.main import main; main()", "generate", "-", "--pair", SMALL,
               "-n", "4", "--budget", "4", "--ctx", "16384"]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdin is not None and process.stderr is not None
    process.stdin.write(("word " * 15000).encode())
    process.stdin.close()
    watched = psutil.Process(process.pid)
    while process.poll() is None and sum(watched.cpu_times()[:2]) < 4.0:  # loading SmolLM2 takes about 1 s of CPU
        time.sleep(0.05)
    assert process.poll() is None, process.stderr.read().decode()
    process.send_signal(signal.SIGINT)
    sent = time.perf_counter()
    code = process.wait(timeout=60)
    waited = time.perf_counter() - sent
    stderr = process.stderr.read().decode()
    assert code == 130 and "(interrupted)" in stderr and "Traceback" not in stderr, stderr
    assert waited < 5, f"took {waited:.1f} s to stop"


def test_a_ctrl_c_landing_in_a_native_callback_is_raised_once_the_call_returns(smollm2: Pair) -> None:
    """Python runs a Ctrl-C's handler at the next bytecode it runs, which during a model's load is inside llama.cpp's
    log callback, and ctypes drops what a callback raises: the Ctrl-C is kept and raised once the load returns (the
    model freed with it). Here the log callback itself delivers the Ctrl-C, at the first line of a real load."""
    import ctypes

    import llama_cpp.llama_cpp as ll
    from edge.runtimes.llama_cpp import _native

    delivered: list[bytes] = []

    @ll.llama_log_callback
    def interrupting(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if not delivered:
            delivered.append(text)
            signal.raise_signal(signal.SIGINT)

    _native._init_backend()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a process of its own
    ll.llama_log_set(interrupting, ctypes.c_void_p(0))
    try:
        with pytest.raises(KeyboardInterrupt):
            _native.Model(smollm2.target.path)
    finally:
        ll.llama_log_set(_native._quiet_log, ctypes.c_void_p(0))
        signal.signal(signal.SIGINT, previous)
    assert delivered
    _native.Model(smollm2.target.path).close()  # nothing left pending: the next load is a plain one


def test_ctrl_c_while_a_command_loads_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that stops a command before its reply (loading its models, say): "(interrupted)" and exit code 130,
    as for one that stops a reply, not a traceback or click's "Aborted!"."""

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("edge.models.loading.open_pair", interrupted)
    result = run("generate", "hi", "--pair", SMALL, "-n", "4")
    assert result.exit_code == 130, result.output
    assert result.stderr.strip() == "(interrupted)" and "Traceback" not in result.output


def test_version_and_a_missing_plot_extra_are_said_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run("--version")
    assert result.exit_code == 0 and result.stdout.startswith("edge-spec ")
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if matplotlib were not installed

    def loaded(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model loaded before the missing extra was said")

    monkeypatch.setattr("edge.models.loading.open_pair", loaded)
    result = run("bench", "--pair", SMALL, "--plot", str(tmp_path / "bench.png"))
    assert_one_line_error(result, "--plot needs matplotlib")


def test_chat_defaults_end_every_reply_by_end_of_turn(smollm2: Pair) -> None:
    """SmolLM2's chat with its default sampling (llama.cpp's, as the model recommends none) answers each of the repo's
    chat prompts and stops at its end of turn, well before 512 tokens: no loop to the limit."""
    from tests.conftest import CHAT_PROMPTS

    piped = "".join(f"{prompt}\n/clear\n" for prompt in CHAT_PROMPTS)
    result = run("chat", SMALL, "--max-tokens", "512", "--seed", "1", input=piped)
    assert result.exit_code == 0, result.output
    lengths = [int(n) for n in re.findall(r"^(\d+) tokens · ", result.stderr, re.MULTILINE)]
    assert len(lengths) == len(CHAT_PROMPTS) and max(lengths) < 512, lengths


def test_chat_samples_by_default_and_takes_greedy(smollm2: Pair) -> None:
    from edge.sampling import CHAT_REPEAT_PENALTY, LLAMA_DEFAULTS, chat_defaults

    assert smollm2.sampling == LLAMA_DEFAULTS and smollm2.recommended == ()  # SmolLM2's file recommends no sampling
    assert chat_defaults(smollm2.sampling, smollm2.recommended).repeat_penalty == CHAT_REPEAT_PENALTY
    greedy = run("chat", SMALL, "--max-tokens", "16", "--temperature", "0", input="Name three colors.\n")
    plain = json.loads(run("generate", "Name three colors.", "--pair", SMALL, "-n", "16", "--json").stdout)
    assert greedy.stdout.strip() == plain["text"].strip()


@pytest.mark.parametrize("command", ["chat", "generate", "serve", "bench", "plan", "check", "pull", "prepare", "rm",
                                     "models"])
def test_help_has_no_type_labels(command: str) -> None:
    text = run(command, "--help").stdout
    assert not re.search(r"<(bool|int|float|str|path)>", text), text
    if command not in ("models", "generate", "bench"):
        assert "MODEL" in text  # every command names its model the same way


def test_plan_warns_of_a_gpu_that_llama_cpp_cannot_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU is here (faked), and this llama-cpp-python is a CPU-only build: plan says so, with the fix."""
    from edge.runtimes import runtime

    monkeypatch.setattr("edge.offload.probe.probe_gpus", lambda: [{"name": "NVIDIA GeForce RTX 4090",
                                                              "vram_total_gb": 24.0, "vram_free_gb": 23.0}])
    if runtime("llama_cpp").gpu_devices():
        pytest.skip("this llama-cpp-python was built with GPU offload")
    result = run("plan", SMALL, "--machine", "ram=32G,vram=24G,disk=3GB/s")
    assert "built without GPU offload" in result.output and "CMAKE_ARGS" in result.output


def test_bench_reports_its_progress(smollm2: Pair) -> None:
    """Each prompt through each row is one step of bench's progress bar (prompts x rows in all)."""
    from edge.models.bench import run_bench

    from edge.sampling import SamplingConfig

    seen: list[tuple[int, int]] = []
    run_bench(smollm2, ["Say hello.", "Count to three."], [4], 4, SamplingConfig(),
              progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_stats_lines_do_not_wrap_off_a_terminal(smollm2: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stderr to a file or a pipe, even a narrow one: each stats line stays one line, for a script to read."""
    monkeypatch.setenv("COLUMNS", "40")
    generated = run("generate", "Say hello.", "--pair", SMALL, "-n", "8")
    chatted = run("chat", SMALL, "-n", "8", "--temperature", "0", input="Say hello.\n")
    for result in (generated, chatted):
        lines = [line for line in result.stderr.splitlines() if "tokens/pass" in line]
        assert len(lines) == 1 and lines[0].rstrip().endswith(("target passes", "by lookup", "/4096", "/1024")), \
            result.stderr


def test_every_readme_command_names_real_flags() -> None:
    """Each line of the README's command block: its subcommand exists and takes every flag the line shows (the
    commands themselves run in the tests above and in the benchmarks' tests)."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [command for line in block.replace("\\\n", " ").splitlines()
             for command in line.split("#", 1)[0].split(" / ") if "edge-spec" in command]
    assert len(lines) >= 15
    assert [(line, missing_flags(line)) for line in lines if missing_flags(line)] == []


def test_chat_set_keeps_greedy_plain_unless_a_penalty_is_chosen(smollm2: Pair) -> None:
    from edge.cli.repl import Chat

    chat = Chat(smollm2, ChatSession(smollm2.decoder(smollm2.sampling), smollm2.template, smollm2.target.tokenizer),
                smollm2.sampling, None, True, 16)
    assert chat.set("temperature", "0") == "sampling: greedy (temperature 0)"  # generate's greedy: no penalty
    assert "repeat penalty 1.1" in chat.set("temperature", "0.7")  # sampling again: chat's default penalty
    chat.set("repeat_penalty", "1.3")
    assert chat.set("temperature", "0") == "sampling: greedy (temperature 0), repeat penalty 1.3"  # chosen: kept
    with pytest.raises(UserError, match="does not know"):
        chat.set("warmth", "3")
    with pytest.raises(UserError, match="not a number"):
        chat.set("top_p", "high")
    assert chat.set("budget", "4") == "tree budget: 4" and "context    0 of" in chat.show()
    assert "accept     auto (greedy: sample-and-match)" in chat.show()
    chat.set("temperature", "0.8")
    for _ in chat.session.decoder.reply(smollm2.prompt_tokens("Tell me about the sea."), 64):
        pass
    shown = r"accept     auto \(residual \d+\.\d\d a pass \(\d+ rounds\), coupled \d+\.\d\d a pass"
    assert re.search(shown, chat.show())  # what each rule has yielded: auto chooses by it
