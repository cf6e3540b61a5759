"""SpecExec tree growth: best-first on the cumulative log chance that the target accepts a node.

Each step expands the best `beams` unexpanded nodes in one drafter pass and offers each its top `width`
children, scored as the parent's score + log a(p), where a(p) is the measured rate at which the target takes
such a child (edge/acceptance.py; a(p) = p until rounds are measured, SpecExec's own score). Only the best
`budget` nodes are kept. A child always scores below its parent, so the kept set stays a connected tree and,
once it is full, a node scoring no better than the worst kept node can never place a child in it: growth stops
when no node can (the tight stop), at `max_steps` drafter passes (then, with `extend_prob`, one node a pass
while the best path stays that likely to be accepted), or when the drafter runs out of room. Leaves never run
through the drafter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from edge.acceptance import Acceptance
from edge.errors import UserError
from edge.lookup import LookupTree
from edge.protocols import Drafter
from edge.tree import DRAFTED, LOOKED_UP, TokenTree

# (tree, nodes, width) -> (token ids [len(nodes), width], log-probs [len(nodes), width]): Drafter.expand's top-k best
# first, or edge/residual.py's draws from q in draw order
Expand = Callable[[TokenTree, np.ndarray, int], tuple[np.ndarray, np.ndarray]]
MAX_LEAVES = 255  # llama.cpp has 256 seq ids per context: one per leaf of the tree a target pass verifies
MAX_BUDGET = 2048  # draft nodes per tree: past MAX_LEAVES nodes the leaf bound shapes the tree (for_budget)
# A budget's tree keeps extending its best path past max_steps while the target would reach and accept it with at
# least this (measured) chance: each such pass adds that many tokens per round on average.
EXTEND_PROB = 0.02


@dataclass(frozen=True)
class GrowConfig:
    budget: int = 64  # draft nodes per tree, root excluded
    beams: int = 8  # nodes expanded per drafter pass
    width: int = 8  # children offered per expanded node
    max_depth: int = 32
    max_steps: int = 10  # drafter passes per round
    # Scores use the drafter's distribution at this temperature. A greedy target accepts a child only if
    # it is the target's argmax, which the drafter's top token is far more often than its probability
    # says: sharpening (< 1) moves budget from unlikely siblings to deeper top-token chains until measured
    # acceptance rates (edge/acceptance.py) take over.
    draft_temperature: float = 1.0
    # Past max_steps, keep extending the single best node, one pass at a time, while the target would reach and
    # accept it with at least this chance (its score; None: stop at max_steps), up to `budget` passes in all (what
    # a chain of the budget takes): a fixed number of passes would cap the depth that a drafter agreeing with its
    # target for long stretches can use (docs/performance.md, "Tree against chain").
    extend_prob: float | None = None

    @property
    def max_passes(self) -> int:
        return self.max_steps if self.extend_prob is None else max(self.max_steps, self.budget)

    def within_reply(self, wanted: int) -> GrowConfig:
        """No deeper than a reply that `wanted` more tokens end can use: a round yields its accepted path plus the
        target's own token, so depth wanted - 1 at most (the budget then goes to branches instead)."""
        return replace(self, max_depth=wanted - 1) if self.max_depth >= wanted > 1 else self

    @classmethod
    def chain(cls, length: int) -> GrowConfig:
        """A plain chain of `length` draft tokens: the drafter's top token, one pass per token."""
        cls.for_budget(length)  # the same limits
        return cls(budget=length, beams=1, width=1, max_depth=length, max_steps=length)

    @classmethod
    def for_budget(cls, budget: int) -> GrowConfig:
        """Defaults that scale with the budget; budget <= 4 is a plain chain (beams = width = 1).

        Narrow and deep: tokens per pass follow the tree's depth far more than its width (docs/performance.md,
        "Tree shapes"). One node per drafter pass, the best one: its pass then reads exactly the keys a chain's pass
        at that node reads, so it drafts what the chain would there (several nodes in a pass read each other's
        masked keys, which rounds near-ties otherwise), and the tree's top path is the chain's. The width comes
        free with each pass: a node's top `width` children are scored, and kept where they beat deeper nodes.

        Past MAX_LEAVES nodes the leaf bound shapes the tree: with at most 255 leaves, b nodes have at least b - 255
        inner nodes, every one of them a node the drafter ran, so such a tree takes b - 255 expansions or more where
        a 255-node tree takes a few dozen. One node a pass would take as many passes; instead each pass expands the
        best budget / 16 nodes (64 at 1024, 128 at 2048) in the 24 passes budget 255 takes before extending, room
        for 1.5x the expansions needed after the first passes, which have fewer nodes to expand. This is meant for
        targets whose pass costs about the same for 2049 tokens as for 256 (a GPU, weights streamed), where the
        drafter's is also about flat in its nodes. The width stays 4: once the leaves are spent, a node's best
        child alone can join (it extends a leaf without adding one), so wider rows would only be scored."""
        if budget < 1:
            raise UserError(f"budget must be at least 1 draft node (got {budget}); plain decoding drafts none",
                            "budget")
        if budget > MAX_BUDGET:
            raise UserError(f"budget can be at most {MAX_BUDGET} draft nodes (got {budget})", "budget")
        if budget <= 4:
            return cls(budget=budget, beams=1, width=1, max_depth=budget, max_steps=budget)
        if budget > MAX_LEAVES:
            return cls(budget=budget, beams=budget // 16, width=4, max_depth=budget, max_steps=24,
                       extend_prob=EXTEND_PROB)
        steps = int(np.clip(round(2 * budget**0.5) - 2, 4, 24))
        return cls(budget=budget, beams=1, width=4, max_depth=budget, max_steps=steps, extend_prob=EXTEND_PROB)


