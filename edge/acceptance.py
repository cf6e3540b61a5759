"""How often the target takes a drafted token, by the drafter's probability for it, its rank and its depth:
measured on verified trees.

Growth ranks nodes by the chance that the target reaches and accepts them. The drafter's own probability is a
poor stand-in for that chance (a 4-bit drafter of the very model it drafts for is right far more often than its
probabilities say), so every verified round teaches a table. For each node on the accepted path the target's
token there is known (the next node of the path, or the token the target drew where the path ends), and each
child the tree offered under that node either carries it or not. Children are counted by
- their draft probability (BIN_EDGES);
- whether they are the drafter's top token or a runner-up: at p = 0.4 an unsure drafter's top token is taken
  far more often than a runner-up of the same probability;
- their depth (DEPTH_EDGES): acceptances come in runs, so a path that has survived 30 tokens is in text the
  drafter finds easy, and depth-blind rates would starve deep chains.
A rate is each (rank, bin)'s rate over all depths, shrunk towards the bin's own probability while it has few
counts, with its log odds moved by one offset per depth bucket (fitted to that bucket's counts, pulled towards 0).
Older rounds fade by DECAY a round, so the rates follow the text. A node's children are exclusive (the target
draws one token there): the top token keeps its own rate, the runner-ups share what it leaves.

Growth scores a child as its parent's score plus log(rate): a node's score is the log of its estimated chance to
be accepted, and best-first growth builds the tree those rates make most productive: a chain where the drafter is
reliably right, branches where it is not. Acceptance itself never looks at this table: output stays the
target's whatever the tree's shape. The alternatives tried, with their figures: docs/performance.md,
"Acceptance rates".
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from edge.tree import DRAFTED, TokenTree

# Finer near 1, where a good drafter's top tokens sit and where the difference between 0.9 and 0.99 decides
# how deep a chain is worth growing.
BIN_EDGES = np.array([0.0, 0.01, 0.03, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.995, 1.0001])
DEPTH_EDGES = np.array([1, 2, 4, 8, 16, 32, 64])  # depth buckets: 1, 2-3, 4-7, ..., 64 and deeper
PRIOR = 0.5  # pseudo-observations at the prior rate (Acceptance.prior)
DEPTH_PRIOR = 2.0  # precision of a depth bucket's log-odds offset around 0
DEPTH_STEPS = 8  # Newton steps per round for the depth offsets, at most, from the previous round's
DEPTH_TOLERANCE = 1e-4  # ... stopping once no offset moves more (a round's few counts: one or two steps)
DECAY = 0.995  # weight of the previous rounds' counts after one more round (about the last 200 rounds count)
FLOOR = 1e-4
# rate() answers from a table that may lag this many rounds of counts (a plain round counts lookup's few first tokens,
# and refitting the table for each such round had cost as much as the rest of the round's bookkeeping): at DECAY 0.995
# a round, a few rounds move a rate by far less than the measured rates' own noise
RATE_LAG = 8
_BIN_EDGES = BIN_EDGES.tolist()  # the same edges for plain Python's bisect (a few nodes: numpy's calls cost more)
_DEPTH_EDGES = DEPTH_EDGES.tolist()


class Acceptance:
    """Calibrated log acceptance of drafted children, learned online from verified trees."""

    def __init__(self, greedy: bool = False) -> None:
        self.middle = (BIN_EDGES[:-1] + np.minimum(BIN_EDGES[1:], 1.0)) / 2
        # Before counts: a child's own probability (SpecExec's score), but a greedy target's argmax is the
        # drafter's top token far more often than its probability says, so there the top token starts at sqrt(p).
        self.prior = np.stack([np.sqrt(self.middle) if greedy else self.middle, self.middle])  # [rank, bin]
        self.hits = np.zeros((len(DEPTH_EDGES), 2, len(self.middle)))  # [depth bucket, runner-up, probability bin]
        self.seen = np.zeros_like(self.hits)
        self.depth_offset = np.zeros(len(DEPTH_EDGES))
        self._rates: list | None = None  # rate()'s table as nested lists (made again: RATE_LAG)
        self._unread = 0  # rounds counted since the lists were made
        self._update_table()

    @property
    def table(self) -> np.ndarray:
        """log rates by [depth bucket, rank, probability bin], brought up to date with the counts when first read
        after a round (a plain round's counts are often followed by another before any tree is scored)."""
        if self._stale:
            self._update_table()
        return self._table

    def log_accept(self, log_probs: np.ndarray, depth: np.ndarray | int, rank: np.ndarray | int) -> np.ndarray:
        """Calibrated log chance that the target accepts a child at `depth` (its parent reached), given the
        drafter's log-prob for it and its rank among its siblings (0: the top token); all three broadcast."""
        return self.table[_depth_bucket(depth), np.minimum(rank, 1), _bin(np.exp(log_probs))]

    def log_accept_children(self, log_probs: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """log_probs: [nodes, k], each row a node's top-k children best first; depth: [nodes], the children's depth.
        Their log chances, the runner-ups' scaled so that each row's chances sum to at most 1 (the target takes one
        token): the top token's rate is the best measured, the runner-ups share what it leaves."""
        gain = self.log_accept(log_probs, depth[:, None], np.arange(log_probs.shape[1]))  # [nodes, k]
        rate = np.exp(gain)
        room = np.maximum(1.0 - rate[:, :1], FLOOR)  # what the top token leaves
        total = rate[:, 1:].sum(axis=1, keepdims=True)
        gain[:, 1:] += np.log(np.minimum(1.0, room / np.maximum(total, FLOOR * FLOOR)))
        return gain.astype(np.float32)

    def rate(self, p: float, depth: int = 1, rank: int = 0) -> float:
        """The chance that the target accepts one child (the table's rate, in plain Python: policy.py asks it for
        each of a few dozen lookup branches every round, where numpy's per-call cost would show)."""
        if self._rates is None or self._unread >= RATE_LAG:  # else the lists may lag a few plain rounds' counts
            table = self.table
            self._rates, self._unread = np.exp(table).tolist(), 0
        return self._rates[_depth_cell(depth)][min(rank, 1)][_bin_cell(p)]

    def count(self, depth: int, rank: int, p: float, hit: bool) -> None:
        """One child seen, and whether the target took it: what observe() does for each child of a tree, for the
        few children a plain round checks (policy.py: lookup's first tokens against the target's token). Call
        fade() once for the round first."""
        cell = (_depth_cell(depth), min(rank, 1), _bin_cell(p))
        self.hits[cell] += hit
        self.seen[cell] += 1.0
        self._stale = True

    def fade(self) -> None:
        """Older rounds count less by DECAY: once a round, before its counts."""
        self.hits *= DECAY
        self.seen *= DECAY
        self._unread += 1

    def observe(self, tree: TokenTree, path: list[int], token: int, source: int | None = None) -> None:
        """One verified round: `path` the accepted node ids (root first), `token` the target's draw at its end.
        `source` (edge.tree.DRAFTED or LOOKED_UP): learn only from the children that source proposed."""
        if tree.draft is None or len(tree) < 2:
            return
        taken = np.full(len(tree), -1, np.int64)  # the target's token at each node of the path
        taken[path] = [*tree.tokens[path[1:]], token]
        children = np.flatnonzero(taken[np.maximum(tree.parents, 0)] >= 0)
        children = children[children > 0]
        if source is not None and tree.source is not None:
            children = children[tree.source[children] & source != 0]
            if source != DRAFTED:  # a node both proposed carries the drafter's probability: the drafter's to learn
                children = children[tree.source[children] & DRAFTED == 0]
        if len(children) == 0:
            return
        hit = tree.tokens[children] == taken[tree.parents[children]]
        rank = np.zeros(len(children), np.int64) if tree.rank is None else np.minimum(tree.rank[children], 1)
        cells = (_depth_bucket(tree.depth[children]), rank, _bin(np.exp(tree.draft[children])))
        self.fade()
        np.add.at(self.hits, cells, hit)
        np.add.at(self.seen, cells, 1.0)
        self._stale, self._rates = True, None  # a verified tree: rate() answers from the new counts

    def _update_table(self) -> None:
        hits, seen = self.hits.sum(axis=0), self.seen.sum(axis=0)  # [rank, bin]
        pooled = (hits + PRIOR * self.prior) / (seen + PRIOR)  # [rank, bin]
        base = _logit(np.clip(pooled, FLOOR, 1 - FLOOR))
        offset = self.depth_offset  # [depth bucket]: maximizes the buckets' penalized likelihood
        for _ in range(DEPTH_STEPS):
            rate = _sigmoid(base + offset[:, None, None])  # [depth bucket, rank, bin]
            gradient = (self.hits - self.seen * rate).sum(axis=(1, 2)) - DEPTH_PRIOR * offset
            curvature = (self.seen * rate * (1 - rate)).sum(axis=(1, 2)) + DEPTH_PRIOR
            step = gradient / curvature
            offset = offset + step
            if np.abs(step).max() < DEPTH_TOLERANCE:
                break
        self.depth_offset = offset
        rate = _sigmoid(base + offset[:, None, None])
        self._table = np.log(np.clip(rate, FLOOR, 1 - FLOOR)).astype(np.float32)
        self._stale, self._rates = False, None


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p / (1 - p))


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _bin(p: np.ndarray) -> np.ndarray:
    return np.clip(np.searchsorted(BIN_EDGES, p, side="right") - 1, 0, len(BIN_EDGES) - 2)


def _bin_cell(p: float) -> int:
    return min(max(bisect_right(_BIN_EDGES, p) - 1, 0), len(_BIN_EDGES) - 2)


def _depth_cell(depth: int) -> int:
    return min(max(bisect_right(_DEPTH_EDGES, depth) - 1, 0), len(_DEPTH_EDGES) - 1)


def _depth_bucket(depth: np.ndarray | int) -> np.ndarray:
    return np.clip(np.searchsorted(DEPTH_EDGES, depth, side="right") - 1, 0, len(DEPTH_EDGES) - 1)
