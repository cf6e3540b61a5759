"""`edge-spec check` as a library call: is this target batch-invariant on this machine, with this KV cache type?"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edge.errors import UserError
from edge.grow import MAX_LEAVES
from edge.invariance import ShapeResult, check_batch_invariance, sequential_logits
from edge.protocols import verifies_chains_only

# A fixed text, so results are comparable between machines and files.
TEXT = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz combined "
        "movable metal type, oil-based ink and a wooden screw press. Within fifty years, presses were running in "
        "more than two hundred cities across Europe, and the price of books fell sharply. ") * 3


def run_check(path: Path, kv_type: str, threads: int | None, report, gpu_layers: int = 0,
              lanes: bool = True) -> dict[str, Any]:
    """`gpu_layers`: the target's layers on the GPU (llama.cpp's count: its layers + 1 puts them all there).
    `lanes`: also several requests' tokens in one pass, as `serve --parallel` runs them (on llama.cpp)."""
    from edge.models.planning import check_gpu_layers
    from edge.models.registry import KV_TYPES
    from edge.runtimes import DEFAULT, ModelOptions, runtime
    from edge.runtimes.gguf_file import check_gguf

    if kv_type not in KV_TYPES:
        raise UserError(f"kv_type must be one of {', '.join(KV_TYPES)} (got {kv_type!r})", "kv_type")
    if gpu_layers < 0:
        raise UserError(f"gpu_layers must be 0 or more (got {gpu_layers})", "gpu_layers")
    check_gpu_layers(gpu_layers)
    info = check_gguf(path)
    engine = runtime(DEFAULT)  # loaded as a pair loads a target of this file
    target = engine.open_target(path, ModelOptions(n_ctx=1024, kv_type=kv_type, threads=threads,
                                                   gpu_layers=gpu_layers), MAX_LEAVES + 1)
    drafter = engine.open_drafter(path, ModelOptions(n_ctx=1024, kv_type="q4_0", threads=threads), MAX_LEAVES + 1)
    try:
        tokens = target.tokenizer.tokenize(TEXT, add_special=True, parse_special=False)[:160]
        shapes = ("two chains (trees are cut to their likeliest path on this backend: runtimes/llama_cpp/kernels.py "
                  "CHAIN_BACKENDS)" if verifies_chains_only(target) else "three tree shapes")
        report(f"checking {path.name}: {len(tokens)} tokens of context, {shapes}")
        started = time.perf_counter()

        def progress(shape: str, done: int, total: int) -> None:
            left = (time.perf_counter() - started) / done * (total - done)
            report(f"checked the {shape} tree ({done} of {total} shapes" + (f", about {left:.0f} s left)"
                                                                            if done < total else ")"))

        results = check_batch_invariance(target, drafter, tokens, progress)
        if lanes and lanes_run_on(target):  # several requests' tokens in one pass (serve --parallel)
            results.append(check_lanes(target, tokens))
            report("checked 4 lanes in one pass")
            results.append(check_tree_lanes(target, drafter, tokens))
            report(f"checked the trees of {TREE_LANES} lanes in one pass")
        shapes = [dataclasses.asdict(r) for r in results]
    finally:
        drafter.close()
        target.close()
    return {
        "file": str(path),
        "weight_types": sorted(info.weight_types),
        "kv_type": kv_type,
        "backend": engine.backend_line(),  # what llama.cpp runs layers on here
        "gpu_layers": gpu_layers,
        "bit_exact": all(s["max_abs_diff"] == 0.0 for s in shapes),
        "edge_spec_guarantee": engine.lossless_guarantee(info.weight_types, kv_type, "target_dtype q8_0") is None,
        "shapes": shapes,
    }


LANES, LANE_STEPS = 4, 16
TREE_LANES, LANE_TREE = 3, 63  # serve --parallel 3 with a drafter: each lane's tree up to 64 nodes


def lanes_run_on(target: Any) -> bool:
    from edge.runtimes.llama_cpp.models import LlamaTarget

    return isinstance(target, LlamaTarget)