def grow(drafter: Drafter | None, root: int, config: GrowConfig, acceptance: Acceptance | None = None,
         stop_tokens: frozenset[int] = frozenset(), expand: Expand | None = None, lookup: LookupTree | None = None,
         lookup_acceptance: Acceptance | None = None) -> tuple[TokenTree, int]:
    """Grow a tree under `root`; returns the kept tree and the number of drafter passes it took. Nodes carrying a
    stop token are never expanded: the reply ends there, so the budget goes to other branches. `expand` (default:
    the drafter's top-k) gives each expanded node's children; a child it gives log-prob -inf is never kept.

    `lookup`'s branches (edge/lookup.py) join the tree first, scored by their own measured acceptance
    (`lookup_acceptance`), and compete for the budget with the drafter's nodes; where the drafter proposes a token a
    branch already holds, the two share the node. Without a drafter the tree is the lookup branches alone."""
    # Trees of up to MAX_LEAVES nodes run at most that many nodes through the drafter, as they always have; larger
    # ones may run as many as it has room for, and keep every node they ran (_leaf_bound_order).
    branches = [] if lookup is None else lookup.branches
    if drafter is None:
        room, expansions = 0, 0
    else:
        room = drafter.expand_capacity if config.budget > MAX_LEAVES else min(drafter.expand_capacity, MAX_LEAVES)
        expansions = config.max_steps * config.beams + config.max_passes - config.max_steps
    capacity = 1 + len(branches) + min(expansions, room) * config.width
    extend_from = float(np.log(config.extend_prob)) if config.extend_prob else 0.0
    tokens = np.zeros(capacity, np.int32)
    parents = np.full(capacity, -1, np.int32)
    depth = np.zeros(capacity, np.int32)
    score = np.full(capacity, -np.inf, np.float32)
    draft = np.zeros(capacity, np.float32)
    rank = np.zeros(capacity, np.int32)
    source = np.zeros(capacity, np.uint8)  # DRAFTED | LOOKED_UP
    kept = np.zeros(capacity, bool)
    expanded = np.zeros(capacity, bool)  # also set for stop tokens, which are never expanded
    ran = np.zeros(capacity, bool)  # the drafter ran the node (its keys are in its cache): only its children may run
    stops = np.fromiter(stop_tokens, np.int32, len(stop_tokens))
    tokens[0], score[0], kept[0] = root, 0.0, True
    n = 1 + _add_branches(branches, tokens, parents, depth, score, draft, rank, source, lookup_acceptance,
                          frozenset(stop_tokens))
    kept[1:n] = depth[1:n] <= config.max_depth  # no deeper than the reply can use
    expanded[1:n] = np.isin(tokens[1:n], stops)
    children = {(int(parents[i]), int(tokens[i])): i for i in range(1, n)}  # where a drafter's child may join
    _keep_best(kept[:n], score[:n], depth[:n], parents[:n], config.budget)
    expand_room = room
    steps = 0
    while drafter is not None and steps < config.max_passes:
        # a lookup branch runs through the drafter only below a node that did (its keys must be there)
        candidates = np.flatnonzero(kept[:n] & ~expanded[:n] & (depth[:n] < config.max_depth)
                                    & ((parents[:n] < 0) | ran[np.maximum(parents[:n], 0)]))
        if int(kept[:n].sum()) - 1 >= config.budget:
            worst = score[:n][kept[:n]].min()
            candidates = candidates[score[candidates] > worst]  # tight stop: children score below parents
        beams = config.beams
        if steps >= config.max_steps:  # extending: the best node alone, while its path is likely
            candidates, beams = candidates[score[candidates] >= extend_from], 1
        if len(candidates) == 0 or expand_room == 0:
            break
        order = np.lexsort((depth[candidates], -score[candidates]))
        nodes = candidates[order[: min(beams, expand_room)]]
        view = TokenTree(tokens[:n], parents[:n], depth[:n], score[:n])
        ids, log_probs = (expand or drafter.expand)(view, nodes, config.width)  # [len(nodes), width] each
        if config.draft_temperature != 1.0:
            log_probs = _sharpen(log_probs, config.draft_temperature)
        expanded[nodes] = ran[nodes] = True
        expand_room -= len(nodes)
        steps += 1
        gain = log_probs if acceptance is None else acceptance.log_accept_children(log_probs, depth[nodes] + 1)
        offered = np.isfinite(log_probs)  # [len(nodes), width]: False where a row had fewer children to give
        new_scores = score[nodes, None] + np.where(offered, gain, -np.inf)  # [len(nodes), width]
        if children:  # a token a lookup branch holds already: the node is shared, scored by the likelier source
            for row, column in zip(*np.nonzero(offered), strict=True):
                joined = children.get((int(nodes[row]), int(ids[row, column])))
                if joined is not None:
                    score[joined] = max(score[joined], new_scores[row, column])
                    draft[joined], rank[joined] = log_probs[row, column], column
                    source[joined] |= DRAFTED
                    kept[joined] = True
                    offered[row, column] = False
        new = slice(n, n + ids.size)
        tokens[new] = ids.ravel()
        parents[new] = np.repeat(nodes, config.width)
        depth[new] = np.repeat(depth[nodes] + 1, config.width)
        draft[new] = log_probs.ravel()
        rank[new] = np.tile(np.arange(ids.shape[1], dtype=np.int32), len(nodes))  # expand gives each row best first
        score[new] = np.where(offered, new_scores, -np.inf).ravel()
        source[new] = DRAFTED
        kept[new] = offered.ravel()
        expanded[new] = np.isin(tokens[new], stops)
        n += ids.size
        _keep_best(kept[:n], score[:n], depth[:n], parents[:n], config.budget)
    tree = TokenTree(tokens[:n], parents[:n], depth[:n], score[:n], draft[:n], rank[:n], source[:n])
    return tree.subset(kept[:n]), steps


