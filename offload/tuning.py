"""Measuring what `--budget auto` decides from (edge/budget.py): a target's pass times over n tokens, a drafter's over
n nodes, and, for a target streamed from the drive, how its passes overlap the reading ahead. Done once per machine,
placement and pair (models/pair.py caches the result).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from edge.budget import LARGE, Costs, is_flat
from edge.protocols import Drafter, Target
from edge.tree import TokenTree

SLOW_PASS_S = 1.0  # pass_ms: a pass this long is timed once (its noise is small against its length)
LONG_PASS_S = 10.0  # pass_ms: after a pass this long, larger sizes are extrapolated from the two measured
# Chains timed, in this order. 2, 4, 8 and 32 tokens: a pass over a few tokens is not on the line through 1 and 16
# where the kernels change past one token (the real pair's exact K-quant kernels in RAM here: 39 ms for one token,
# 81 ms for two, where that line says 62; docs/performance.md), and kernels that take tokens in groups make sizes
# between two measured ones cost more than a line says (AutoBudget.pass_s): lookup trees are sized to these passes.
# 16 comes before them, so a pass over LONG_PASS_S (a 70B from the drive) still stops after 1 and 16 and
# extrapolates the rest from those.
PASS_SIZES = (1, 16, 2, 4, 8, 32, 64, 256)


def measure_costs(target: Target, drafter: Drafter | None, prefix: list[int], max_tree: int,
                  large: bool = True) -> Costs:
    """Time the target (chains of 1..max_tree tokens) and the drafter (1, 8, 32 nodes; none: lookup drafting alone)
    after `prefix`; with `large`, where the target's passes are flat (is_flat), also chains of LARGE tokens, after
    enlarging both (fit_trees)."""
    sizes = tuple(n for n in PASS_SIZES if n <= max_tree) or (1,)
    cold = pass_ms(target, prefix, sizes, repeats=3)
    drafter_ms = {} if drafter is None else expand_ms(drafter, prefix, repeats=3)
    streamer = target.streamer
    if streamer is None or not streamer.readahead:
        costs = Costs(cold, drafter_ms)
    else:
        read_ahead = streamer.time_read_ahead()
        warm = pass_ms(target, prefix, sizes, repeats=3, before=streamer.read_ahead_now)
        overlap = pass_ms(target, prefix, sizes, repeats=3, before=streamer.prefetch)  # the reading starts with it
        # a windowed read-ahead reads at most its window before the pass: the time that takes, at the same rate
        window = None if streamer.window is None else round(
            1000 * read_ahead * min(streamer.window / max(target.path.stat().st_size, 1), 1.0), 3)
        costs = Costs(cold, drafter_ms, round(1000 * read_ahead, 3), warm, overlap, window)
    if not large or not is_flat(costs) or not fit_trees(target, drafter, LARGE[-1] + 1):
        return costs
    cold.update(pass_ms(target, prefix, LARGE, repeats=3))
    if drafter is not None:
        drafter_ms.update(expand_ms(drafter, prefix, (64, 128), repeats=3))  # for_budget's beams at 1024 and 2048
    if streamer is not None and costs.warm_ms is not None and costs.overlap_ms is not None:
        costs.warm_ms.update(pass_ms(target, prefix, LARGE, repeats=3, before=streamer.read_ahead_now))
        costs.overlap_ms.update(pass_ms(target, prefix, LARGE, repeats=3, before=streamer.prefetch))
    return costs


def fit_trees(target: Target, drafter: Drafter | None, nodes: int) -> bool:
    """Whether the target can verify trees of `nodes` nodes and the drafter grow them, after resizing each that can be
    (llama.cpp: a larger batch and KV room over the same weights; their caches start empty). Some targets have a fixed
    verify batch (an onnx target's is 256 nodes)."""
    if nodes > target.max_tree and not target.resize(nodes):
        return False
    return drafter is None or nodes - 1 <= drafter.expand_capacity or drafter.resize(nodes - 1)


def pass_ms(target: Target, prefix: list[int], sizes: tuple[int, ...] = (1, 16, 64), repeats: int = 5,
            before: Callable[[], None] | None = None, slow_s: float = SLOW_PASS_S,
            long_s: float = LONG_PASS_S) -> dict[int, float]:
    """Median milliseconds of one target pass over a chain of n new tokens after `prefix` (`before()`, untimed,
    runs ahead of each pass). A pass longer than `slow_s` is timed once; after one longer than `long_s` the
    larger sizes are left to extrapolation (_interpolate), once two sizes are measured: a 70B target streamed from
    the drive takes ~20 s a token, and timing 64 tokens five times would take a quarter of an hour."""
    target.truncate(0)
    target.prefill(prefix[:-1])
    result: dict[int, float] = {}
    for n in sizes:
        if len(result) >= 2 and result[max(result)] > 1000 * long_s:
            break
        chain = timing_chain(prefix[-1], n, target.n_vocab)
        times: list[float] = []
        while len(times) < repeats and not (times and times[-1] > slow_s):
            if before is not None:
                before()
            start = time.perf_counter()
            target.verify(chain)
            times.append(time.perf_counter() - start)
            target.truncate(len(prefix) - 1)
        result[n] = round(1000 * float(np.median(times)), 3)
    target.truncate(0)
    return result


def timing_chain(first: int, n: int, n_vocab: int = 1 << 31) -> TokenTree:
    """A chain of n tokens, `first` then arbitrary ids below n_vocab: what a pass over n new tokens costs does not
    depend on them."""
    tokens = np.array([first, *(np.arange(100, 99 + n) % n_vocab)], np.int32)
    return TokenTree(tokens, np.arange(-1, n - 1, dtype=np.int32), np.arange(n, dtype=np.int32),
                     np.zeros(n, np.float32))


def expand_ms(drafter: Drafter, prefix: list[int], sizes: tuple[int, ...] = (1, 8, 32),
              repeats: int = 5) -> dict[int, float]:
    """Median milliseconds of one drafter pass over n sibling nodes, after a root pass on `prefix`."""
    drafter.truncate(0)
    drafter.prefill(prefix[:-1])
    result = {}
    for n in sizes:
        tree = TokenTree(np.array([prefix[-1], *(np.arange(100, 100 + n) % drafter.vocab)], np.int32),
                         np.array([-1, *[0] * n], np.int32), np.array([0, *[1] * n], np.int32),
                         np.zeros(n + 1, np.float32))
        times = []
        for _ in range(repeats):
            drafter.expand(tree, np.array([0]), 8)
            start = time.perf_counter()
            drafter.expand(tree, np.arange(1, n + 1), 8)
            times.append(time.perf_counter() - start)
            drafter.commit(tree, [0])
            drafter.truncate(len(prefix) - 1)
        result[n] = round(1000 * float(np.median(times)), 3)
    drafter.truncate(0)
    return result