def check_lanes(target: Any, tokens: list[int]) -> ShapeResult:
    """4 requests decoding together in one pass each step, in one KV cache as a server's plain lanes decode
    (runtimes/llama_cpp/tree_lanes.py, Pair.lanes), each after its own context, against each decoded alone one token
    a pass: every step's logits, bit for bit."""
    from edge.runtimes.llama_cpp.tree_lanes import TreeLanes

    starts = [8 * lane for lane in range(LANES)]  # each lane a context of its own: the text from another token on
    prefixes = [tokens[start: start + 96] for start in starts]
    steps = [tokens[start + 96: start + 96 + LANE_STEPS] for start in starts]
    expected = [sequential_logits(target, prefix, step) for prefix, step in zip(prefixes, steps, strict=True)]
    target.truncate(0)
    lanes = TreeLanes(target, LANES, 256, trees=False)
    got: list[list[np.ndarray]] = [[] for _ in range(LANES)]

    def decode(lane: int) -> None:
        lanes.run(lane, prefixes[lane], 0, output=False)
        for i, token in enumerate(steps[lane]):
            logits = lanes.run(lane, [token], len(prefixes[lane]) + i, output=True)
            assert logits is not None
            got[lane].append(logits)

    in_lanes(lanes, decode)
    worst = max(float(np.abs(np.array(got[lane]) - expected[lane]).max()) for lane in range(LANES))
    flips = sum(int((np.array(got[lane]).argmax(1) != expected[lane].argmax(1)).sum()) for lane in range(LANES))
    return ShapeResult(f"{LANES} lanes in one pass", LANES, LANES * LANE_STEPS, worst, flips)


def check_tree_lanes(target: Any, drafter: Any, tokens: list[int]) -> ShapeResult:
    """The trees of 3 requests verified together (runtimes/llama_cpp/tree_lanes.py), each after its own context:
    each lane checks its drafter-grown tree node by node against plain decoding (edge.invariance.compare) at the
    same time as the others, so tree passes and one-token passes of different lanes share passes."""
    from dataclasses import replace

    from edge.runtimes.llama_cpp.tree_lanes import TreeLanes

    from edge.grow import GrowConfig, grow
    from edge.invariance import compare

    starts = [8 * lane for lane in range(TREE_LANES)]
    prefixes = [tokens[start: start + 96] for start in starts]
    roots = [tokens[start + 96] for start in starts]
    trees = []
    for prefix, root in zip(prefixes, roots, strict=True):
        drafter.truncate(0)
        drafter.prefill(prefix)
        trees.append(grow(drafter, root, replace(GrowConfig.for_budget(LANE_TREE), extend_prob=None))[0])
    drafter.truncate(0)
    target.truncate(0)
    lanes = TreeLanes(target, TREE_LANES, 256)
    results: list[tuple[int, float, int]] = [(0, 0.0, 0)] * TREE_LANES

    def check(lane: int) -> None:
        results[lane] = compare(lanes.target(lane), trees[lane], prefixes[lane], max_paths=20)

    in_lanes(lanes, check)
    return ShapeResult(f"trees of {TREE_LANES} lanes in one pass", sum(len(tree) for tree in trees),
                       sum(checked for checked, _, _ in results), max(worst for _, worst, _ in results),
                       sum(flips for _, _, flips in results))


def in_lanes(lanes: Any, work: Callable[[int], None]) -> None:
    """work(lane) for every lane at once, each on a thread of its own with its lane busy meanwhile (as the server's
    worker runs requests); then the lanes close, and the first error raised in a thread is raised here."""
    import threading

    errors: list[BaseException] = []

    def run(lane: int) -> None:
        lanes.busy(lane, True)
        try:
            work(lane)
        except BaseException as problem:
            errors.append(problem)
        finally:
            lanes.busy(lane, False)

    threads = [threading.Thread(target=run, args=(lane,)) for lane in range(lanes.n)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        lanes.close()
    if errors:
        raise errors[0]
