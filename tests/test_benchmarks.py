"""The benchmark scripts keep running (each one's --help, and a one-prompt run of the cheap ones on the offline pair),
and benchmarks/replay.py's target, which tree_yield.py and tree_rounds.py replay growth with, answers as the real
target did."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from benchmarks.replay import ReplayTarget, plain_replies, replay
from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.protocols import SpecialTokens
from edge.sampling import SamplingConfig
from edge.tree import TokenTree
from tests.tiny import TinyModel

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(path.name for path in (REPO / "benchmarks").glob("*.py")
                 if 'if __name__ == "__main__":' in path.read_text())  # not the tooling the tests share
PAIR = "smollm2-135m"


def run_script(name: str, *args: str) -> str:
    """`python benchmarks/NAME.py ARGS` from the repo root, as the README runs them; its stdout."""
    run = subprocess.run([sys.executable, f"benchmarks/{name}", *args], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_has_help(name: str) -> None:
    assert run_script(name, "--help").startswith(f"usage: {name}")


@pytest.fixture(scope="module")
def one_prompt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "one.txt"
    path.write_text((REPO / "benchmarks" / "chat-prompts.txt").read_text().splitlines()[0] + "\n")
    return path


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--seed", "1"]])
def test_tree_yield_runs(one_prompt: Path, sampling: list[str]) -> None:
    out = run_script("tree_yield.py", "--pair", PAIR, "--prompts", str(one_prompt), "--budgets", "4,16", "-n", "8",
                     *sampling)
    lines = out.splitlines()
    how = "temperature 0.8, seed 1" if sampling else "greedy"
    assert re.fullmatch(rf"{PAIR}, 1 prompts x 8 tokens \(\d+ in all\), {how}", lines[0])
    assert lines[1].split() == ["method", "budget", "accept", "tokens/pass", "passes/round", "grow", "s/round", "mean",
                                "depth"]
    rows = [line.split() for line in lines[2:]]
    assert [row[:3] for row in rows] == [["chain", "4", "match"], ["tree", "4", "match"], ["chain", "16", "match"],
                                         ["tree", "16", "match"]]
    assert all(1 <= float(row[3]) <= 8 for row in rows)  # a pass yields one token at least, and 8 is the reply


def test_tree_yield_runs_the_residual_rule_over_the_path(one_prompt: Path) -> None:
    """--accept match,residual: a row per rule; the residual one over PathTarget (the real target, path nodes only)."""
    out = run_script("tree_yield.py", "--pair", PAIR, "--prompts", str(one_prompt), "--budgets", "4", "-n", "8",
                     "--methods", "tree", "--temperature", "0.8", "--top-k", "40", "--seed", "1",
                     "--accept", "match,residual")
    lines = out.splitlines()
    assert re.fullmatch(rf"{PAIR}, 1 prompts x 8 tokens \(\d+ in all\), temperature 0.8, top-k 40, seed 1", lines[0])
    rows = [line.split() for line in lines[2:]]
    assert [row[:3] for row in rows] == [["tree", "4", "match"], ["tree", "4", "residual"]]
    assert all(1 <= float(row[3]) <= 8 for row in rows)


def test_tree_rounds_runs(one_prompt: Path) -> None:
    out = run_script("tree_rounds.py", "--pair", PAIR, "--prompts", str(one_prompt), "--budget", "4", "-n", "8")
    assert re.match(rf"{PAIR}, budget 4, 1 prompts x 8 tokens, greedy, \d+ rounds\n"
                    r"  accepted per round: tree [\d.]+, chain [\d.]+ \(from the same state\); rounds won: tree \d+, "
                    r"chain \d+\n  tree's top-token depth: [\d.]+ \(the chain's: up to 4\)\n"
                    r"  a node's log-probs with a masked sibling slot .*: largest shift [\d.]+, median [\d.]+ over 1 "
                    r"prompts\n$", out)


def test_draft_agreement_runs(one_prompt: Path) -> None:
    out = run_script("draft_agreement.py", "--pair", PAIR, "--prompts", str(one_prompt), "-n", "8")
    lines = out.splitlines()
    assert re.match(rf"{PAIR}, 1 prompts x 8 tokens \(8 positions\), greedy: the drafter's top token is the "
                    r"target's [\d.]+% of the time", lines[0])
    assert lines[1].split() == ["top", "p", "positions", "top", "right", "rank", "1", "ranks", "2+", "absent"]
    bins = [re.fullmatch(r" *([\d.]+)- *([\d.]+) +(\d+)( +[\d.]+){4}", line) for line in lines[2:-1]]
    assert bins and all(bins) and sum(int(row[3]) for row in bins) == 8  # every position in one bin
    assert lines[-1].startswith("a runner-up is right at most")


@pytest.fixture
def cache_with_vocabularies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment of a cache that is the real one (linked) plus two made-up vocabularies of the pair: K = 1
    keeps only token 0, K = 2 every token. Returns the environment for a script run."""
    from edge.models.cache import cache_dir
    from edge.models.loading import resolve_spec
    from edge.models.sources import vocab_path
    from edge.quant.vocab import RankedVocab

    import edge

    real, cache = cache_dir(), tmp_path / "cache"
    (cache / "prepared").mkdir(parents=True)
    for entry in real.iterdir() if real.is_dir() else []:
        if entry.name != "prepared":
            (cache / entry.name).symlink_to(entry)
    for entry in (real / "prepared").iterdir() if (real / "prepared").is_dir() else []:
        (cache / "prepared" / entry.name).symlink_to(entry)
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(cache))
    spec, _ = resolve_spec(edge.LoadOptions(pair=PAIR))
    n_vocab = 1 << 16  # above any id of the pair's (49152); the script reads only the kept ids
    for k, ids in ((1, [0]), (2, range(n_vocab))):
        RankedVocab(np.array(ids, np.int32), np.zeros(n_vocab, np.int64), n_vocab, "made up").save(
            vocab_path(spec.target, k))
    return {**os.environ, "EDGE_SPEC_CACHE": str(cache)}


