"""Requests decoding together in one target pass (runtimes/llama_cpp/lanes.py, `serve --parallel N`): each reply is
the one it gets alone, token for token, greedy and seeded; requests join and leave mid-reply; principals share a pass,
never a cell or a figure. On real SmolLM2, its target alone (no drafter), in this process."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
from edge.models.pair import Pair
from edge.runtimes.llama_cpp.lanes import Lanes
from edge.serve.app import create_app
from edge.serve.worker import Worker
from starlette.testclient import TestClient

import edge
from edge.generate import Decoder
from edge.options import LoadOptions
from edge.sampling import SamplingConfig
from tests.cli_helpers import assert_one_line_error, run
from tests.test_lossless import cut_qwen_target  # noqa: F401 (a fixture)

PROMPTS = ["Write a Python function that reverses a string.", "Name three colors.",
           "What is the capital of France?", "def fibonacci(n):"]
GREEDY = SamplingConfig(temperature=0.0)
SEEDED = SamplingConfig(temperature=0.8, seed=5)


@pytest.fixture(scope="module")
def alone_pair() -> Iterator[Pair]:
    """SmolLM2's target alone on the batch-invariant kernels, loaded for 4 lanes as `serve --parallel 4 --no-spec`
    loads it (with its drafter, the lanes grow trees: tests/test_tree_lanes.py)."""
    with edge.load("smollm2-135m", ctx=512, gpu_layers=0, parallel=4, drafter="none") as pair:
        yield pair


@pytest.fixture
def lanes(alone_pair: Pair) -> Iterator[Lanes]:
    made = alone_pair.lanes(4)
    yield made
    made.close()


def reply(lanes: Lanes, pair: Pair, lane: int, prompt: str, n: int, sampling: SamplingConfig,
          on_token: Callable[[int], None] | None = None, should_stop: Callable[[], bool] | None = None) -> list[int]:
    """One request in `lane`, as the server's worker runs it: a plain decoder over the lane, the lane busy meanwhile."""
    decoder = Decoder(lanes.target(lane), None, None, sampling)
    tokens = pair.prompt_tokens(prompt)
    lanes.busy(lane, True)
    try:
        out = []
        for step in decoder.reply(tokens, n, should_stop):
            if step.token is not None:
                out.append(step.token)
                if on_token is not None:
                    on_token(len(out))
        return out
    finally:
        lanes.busy(lane, False)


