"""Coupled sampling (`--accept coupled`): the target draws each token by the Gumbel-max trick with noise fixed by the
token's position in the text, and the drafter grows its tree on the same noise.

The target's token at position t is

    argmax over x of  log p_t(x) + g_t(x)        g_t(x) = Gumbel noise from (the reply's key, t, x) alone

which is an exact draw from p_t (the Gumbel-max trick), p_t being the target's distribution after every transform
(edge.sampling.distribution). The noise of a position is fresh for each position and fixed before any model runs, so
the reply is a function of the key alone: sequential decoding with noises g_1, g_2, ... whichever tokens a tree
offered. Acceptance is sample-and-match (edge/speculative.py) with this draw, lossless for any tree, and a seeded
reply is the same token for token with or without speculation.

What the coupling buys: the drafter ranks a node's children by log q(x) + COUPLING * g_t(x), its own distribution
with (a share of) the same noise. At COUPLING = 1 its first child is its own Gumbel-max draw, which is the target's
draw whenever p and q agree closely enough (with probability at least (1 - TV) / (1 + TV)); at 0 it is the drafter's
likeliest token, which sample-and-match with independent draws offers first. A drafter flatter than its target draws
its own doubts at 1, so the best share lies between: on the real pair (Qwen2.5-Coder 0.5B for 1.5B, T = 0.8, the 8 chat
prompts, 371 positions), the drafter's first child was the target's token at 61.3% of positions at 0, 67.7% at 0.75
and 67.1% at 1, and its first four at 85.1%, 90.4% and 90.3%: a third fewer misses where a tree offers four children
(`python benchmarks/coupling_gain.py --pair qwen2.5-coder-1.5b --prompts benchmarks/chat-prompts.txt`).

The key is drawn from the decoder's seeded generator once per reply, and every position of the reply, plain rounds
included, draws this way: a reply never mixes this draw with another rule's (which would let the tree's shape,
grown on noise of later positions, choose which rule draws a token).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edge.protocols import Drafter
from edge.residual import POOL, _path, node_distribution
from edge.sampling import SamplingConfig, distribution
from edge.tree import TokenTree

COUPLING = 0.75  # the share of the noise the drafter ranks its children by (above)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping): a bijection whose outputs pass BigCrush as a stream."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


class Noise:
    """Gumbel noise g_t(x) by (key, position t, token x): the same numbers for the drafter and the target, computed
    for the tokens asked only (a vocabulary of 262144 takes a few milliseconds; a drafter's 64 candidates nothing)."""

    def __init__(self, key: int) -> None:
        self.key = int(key) & ((1 << 64) - 1)

    def gumbel(self, position: int, ids: np.ndarray) -> np.ndarray:
        """float64 noise for `ids` at `position`: the splitmix64 stream seeded by (key, position), read at the ids."""
        with np.errstate(over="ignore"):
            base = _mix(np.array([self.key], np.uint64) + np.uint64(position) * _GOLDEN)
            bits = _mix(base + np.asarray(ids, np.uint64) * _GOLDEN) >> np.uint64(11)
        uniform = (bits.astype(np.float64) + 0.5) * 2.0**-53  # in (0, 1)
        return -np.log(-np.log(uniform))


def keyed_draw(ids: np.ndarray, probs: np.ndarray, noise: Noise, position: int) -> int:
    """The token of the distribution (ids, probs) that the noise of `position` picks: argmax of log p + g."""
    with np.errstate(divide="ignore"):
        keys = np.log(probs) + noise.gumbel(position, ids)
    return int(ids[int(np.argmax(keys))])


def coupled_draw(logits: np.ndarray, config: SamplingConfig, history: Sequence[int], noise: Noise) -> int:
    """The target's token after `history` (its position is len(history)), as edge.sampling.draw but by the noise."""
    ids, probs = distribution(logits, config, history)
    if config.greedy:
        return int(ids[0])
    return keyed_draw(ids, probs, noise, len(history))


class CoupledProposer:
    """grow's `expand` hook: each expanded node's children are the drafter's tokens with the best log q + COUPLING * g,
    g the noise of the children's position; q is the drafter's distribution after the target's transforms, over its top
    POOL tokens (or the request's top-k). A child's log-prob for growth is its share of softmax(log q + g) over the
    pool: near 1 where one token's key stands out (the target's own noisy argmax is then likely the same), spread
    where keys are close; growth's measured rates (edge/acceptance.py) calibrate it."""

    def __init__(self, drafter: Drafter, sampling: SamplingConfig, history: Sequence[int], noise: Noise,
                 coupling: float = COUPLING) -> None:
        self.drafter, self.sampling, self.noise, self.coupling = drafter, sampling, noise, coupling
        self.history = list(history)  # committed tokens before the root
        self.pool = sampling.top_k if 0 < sampling.top_k <= POOL else POOL

    def expand(self, tree: TokenTree, nodes: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """As Drafter.expand: (ids [n, width], log-probs [n, width]) best key first; rows with fewer candidates than
        `width` are padded with -inf, which growth never keeps."""
        ids, log_probs, logits = self.drafter.expand_logits(tree, nodes, self.pool)  # [n, pool] each
        out_ids = np.zeros((len(nodes), width), np.int32)
        out_log = np.full((len(nodes), width), -np.inf, np.float32)
        for row, node in enumerate(nodes.tolist()):
            seen = [*self.history, *_path(tree, node)]
            q_ids, q = node_distribution(ids[row], log_probs[row], logits[row], self.sampling, seen)
            with np.errstate(divide="ignore"):
                keys = np.log(q) + self.coupling * self.noise.gumbel(len(seen), q_ids)
            order = np.argsort(-keys, kind="stable")[: min(width, int((q > 0).sum()))]
            shares = keys[order] - np.logaddexp.reduce(keys[np.isfinite(keys)])
            out_ids[row, : len(order)] = q_ids[order]
            out_log[row, : len(order)] = shares
        return out_ids, out_log