def _add_branches(branches: list, tokens: np.ndarray, parents: np.ndarray, depth: np.ndarray, score: np.ndarray,
                  draft: np.ndarray, rank: np.ndarray, source: np.ndarray, acceptance: Acceptance | None,
                  stops: frozenset[int] = frozenset()) -> int:
    """Lookup branches as nodes 1..k (their parents come first, -1: the root), but none below a stop token (the
    reply ends there); returns k."""
    node_of = {-1: 0}  # branch index -> its node
    i = 0
    for index, branch in enumerate(branches):
        parent = node_of.get(branch.parent)
        if parent is None or (parent > 0 and int(tokens[parent]) in stops):
            continue
        i += 1
        node_of[index] = i
        tokens[i], parents[i], depth[i] = branch.token, parent, depth[parent] + 1
        draft[i] = np.log(branch.probability)
        rank[i] = int(any(b.parent == branch.parent and b.probability > branch.probability for b in branches))
        source[i] = LOOKED_UP
        gain = draft[i] if acceptance is None else acceptance.log_accept(np.array([draft[i]]), depth[i], rank[i])[0]
        score[i] = score[parent] + gain
    return i


def _sharpen(log_probs: np.ndarray, temperature: float) -> np.ndarray:
    """log-probs of the top-k at another temperature, renormalized over those k (the rest barely count)."""
    scaled = log_probs / temperature
    peak = scaled.max(axis=1, keepdims=True)
    return (scaled - peak - np.log(np.exp(scaled - peak).sum(axis=1, keepdims=True))).astype(np.float32)