def together(*runs: Callable[[], list[int]]) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in runs]
    threads = [threading.Thread(target=lambda i=i, call=call: results.__setitem__(i, call())) for i, call in
               enumerate(runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_requests_in_one_pass_get_what_they_get_alone(lanes: Lanes, alone_pair: Pair,
                                                      sampling: SamplingConfig) -> None:
    """Four requests, each first alone, then all four at once: the same tokens, and the passes were shared (a lane's
    passes ride together with others')."""
    alone = [reply(lanes, alone_pair, lane, prompt, 24, sampling) for lane, prompt in enumerate(PROMPTS)]
    before = lanes.passes, lanes.lane_passes
    both = together(*[lambda lane=lane, prompt=prompt: reply(lanes, alone_pair, lane, prompt, 24, sampling)
                      for lane, prompt in enumerate(PROMPTS)])
    assert both == alone
    passes, lane_passes = lanes.passes - before[0], lanes.lane_passes - before[1]
    assert lane_passes >= 2 * passes, (passes, lane_passes)  # most passes carried several lanes


def test_a_request_joining_mid_reply_changes_no_ones_tokens(lanes: Lanes, alone_pair: Pair) -> None:
    alone = [reply(lanes, alone_pair, lane, prompt, 32, GREEDY) for lane, prompt in enumerate(PROMPTS[:2])]
    started = threading.Event()
    first = lambda: reply(lanes, alone_pair, 0, PROMPTS[0], 32, GREEDY,  # noqa: E731
                          on_token=lambda n: started.set() if n == 10 else None)

    def second() -> list[int]:
        started.wait(60)
        return reply(lanes, alone_pair, 1, PROMPTS[1], 32, GREEDY)

    assert together(first, second) == alone


def test_a_request_leaving_mid_reply_frees_its_lane(lanes: Lanes, alone_pair: Pair) -> None:
    """A client that leaves after 5 tokens: the other's reply is unchanged; the leaver's lane can be emptied at once,
    and the next request there gets what it gets alone."""
    alone = reply(lanes, alone_pair, 1, PROMPTS[1], 32, GREEDY)
    leaving = threading.Event()
    first = lambda: reply(lanes, alone_pair, 0, PROMPTS[0], 64, GREEDY,  # noqa: E731
                          on_token=lambda n: leaving.set() if n == 5 else None, should_stop=leaving.is_set)
    short, other = together(first, lambda: reply(lanes, alone_pair, 1, PROMPTS[1], 32, GREEDY))
    assert len(short) == 5 and other == alone
    lanes.target(0).truncate(0)
    assert lanes.ctx.seq_pos_max(0) == -1
    assert reply(lanes, alone_pair, 0, PROMPTS[1], 32, GREEDY) == alone


def test_lanes_detokenize_at_once(alone_pair: Pair) -> None:
    """Four lanes' threads turn tokens into text at once: each gets its own bytes (a shared buffer gave one reply
    another's pieces: "The,Setital of France")."""
    tokenizer = alone_pair.target.tokenizer
    expected = [tokenizer.token_bytes(token) for token in range(2000)]
    seen = together(*[lambda: [tokenizer.token_bytes(token) for token in range(2000)] for _ in range(4)])
    assert all(got == expected for got in seen)


def test_a_stock_target_is_refused_lanes() -> None:
    """A target loaded on llama.cpp's own kernels (plain decoding alone) rounds by batch size: no lanes, one line."""
    with edge.load("smollm2-135m", ctx=512, gpu_layers=0, speculate="auto") as pair:
        if pair.plan_use != "plain":
            pytest.skip(f"the plan kept {pair.plan_use} here")
        with pytest.raises(edge.UserError, match="set `parallel` to 1"):
            pair.lanes(2)


A, B = "key-of-a", "key-of-b"


def completions(client: TestClient, max_tokens: int) -> Callable[[str, str], dict]:
    """ask(key, prompt): a greedy completion of `prompt` for the principal of `key`, its JSON."""

    def ask(key: str, prompt: str) -> dict:
        answer = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert answer.status_code == 200, answer.text
        return answer.json()

    return ask


def test_principals_share_a_pass_and_nothing_else(alone_pair: Pair) -> None:
    """`serve --parallel 2` with two keys: A and B ask at once; each gets its reply alone, and B's cached tokens are 0
    after A sent the same prompt (a lane keeps a prompt only for its own principal's next turn)."""
    worker = Worker(alone_pair, False, None, parallel=2)
    try:
        with TestClient(create_app(alone_pair, worker, (A, B))) as client:
            ask = completions(client, 16)
            asked = ((A, PROMPTS[0]), (B, PROMPTS[1]))
            alone = {key: ask(key, prompt)["choices"][0]["text"] for key, prompt in asked}
            results: dict[str, dict] = {}
            threads = [threading.Thread(target=lambda k=key, p=prompt: results.__setitem__(k, ask(k, p)))
                       for key, prompt in asked]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            assert {key: result["choices"][0]["text"] for key, result in results.items()} == alone
            ask(A, PROMPTS[2])
            cached = ask(B, PROMPTS[2])["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == 0
            assert ask(A, PROMPTS[2] + " Answer in one word.")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        worker.close()


def test_a_cache_lanes_cannot_write_to_keeps_no_conversation(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A cache folder the server may not write to (here: a file where the folder should be): the lanes keep no
    conversation on the drive, and the log says so in one line; the server still serves."""
    import edge.serve.worker as worker_module

    blocked = tmp_path / "cache"
    blocked.write_text("not a folder")
    monkeypatch.setattr(worker_module, "cache_dir", lambda: blocked)
    with caplog.at_level("WARNING", logger="edge.serve"):
        assert worker_module.kept_conversations() is None
    assert "not kept" in caplog.text and len(caplog.records) == 1


def test_a_client_leaving_mid_reply_leaves_no_cell_taken(alone_pair: Pair) -> None:
    """`serve --parallel 2`: a job cancelled after 5 tokens (its client left) lets go of its lane's cells, and once
    the lanes are idle they start over (the conversations they hold kept on the drive): no cell is taken, and the
    next request gets the reply it got alone."""
    import asyncio
    import time

    from edge.serve.worker import Work

    worker = Worker(alone_pair, False, None, parallel=2)
    lanes = worker.lanes
    tokens = alone_pair.prompt_tokens(PROMPTS[0])

    async def run(leave_after: int = 0) -> list[int]:
        job, got = worker.submit(Work(tokens, GREEDY, 48)), []
        async for step in job.steps():
            got += [] if step.token is None else [step.token]
            if len(got) == leave_after:
                job.cancel()
        return got

    try:
        alone = asyncio.run(run())
        assert len(asyncio.run(run(leave_after=5))) < len(alone)
        deadline = time.monotonic() + 30
        while (worker.running or lanes.dead) and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.05)
        assert lanes.dead == 0  # type: ignore[union-attr]
        assert all(lanes.ctx.seq_pos_max(lanes.seq(lane)) == -1 for lane in range(2))  # type: ignore[union-attr]
        assert asyncio.run(run()) == alone
    finally:
        worker.close()


def test_requests_queued_at_once_each_start_in_an_idle_lane(alone_pair: Pair) -> None:
    """`serve --parallel 4`, lanes empty: four requests queued before any lane looks rank the same lane first. Each
    starts at once in a lane of its own, not after another request ends (the lanes rank the waiting requests again
    whenever one takes a request: a lane asleep would otherwise leave a request waiting a whole reply)."""
    import asyncio
    import time

    from edge.serve.worker import Job, Work

    worker = Worker(alone_pair, False, None, parallel=4)
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job(Work(alone_pair.prompt_tokens(prompt), GREEDY, 64), loop) for prompt in PROMPTS]
        with worker._wake:  # all four wait before any lane picks one
            worker._waiting.extend(jobs)
            worker._wake.notify_all()
        deadline = time.monotonic() + 60
        while worker.running < 4 and worker.completed == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (worker.running, worker.completed) == (4, 0)
    finally:
        worker.close()
        loop.close()


class LayerCount:
    """A layer hook (ggml_calls.LayerHook) counting each layer's outputs."""

    def __init__(self) -> None:
        self.layers: list[int] = []

    def __call__(self, layer: int) -> None:
        self.layers.append(layer)

    def active(self) -> bool:
        return True


def test_a_pass_of_several_lanes_computes_each_layer_once(alone_pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's lanes share one KV cache (Pair.lanes), so llama.cpp runs lanes 0 and 2's tokens as one
    micro-batch: each layer once. Over a KV stream a lane (the lanes before 3e3623b), it made one micro-batch per run of
    consecutive seq ids, each computing every layer (for a streamed target, its weights read again)."""
    import edge.runtimes.llama_cpp.tree_lanes as tree_lanes

    count, made = LayerCount(), tree_lanes.Context
    monkeypatch.setattr(tree_lanes, "Context", lambda *args, **kwargs: made(*args, **{**kwargs, "on_layer": count}))
    lanes = alone_pair.lanes(4)
    try:
        tokens = alone_pair.prompt_tokens(PROMPTS[0])
        for lane in (0, 2):
            lanes.run(lane, tokens, 0, output=False)
            lanes.busy(lane, True)
        lanes.gather_s = 30.0  # the pass waits for both lanes' tokens
        count.layers.clear()
        runs = [threading.Thread(target=lanes.run, args=(lane, tokens[-1:], len(tokens), True)) for lane in (0, 2)]
        for run in runs:
            run.start()
        for run in runs:
            run.join(60)
        assert lanes.passes >= 3 and count.layers.count(0) == 1
    finally:
        lanes.close()


LONG = ["The lighthouse keeper climbed the spiral stairs every evening, counting each of the one hundred and twelve "
        "steps, and wrote the weather, the ships he saw and the color of the sea in a small leather book. One night",
        "In the old market of the town, a baker sold bread shaped like animals: bears, foxes, owls and a single "
        "dragon on feast days, which the children waited for all year long. On the morning of the feast",
        "A list of things to pack for a week of hiking in the mountains, with a reason for each item, starting with "
        "the boots, the map and the water bottle, and ending with something most people forget:"]


def test_a_conversation_a_lane_let_go_of_is_put_back_for_its_principal_alone(alone_pair: Pair) -> None:
    """`serve --parallel 2`: a third conversation takes the lane of the first (or the idle lanes start over), which
    is kept on the drive (serve/states.py); A's next turn of the first finds its prompt read (cached_tokens), and gets
    the reply it gets read anew; B, asking the same, finds nothing of A's. The folder goes with the server."""
    worker = Worker(alone_pair, False, None, parallel=2)
    states = worker._states
    assert states is not None
    try:
        with TestClient(create_app(alone_pair, worker, (A, B))) as client:
            ask = completions(client, 12)
            for prompt in LONG:  # the third takes the first's lane at the latest: the first is kept
                ask(A, prompt)
            first = alone_pair.prompt_tokens(LONG[0], raw=True)
            assert any(kept.context[: len(first)] == tuple(first) for kept in states._kept)
            assert all(kept.path.exists() for kept in list(states._kept))  # (idle lanes may be keeping more now)
            restored = states.restored
            again = ask(A, LONG[0] + " the storm")
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(first) - 2
            assert states.restored == restored + 1
            anew = ask(B, LONG[0] + " the storm")
            assert anew["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert anew["choices"][0]["text"] == again["choices"][0]["text"]
    finally:
        worker.close()
    assert not states.folder.exists()


def test_passes_padded_for_a_gpu_backend_keep_each_reply(alone_pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A target whose passes are padded (a Vulkan backend's 9 rows: runtimes/llama_cpp/kernels.py MIN_ROWS) pads the
    lanes' passes too, in one KV cache (a padded pass must be one micro-batch: Pair.lanes), the padding in a seq of
    its own: on the CPU it changes no logit, so two requests together still get what they get alone, and the padding
    left no cell behind."""
    from edge.runtimes.llama_cpp.models import LlamaTarget
    from edge.runtimes.llama_cpp.tree_lanes import TreeLanes

    target = alone_pair.target
    assert isinstance(target, LlamaTarget)
    monkeypatch.setattr(target, "min_rows", 9)
    monkeypatch.setattr(target, "split_rows", 1)  # a GPU backend's lanes pad their passes, never split them
    padded = alone_pair.lanes(2)
    assert isinstance(padded, TreeLanes)
    try:
        alone = [reply(padded, alone_pair, lane, PROMPTS[lane], 16, GREEDY) for lane in range(2)]
        assert together(*(lambda lane=lane: reply(padded, alone_pair, lane, PROMPTS[lane], 16, GREEDY)
                          for lane in range(2))) == alone
        assert padded.padded > 0 and padded.ctx.seq_pos_max(padded.pad_seq) == -1
    finally:
        padded.close()


def test_serve_parallel_refusals_are_one_line() -> None:
    assert_one_line_error(run("serve", "smollm2-135m", "--port", "0", "--parallel", "0"), "--parallel must be 1 to 64")
    assert_one_line_error(run("serve", "smollm2-135m", "--port", "0", "--parallel", "many"),
                          "--parallel must be a number of requests or auto")


def test_parallel_auto_takes_lanes_where_they_share_a_pass_that_moves_weights() -> None:
    """`serve --parallel auto` (the default): four lanes on a GPU that holds the target and their KV caches; one in RAM
    on the CPU (a pass of four tokens there costs about four of one, and one request runs on llama.cpp's own faster
    kernels), and one where their KV caches would push the target's weights out to be read again every pass."""
    from edge.models.loading import lanes_that_fit

    options = LoadOptions(pair="qwen2.5-coder-1.5b")  # the plan works from models.toml's facts without the files
    assert lanes_that_fit(options, machine="ram=32G,vram=24G") == (
        4, "the memory holds 4 requests' KV caches beside the target, and they share its passes")
    lanes, why = lanes_that_fit(options, machine="ram=32G")
    assert lanes == 1 and "compute on the CPU" in why
    lanes, why = lanes_that_fit(options, machine="ram=3G")
    assert lanes == 1 and "less of the target in memory" in why


def step_logits(lanes: Lanes, prompts: list[list[int]], at_once: bool) -> list:
    """Each lane's prompt, then its next token's logits: one pass a lane, or every lane's token in one pass; the
    step's cell dropped after (the prompts stay)."""
    import numpy as np

    def step(lane: int) -> np.ndarray:
        logits = lanes.run(lane, [prompts[lane][-1]], len(prompts[lane]) - 1, output=True)
        assert logits is not None
        return logits

    for lane in range(len(prompts)):
        lanes.busy(lane, at_once)
    try:
        if at_once:
            out: list = [None] * len(prompts)
            threads = [threading.Thread(target=lambda lane=lane: out.__setitem__(lane, step(lane)))
                       for lane in range(len(prompts))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
        else:
            out = [step(lane) for lane in range(len(prompts))]
    finally:
        for lane in range(len(prompts)):
            lanes.busy(lane, False)
            lanes.remove(lane, len(prompts[lane]) - 1)
    return out


def test_lanes_over_repacked_weights_pad_each_pass_to_their_gemm(cut_qwen_target) -> None:  # noqa: F811
    """In RAM, lanes keep llama.cpp's repacked Q4_K buffers, whose x86 kernel takes a pass's rows in fours on a GEMM
    and the rest on a GEMV: each pass is padded to multiples of 4 rows and outputs (kernels.REPACK_ROWS), so a token's
    logits are bit for bit the same alone and beside three others (the real pair's target, cut to 2 layers: Q4_K and
    Q6_K as shipped). Its twin, the same buffers unpadded, differs."""
    import numpy as np
    from edge.runtimes.llama_cpp import RunOptions, load_target
    from edge.runtimes.llama_cpp._native import USE_EXTRA_BUFFERS
    from edge.runtimes.llama_cpp.kernels import prefer_tiled
    from edge.runtimes.llama_cpp.tree_lanes import TreeLanes

    if not USE_EXTRA_BUFFERS:
        pytest.skip("llama.cpp's repacked buffers are off on this CPU (AMX: runtimes/llama_cpp/_native.py)")
    prefer_tiled(False)  # as lanes load (the Q6_K blocks on the dot-product kernels at every size)
    for multiple, exact in ((4, True), (1, False)):
        target = load_target(cut_qwen_target, RunOptions(n_ctx=256, kv_type="bf16", repack=True,
                                                         row_multiple=multiple), 1, sequences=1)
        lanes = TreeLanes(target, 4, 256)  # one KV cache: a pass is one micro-batch (Pair.lanes)
        try:
            prompts = [target.tokenizer.tokenize(prompt, add_special=False, parse_special=False)
                       for prompt in PROMPTS]
            for lane, tokens in enumerate(prompts):
                lanes.run(lane, tokens[:-1], 0, output=False)
            alone, at_once = step_logits(lanes, prompts, False), step_logits(lanes, prompts, True)
            same = all(np.array_equal(a, b) for a, b in zip(alone, at_once, strict=True))
            assert same == exact, max(float(np.abs(a - b).max()) for a, b in zip(alone, at_once, strict=True))
            assert (lanes.padded > 0) == exact and lanes.ctx.seq_pos_max(lanes.pad_seq) == -1
        finally:
            lanes.close()
            target.close()


def test_a_pass_is_padded_to_whole_fours_of_rows_and_outputs() -> None:
    from edge.runtimes.llama_cpp.kernels import lane_padding, padding_room

    assert lane_padding(1, 1, 1, 4) == (4, 3)
    assert lane_padding(4, 4, 1, 4) == (4, 0)
    assert lane_padding(13, 4, 1, 4) == (16, 0)  # three lanes' tokens and a prompt's chunk: rows short, outputs not
    assert lane_padding(12, 5, 1, 4) == (16, 3)  # rows whole, outputs short: four more rows, three of them outputs
    assert lane_padding(5, 1, 1, 4) == (8, 3)
    assert lane_padding(3, 1, 9, 1) == (9, 6)  # a GPU backend's 9 rows, each padding row an output
    assert lane_padding(12, 2, 9, 1) == (12, 0)
    for rows in range(1, 40):
        for outputs in range(0, rows + 1):
            padded, more = lane_padding(rows, outputs, 1, 4)
            assert padded % 4 == 0 and (outputs + more) % 4 == 0 and more <= padded - rows
            assert padded - rows <= padding_room(1, 4)


def test_kept_conversations_stay_within_their_budget_and_with_their_principal(tmp_path) -> None:
    """serve/states.py alone: past its budget the least recently used conversation goes (its file too); a request
    finds only its own principal's; one that extends a kept conversation replaces it; close removes the folder."""
    from edge.serve.states import PromptStates

    states = PromptStates(tmp_path, budget=250)

    def write(size: int):
        return lambda path: path.write_bytes(b"x" * size)

    states.keep("a", [1, 2, 3, 4], write(100))
    states.keep("a", [5, 6, 7], write(100))
    states.keep("b", [1, 2, 3, 9], write(100))  # 300 bytes: a's first goes
    assert len(list(states.folder.iterdir())) == 2
    assert states.best("a", [1, 2, 3, 4, 5], 0) is None  # gone, and b's is not a's
    assert states.best("b", [1, 2, 3, 4], 0).context == (1, 2, 3, 9)
    assert states.best("b", [1, 2, 3, 4], 3) is None  # it holds 3 of them, not more
    states.keep("b", [1, 2, 3, 9, 10, 11], write(50))  # b's next turn replaces its last
    assert [kept.context for kept in states._kept if kept.principal == "b"] == [(1, 2, 3, 9, 10, 11)]
    assert len(list(states.folder.iterdir())) == 2
    states.close()
    assert not states.folder.exists()


SPLIT_LANES_IN_A_CHILD = r"""
import json, sys, threading
from pathlib import Path

import numpy as np
from edge.runtimes.llama_cpp import RunOptions, load_target
from edge.runtimes.llama_cpp.kernels import TILED, prefer_stock
from edge.runtimes.llama_cpp.tree_lanes import TreeLanes
import os

prefer_stock()  # as plain lanes over a target in RAM load: llama.cpp's kernels by a pass's rows
target = load_target(Path(sys.argv[1]), RunOptions(n_ctx=256, kv_type="bf16", repack=False,
                                                   split_rows=int(sys.argv[2])), 1, sequences=1)
lanes = TreeLanes(target, 4, 256, trees=False)
prompts = [target.tokenizer.tokenize(text, add_special=False, parse_special=False) for text in json.loads(sys.argv[3])]
STEPS = 6


def reply(lane, started=None):  # the prompt, then STEPS greedy tokens: each step's logits
    tokens, out = prompts[lane], []
    lanes.busy(lane, True)
    lanes.run(lane, tokens[:-1], 0, output=False)
    token, pos = tokens[-1], len(tokens) - 1
    for step in range(STEPS):
        logits = lanes.run(lane, [token], pos, output=True)
        out.append(logits)
        token, pos = int(logits.argmax()), pos + 1
        if started is not None and step < len(started):
            started[step].set()  # the next lane's prompt joins while this lane decodes
    lanes.busy(lane, False)
    return out


alone = []
for lane in range(4):
    alone.append(reply(lane))
    lanes.remove(lane, 0)
starts = [threading.Event() for _ in range(3)]
got = [None] * 4


def run(lane):
    if lane:
        starts[lane - 1].wait(60)
    got[lane] = reply(lane, starts if lane == 0 else None)


threads = [threading.Thread(target=run, args=(lane,)) for lane in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(120)
worst = max(float(np.abs(np.array(a) - np.array(b)).max()) for a, b in zip(alone, got))
print(json.dumps({"worst": worst, "padded": lanes.padded, "pad_cells": lanes.ctx.seq_pos_max(lanes.pad_seq),
                  "tiled": os.environ.get(TILED)}))
lanes.close()
target.close()
"""


def test_plain_lanes_in_ram_split_each_pass_by_rows_on_llama_cpps_kernels(cut_qwen_target) -> None:  # noqa: F811
    """Plain lanes over a target in RAM run on llama.cpp's own kernels by rows (kernels.prefer_stock: K-quants on the
    tiled kernel from 8 rows, several times faster for a prompt), and split each pass into the rows that only fill the
    cache, padded to 8 or more, and the rows that output: each lane's logits are bit for bit the same alone and while
    other lanes' prompts join mid-reply (the real pair's target cut to 2 layers: Q4_K and Q6_K as shipped). Its twin,
    the same kernels with unsplit passes, differs. In a child: ggml reads its kernel switches once a process."""
    import json
    import subprocess
    import sys

    from edge.runtimes.llama_cpp.kernels import TILED_MIN_ROWS

    prompts = json.dumps([PROMPTS[0], "Hi.", PROMPTS[2] * 3, PROMPTS[3]])  # prompts of 3 to 30 tokens

    def child(split: int) -> dict:
        done = subprocess.run([sys.executable, "-c", SPLIT_LANES_IN_A_CHILD, str(cut_qwen_target), str(split), prompts],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    split = child(TILED_MIN_ROWS)
    assert split["tiled"] is None  # llama.cpp's choice by rows, not edge-spec's dot-product kernels everywhere
    assert split["worst"] == 0.0 and split["padded"] > 0 and split["pad_cells"] == -1
    assert child(1)["worst"] > 0.0