def test_vocab_coverage_runs(one_prompt: Path, cache_with_vocabularies: dict[str, str]) -> None:
    args = ["benchmarks/vocab_coverage.py", "--pair", PAIR, "--prompts", str(one_prompt), "-n", "8"]
    run = subprocess.run([sys.executable, *args, "--vocab", "1,2"], capture_output=True, text=True, cwd=REPO,
                         env=cache_with_vocabularies, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == (f"{PAIR}: 8 greedy tokens of the target over 1 prompts\n"
                          "  vocab 1: 8 outside (100.00%)\n  vocab 2: 0 outside (0.00%)\n")
    run = subprocess.run([sys.executable, *args, "--vocab", "3"], capture_output=True, text=True, cwd=REPO,
                         env=cache_with_vocabularies, timeout=300)
    assert (run.returncode, run.stdout) == (1, "")  # one line that says what to do, before the pair loads
    assert run.stderr == (f"error: pair {PAIR}: no 3-token vocabulary yet; prepare it first (one target run over the "
                          f"calibration prompts): `edge-spec prepare {PAIR} --vocab 3`\n")


def test_ssd_timeline_runs(one_prompt: Path) -> None:
    """The shipped Q4_1 file as it is (llama.cpp reads it from the mapping here; an f16 one would be prepared)."""
    run = subprocess.run([sys.executable, "benchmarks/ssd_timeline.py", "--pair", PAIR, "--prompts", str(one_prompt),
                          "--target-dtype", "as-is", "--budget", "4", "-n", "8"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    if run.returncode == 1 and "error: --placement ssd" in run.stderr:
        pytest.skip(run.stderr.strip())  # llama.cpp repacks Q4_1 on this CPU: nothing to stream
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert re.fullmatch(rf"{PAIR}, budget 4 \(1 beams x 1 children, 4 passes\), 1 prompts x 8 tokens, (\d+) rounds "
                        r"\(ms from the round's start\)", lines[0])
    assert lines[1].split() == ["evict", "read_from", "read_to", "grow", "pass_to", "pass_after_read", "round"]
    assert lines[-2].endswith(" <- medians") and len(lines[-2].split()) == 7 + 2
    assert re.fullmatch(r"tokens per pass [\d.]+, mean round [\d.]+ ms, [\d.]+ tokens/s", lines[-1])


def test_dq_drafter_runs(one_prompt: Path) -> None:
    """Builds (once, cached beside the pair's int4 graph) and runs the DynamicQuantizeMatMul drafter."""
    out = run_script("dq_drafter.py", "--pair", PAIR, "--prompts", str(one_prompt), "-n", "8")
    names = ("llama_cpp", "onnx int4", "onnx dq7")
    expand = [line for line in out.splitlines() if "expand ms" in line]
    grow = [line for line in out.splitlines() if "budget 64:" in line]
    assert [line[:10].strip() for line in expand] == [line[:10].strip() for line in grow] == list(names)
    assert all(re.fullmatch(r".{10} budget 64: grow [\d.]+ s/round, [\d.]+ tokens/pass", line) for line in grow)


def test_lookup_peer_runs(tmp_path: Path) -> None:
    """edge-spec's rows and llama-cpp-python's LlamaPromptLookupDecoding on a JSON-lines prompt that asks again."""
    prompts = tmp_path / "again.jsonl"
    prompts.write_text(json.dumps([{"role": "user", "content": "Name three colors."},
                                   {"role": "assistant", "content": "Red, green and blue."},
                                   {"role": "user", "content": "Name three colors."}]) + "\n")
    result = json.loads(run_script("lookup_peer.py", "--pair", PAIR, "--prompts", str(prompts), "-n", "8",
                                   "--pred", "0,2", "--json"))
    rows = {row["row"]: row for row in result["rows"]}
    assert list(rows) == ["edge-spec plain", "edge-spec lookup auto", "edge-spec drafter+lookup auto",
                          "llama-cpp-python plain", "llama-cpp-python LlamaPromptLookupDecoding(2)"]
    assert rows["edge-spec lookup auto"]["matches_plain"] and rows["edge-spec drafter+lookup auto"]["matches_plain"]
    # llama-cpp-python's own settings (an f16 KV cache, its kernels) may tip a near tie another way: not compared
    assert all(row["new_tokens"] > 0 and row["decode_tokens_per_s"] > 0 for row in rows.values()), rows


def test_suite_times_compares_the_tests_both_runs_have(tmp_path: Path) -> None:
    """Two JUnit reports: the tests both have are compared one to one; a test only the newer has counts as added. The
    run's own time (with workers, less than its tests' added up) where the report has it."""
    def report(name: str, cases: dict[str, float], wall: str = "") -> Path:
        rows = "".join(f'<testcase classname="tests.test_a" name="{test}" time="{t}"/>' for test, t in cases.items())
        path = tmp_path / name
        path.write_text(f'<testsuites><testsuite name="pytest"{wall}>{rows}</testsuite></testsuites>')
        return path

    result = json.loads(run_script("suite_times.py", str(report("old.xml", {"one": 2.0, "two[x]": 3.0})),
                                   str(report("new.xml", {"one": 1.5, "two[x]": 3.0, "three": 4.0}, ' time="5.31"')),
                                   "--json"))
    assert result["old_wall_s"] is None and result["new_wall_s"] == 5.3  # (rounded to a tenth)
    assert result["both"] == {"tests": 2, "old_s": 5.0, "new_s": 4.5}
    assert result["added"]["tests"] == 1 and result["added"]["s"] == 4.0 and result["new_total_s"] == 8.5
    assert result["modules"] == {"test_a": [5.0, 4.5]}


def test_matmulnbits_runs() -> None:
    out = run_script("matmulnbits.py", "128", "64").splitlines()
    assert out[0].startswith("MatMulNBits [M, 128] x [128, 64]")
    assert len(out) == 2 + 7 + 3 and all(len(line.split()) >= 6 for line in out[2:9])


def test_readahead_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """In this process, once per way (the command line runs each twice)."""
    import importlib.util

    from edge.models.registry import load_registry
    from edge.models.sources import model_path

    path = model_path(load_registry().pair(PAIR).target)
    if path is None or not path.is_file():
        pytest.skip(f"{PAIR}'s target is not downloaded yet")
    spec = importlib.util.spec_from_file_location("readahead", REPO / "benchmarks" / "readahead.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(path, repeats=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(path.name) and len(lines) == 1 + 7
    assert all(re.search(r"resident +\d+%  1-token pass +\d+ ms", line) for line in lines[1:])


# ReplayTarget, on the tiny model: the real round loop answered from a known reply.


def decode(target: TinyModel, drafter: TinyModel | None, prompt: list[int], n: int, sampling: SamplingConfig,
           budget: int = 16):
    """(new tokens, stats) of a real decoding run."""
    decoder = Decoder(target, drafter, GrowConfig.for_budget(budget) if drafter else None, sampling)
    decoder.load(prompt)
    *_, last = decoder.generate(n)
    return decoder.context[len(prompt):], last.stats


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0, seed=7),
                                      SamplingConfig(temperature=0.8, top_k=4, top_p=0.9, repeat_penalty=1.3, seed=3)])
@pytest.mark.parametrize("budget", [4, 16, 64])
def test_a_replay_runs_the_rounds_the_real_target_runs(sampling: SamplingConfig, budget: int) -> None:
    """Over the target's plain reply, a Decoder yields that reply token for token, in the same rounds with the same
    trees as over the real target (one pass each), without running the target."""
    prompt, n = [1, 2, 3], 60
    target = TinyModel(n_vocab=9, seed=5)
    [reply] = plain_replies(target, [prompt], n, sampling)
    assert len(reply) == n
    real_tokens, real = decode(TinyModel(n_vocab=9, seed=5), target.noisy(0.7), prompt, n, sampling, budget)
    assert real_tokens == reply  # lossless: the reply is what a speculative run yields too

    replayed = ReplayTarget.like(target)
    passes = target.passes
    stats = replay(Decoder(replayed, target.noisy(0.7), GrowConfig.for_budget(budget), sampling), prompt, reply)
    assert target.passes == passes  # the real target ran no pass
    assert stats.new_tokens == n and stats.target_passes == stats.rounds == real.rounds < n
    assert (stats.tree_nodes, stats.drafter_passes) == (real.tree_nodes, real.drafter_passes)


def test_a_replay_stops_where_the_reply_stops() -> None:
    """A reply that ends at a stop token (which it holds, as a run counts it) ends the replay there, "stop"."""
    target = TinyModel(n_vocab=9, seed=5)
    [long_reply] = plain_replies(target, [[1, 2, 3]], 40, SamplingConfig())
    target.stop_tokens = frozenset({long_reply[12]})
    [reply] = plain_replies(target, [[1, 2, 3]], 40, SamplingConfig())
    assert reply[-1] == long_reply[12] and len(reply) <= 13
    decoder = Decoder(ReplayTarget.like(target), target.noisy(0.7), GrowConfig.for_budget(16))
    replay(decoder, [1, 2, 3], reply)
    assert decoder.context == [1, 2, 3, *reply]
    steps = list(decoder.generate(5))  # asked for more than the reply holds: the row past its end is a stop token
    assert steps[-1].finish_reason == "stop" and steps[-1].stats.new_tokens == 1


def test_replay_rows_answer_lazily_from_the_reply() -> None:
    """verify's rows put everything on the reply's token at each node's depth (the smallest stop token past the
    end), and are built only when read: a 256-node tree over a 262144-token vocabulary costs no [256, 262144]."""
    target = ReplayTarget(TinyModel(n_vocab=9).tokenizer, 262144, SpecialTokens(stop=frozenset({7, 5})))
    target.expect([10, 11, 12], [13, 14])
    target.prefill([10, 11])
    chain = TokenTree(np.array([12, 13, 99, 1], np.int32), np.array([-1, 0, 1, 2], np.int32),
                      np.arange(4, dtype=np.int32), np.zeros(4, np.float32))
    rows = target.verify(chain)
    assert target.passes == 2 and rows.shape == (4, 262144)  # prefill and verify: one pass each
    assert [int(np.argmax(rows[v])) for v in range(4)] == [13, 14, 5, 5]
    row = rows[0]
    assert row.dtype == np.float32 and row[13] == 0 and np.isneginf(np.delete(row, 13)).all()
    assert target.accepted_path(chain) == [0, 1]  # 99 is not the reply's
    target.commit(chain, [0, 1])
    assert (target.n_past, target.root, target.tokens_left) == (4, 14, 0)
    with pytest.raises(ValueError, match="rooted at token 13"):
        target.verify(TokenTree.root(13))
    with pytest.raises(ValueError, match="not the text"):
        target.prefill([99])


def test_replay_checks_its_decoder() -> None:
    tiny = TinyModel(n_vocab=9)
    with pytest.raises(TypeError):
        replay(Decoder(tiny), [1, 2], [3])
    sampling = replace(SamplingConfig(), temperature=0.5, seed=1)
    decoder = Decoder(ReplayTarget.like(tiny), tiny.noisy(0.5), GrowConfig.for_budget(8), sampling)
    [reply] = plain_replies(tiny, [[1, 2]], 20, sampling)
    assert replay(decoder, [1, 2], reply).new_tokens == 20
    assert replay(decoder, [1, 2], reply).new_tokens == 20  # again from the seed: the same reply


def test_serve_bodies_runs() -> None:
    """The hostile-bodies benchmark starts a real server and sends its bodies (3 MB here): each oversized one is refused
    from its size (a 413 before it is parsed), the packed one from its count of values, with no 5xx and no traceback;
    it reports /health's latency during each."""
    result = json.loads(run_script("serve_bodies.py", "--pair", PAIR, "--server-args", "--ctx 512", "--scale", "0.1"))
    statuses = {row["body"]: row["status"] for row in result["bodies"]}
    assert statuses == {"content_parts": 413, "stop_items": 413, "text": 413, "text_chunked": 413,
                        "text_within_bound": 400, "packed_values": 400}, result
    assert result["all_refused"] and result["log_tracebacks"] == 0 and result["log_500s"] == 0
    assert all(row["health_ms"]["polls"] > 0 for row in result["bodies"]) and result["worst_health_ms"] > 0


def test_serve_load_runs() -> None:
    """The load benchmark starts `serve --parallel 2`, sends the chat prompts alone and then from two clients at once,
    and reports both phases; every reply under load equals its reply alone."""
    result = json.loads(run_script("serve_load.py", "--pair", PAIR, "--clients", "2", "-n", "8", "--ctx", "512"))
    edge = result["edge_spec"]
    assert edge["replies_equal_alone"] == "8/8" and edge["log_tracebacks"] == 0, edge
    assert edge["replies_compared_by"] == "token ids"
    assert edge["together"]["clients"] == 2 and len(edge["together"]["client_tokens_per_s"]) == 2
    assert edge["alone"]["aggregate_tokens_per_s"] > 0 and edge["together"]["ttft_worst_s"] > 0


def test_serve_soak_runs() -> None:
    """The soak benchmark starts a real server with two API keys, streams from two clients (one a key), reports the
    server's memory, and probes whether one key's prompt shows in the other's cached tokens."""
    result = json.loads(run_script("serve_soak.py", "--pair", PAIR, "--clients", "2", "--requests", "4",
                                   "--max-tokens", "8", "--keys", "2"))
    assert result["completed"] == 4 and result["failed"] == 0 and not result["stopped_by_time_limit"]
    assert result["ttft_p50_s"] > 0 and result["rss_end_mb"] > 100 and result["requests_per_s"] > 0
    # two principals: the second key's guesses are not counted against the first key's prompt
    assert result["isolation"]["b_cached_tokens_after_a"] == dict.fromkeys(("4821", "4829", "4871", "4021", "9821"), 0)
