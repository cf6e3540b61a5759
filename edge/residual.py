"""Multi-candidate speculative sampling (SpecInfer's rule, drawn without replacement as in Sequoia): the second
acceptance rule, lossless for any drafter, and the one that keeps its yield when the target samples.

Growth (Proposer): each expanded node v gets q_v, the drafter's distribution after the target's own transforms
(penalties, top-k, top-p, min-p, temperature: edge.sampling.distribution on the drafter's top tokens), and draws
its candidate children x_1, x_2, ... from q_v without replacement (Gumbel top-k: an ordered draw). Growth keeps
whichever of them it likes as tree nodes; the candidates stay on record with q_v.

Verification at v (residual_draw), with p the target's distribution there:

    for x_i in candidates, in draw order:
        accept x_i with probability min(1, p(x_i) / q(x_i))           # one uniform
        else p = norm(max(p - q, 0)); q[x_i] = 0; q = norm(q)          # the residual, and x_i out of q
    if all fail: draw from p                                           # one uniform

The token it returns has exactly the distribution p (docs/lossless.md, "The residual rule", has the proof): it
is a draw from the target, so the output is the target's whatever the drafter proposes, and a candidate kept
as a node lets the round go on below it. A candidate growth dropped can still be accepted: the round then ends
with it, as with the target's own token. Unexpanded nodes have no candidates: p is drawn from directly.

Unlike sample-and-match, whose chance to go on is the target's mass on the kept children, a drafter whose q is
close to p has its first candidate accepted with probability 1 - TV(p, q), near 1 even where p is flat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edge.protocols import Drafter
from edge.sampling import SamplingConfig, distribution
from edge.tree import TokenTree

POOL = 64  # the drafter's top tokens q is built from, where no smaller top-k bounds the target's support


@dataclass(frozen=True)
class Proposal:
    """q at one expanded node and the candidates drawn from it."""

    ids: np.ndarray  # [s] int64, q's support, ascending
    probs: np.ndarray  # [s] float64, q, summing to 1
    drawn: np.ndarray  # [c] int64, the candidates in draw order (distinct, c <= s)


class Proposer:
    """Draws each expanded node's children from q (grow's `expand` hook) and keeps every node's Proposal, by the
    node's path of tokens from the root, which no renumbering of the tree changes."""

    def __init__(self, drafter: Drafter, sampling: SamplingConfig, history: Sequence[int], rng: np.random.Generator):
        self.drafter, self.sampling, self.rng = drafter, sampling, rng
        self.history = list(history)  # committed tokens before the root
        self.pool = sampling.top_k if 0 < sampling.top_k <= POOL else POOL
        self.proposals: dict[tuple[int, ...], Proposal] = {}

    def expand(self, tree: TokenTree, nodes: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """As Drafter.expand: (ids [n, width], log q [n, width]) in draw order; a row with fewer candidates than
        `width` (q's support is smaller) is padded with -inf, which growth never keeps."""
        ids, log_probs, logits = self.drafter.expand_logits(tree, nodes, self.pool)  # [n, pool] each
        out_ids = np.zeros((len(nodes), width), np.int32)
        out_log_q = np.full((len(nodes), width), -np.inf, np.float32)
        for row, node in enumerate(nodes.tolist()):
            path = _path(tree, node)
            q_ids, q = node_distribution(ids[row], log_probs[row], logits[row], self.sampling, [*self.history, *path])
            drawn = _draw_without_replacement(q, width, self.rng)
            self.proposals[tuple(path)] = Proposal(q_ids, q, q_ids[drawn])
            out_ids[row, : len(drawn)] = q_ids[drawn]
            out_log_q[row, : len(drawn)] = np.log(q[drawn])
        return out_ids, out_log_q

    def at(self, path_tokens: Sequence[int]) -> Proposal | None:
        return self.proposals.get(tuple(path_tokens))


def node_distribution(ids: np.ndarray, log_probs: np.ndarray, logits: np.ndarray, sampling: SamplingConfig,
                      seen: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """q at an expanded node from one row of Drafter.expand_logits (its top tokens, their log-probs and logits),
    after the target's transforms given the text `seen` up to the node."""
    log_mass = float(logits[0] - log_probs[0])  # logit - log-prob: the row's log normalizer
    return distribution(logits, sampling, seen, ids=ids.astype(np.int64), log_mass=log_mass)


def residual_draw(p_ids: np.ndarray, p: np.ndarray, proposal: Proposal, rng: np.random.Generator) -> int:
    """One token with exactly the distribution (p_ids, p), accepting the proposal's candidates where it can.

    p may span a whole vocabulary (262144 tokens for Gemma at temperature alone) and q a few dozen, so p is held as
    `base * scale` and a rejection touches only q's support: max(p - q, 0) equals p off it."""
    support, at_q = _support(p_ids, proposal.ids)
    base = np.zeros(len(support))
    base[np.searchsorted(support, p_ids)] = p
    scale = 1.0  # the current target is base * scale; it sums to 1
    draft = np.array(proposal.probs, dtype=np.float64)  # [len(q)], q over its support, at support[at_q]
    for token in proposal.drawn.tolist():
        j = int(np.searchsorted(proposal.ids, token))
        if rng.random() * draft[j] < base[at_q[j]] * scale:  # probability min(1, p/q), without dividing
            return token
        old = base[at_q] * scale  # the target on q's support
        new = np.maximum(old - draft, 0.0)
        mass = 1.0 - old.sum() + new.sum()  # the residual's total: unchanged off q's support
        if mass <= 0:  # p == q up to rounding, where every candidate is accepted: cannot happen but by rounding
            break
        base[at_q] = new / scale
        scale /= mass
        draft[j] = 0.0
        left = draft.sum()
        if left <= 0:
            break
        draft /= left
    weights = base * scale
    index = int(np.searchsorted(np.cumsum(weights), rng.random() * weights.sum(), side="right"))
    return int(support[min(index, len(support) - 1)])


def _support(p_ids: np.ndarray, q_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of p and q, ascending (a uniform then maps to the same token every time), and where q's lie in
    it. Mostly q's tokens are among p's, and p's ids are the support as they are (no sort of a whole vocabulary)."""
    at = np.minimum(np.searchsorted(p_ids, q_ids), len(p_ids) - 1)
    if len(p_ids) and (p_ids[at] == q_ids).all():
        return p_ids, at
    support = np.union1d(p_ids, q_ids)
    return support, np.searchsorted(support, q_ids)


def _draw_without_replacement(q: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of an ordered draw of min(count, support) items from q without replacement: the top of
    log q + Gumbel noise is distributed exactly as drawing one, removing it, renormalizing, drawing the next."""
    keys = np.log(q) + rng.gumbel(size=len(q))
    keys[q <= 0] = -np.inf
    order = np.argsort(-keys, kind="stable")[: min(count, int((q > 0).sum()))]
    return order


def _path(tree: TokenTree, node: int) -> list[int]:
    """The tokens from the root to `node`, both included."""
    path = []
    while node >= 0:
        path.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return path[::-1]