def _keep_best(kept: np.ndarray, score: np.ndarray, depth: np.ndarray, parents: np.ndarray, budget: int) -> None:
    """Unmark all but the root and the best `budget` other kept nodes (ties: shallower first), taken best first as
    long as the tree keeps at most MAX_LEAVES leaves: a node whose parent already has a kept child adds a leaf, a
    first child does not. Nodes the drafter ran come first (see _leaf_bound_order). All arrays: [n]."""
    alive = np.flatnonzero(kept)[1:]
    if budget <= MAX_LEAVES:  # b nodes have at most b leaves: the budget alone binds
        if len(alive) > budget:
            order = np.lexsort((alive, depth[alive], -score[alive]))
            kept[alive[order[budget:]]] = False
        return
    order = _leaf_bound_order(alive, score, depth, parents)
    kept[alive] = False
    kept[order[:budget]] = True


def _leaf_bound_order(alive: np.ndarray, score: np.ndarray, depth: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """The nodes of `alive` (a connected set, root excluded) that best-first selection under the leaf bound takes,
    in the order it takes them.

    The order: nodes the drafter ran, then the best score, the shallower, the lower index. A parent comes before
    its children, so taking nodes in this order with no bound keeps them all; the bound turns nodes away only once
    MAX_LEAVES - 1 nodes that add a leaf have been taken (the root alone is the first leaf). From there a node
    joins only as the first child of a kept parent, and the nodes below one turned away go with it. Ran nodes are
    never turned away: at most MAX_LEAVES leaves lie below them (each was a kept leaf when it ran), so a llama.cpp
    drafter holding one sequence per branch of the nodes it ran never needs more than it has."""
    ran = np.zeros(len(score), bool)
    ran[parents[1:]] = True
    order = alive[np.lexsort((alive, depth[alive], -score[alive], ~ran[alive]))]
    _, first_child = np.unique(parents[order], return_index=True)  # each parent's first child in the order
    adds_leaf = np.ones(len(order), bool)
    adds_leaf[first_child] = False
    turned_away = adds_leaf & (np.cumsum(adds_leaf) >= MAX_LEAVES)
    if not turned_away.any():
        return order
    place = np.full(len(score), -1)
    place[order] = np.arange(len(order))
    up = place[parents[order]]  # [len(order)]: each node's parent's place in the order, -1 for the root
    while (inner := up >= 0).any():  # pointer jumping: log2(depth) steps mark every node below one turned away
        turned_away[inner] |= turned_away[up[inner]]
        up[inner] = up[up[inner]]
    return order[~turned_away]
