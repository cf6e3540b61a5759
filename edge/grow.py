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
    # target for long stretches can use (docs/performance-log.md, "Tree against chain").
    extend_prob: float | None = None
    # Expansions growth may add past the tree's while the tree's own pass runs (edge/overlap.py): room kept for them.
    grow_on: int = 0

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
    growth = Growth(drafter, root, config, acceptance, stop_tokens, expand, lookup, lookup_acceptance)
    while growth.step():
        pass
    return growth.tree()[0], growth.steps


class Growth:
    """One tree's growth, a drafter pass per step (grow() runs it to the end). After the tree is taken for a target
    pass, `go_on` lets growth continue past its budget while that pass runs (edge/overlap.py): the nodes it adds are
    the likeliest continuations of every outcome the pass may have, and the one the target takes becomes the next
    round's tree."""

    def __init__(self, drafter: Drafter | None, root: int, config: GrowConfig, acceptance: Acceptance | None = None,
                 stop_tokens: frozenset[int] = frozenset(), expand: Expand | None = None,
                 lookup: LookupTree | None = None, lookup_acceptance: Acceptance | None = None) -> None:
        # Trees of up to MAX_LEAVES nodes run at most that many nodes through the drafter, as they always have; larger
        # ones may run as many as it has room for, and keep every node they ran (_leaf_bound_order).
        branches = [] if lookup is None else lookup.branches
        if drafter is None:
            room, expansions = 0, 0
        else:
            room = drafter.expand_capacity if config.budget > MAX_LEAVES else min(drafter.expand_capacity, MAX_LEAVES)
            expansions = config.max_steps * config.beams + config.max_passes - config.max_steps + config.grow_on
        self.drafter, self.config, self.acceptance, self.expand = drafter, config, acceptance, expand
        capacity = 1 + len(branches) + min(expansions, room) * config.width
        self.extend_from = float(np.log(config.extend_prob)) if config.extend_prob else 0.0
        self.tokens = np.zeros(capacity, np.int32)
        self.parents = np.full(capacity, -1, np.int32)
        self.depth = np.zeros(capacity, np.int32)
        self.score = np.full(capacity, -np.inf, np.float32)
        self.draft = np.zeros(capacity, np.float32)
        self.rank = np.zeros(capacity, np.int32)
        self.source = np.zeros(capacity, np.uint8)  # DRAFTED | LOOKED_UP
        self.kept = np.zeros(capacity, bool)
        self.expanded = np.zeros(capacity, bool)  # also set for stop tokens, which are never expanded
        self.ran = np.zeros(capacity, bool)  # the drafter ran it (its keys are cached): its children may run
        self.stops = np.fromiter(stop_tokens, np.int32, len(stop_tokens))
        self.tokens[0], self.score[0], self.kept[0] = root, 0.0, True
        n = 1 + self._add_branches(branches, lookup_acceptance, frozenset(stop_tokens))
        self.kept[1:n] = self.depth[1:n] <= config.max_depth  # no deeper than the reply can use
        self.expanded[1:n] = np.isin(self.tokens[1:n], self.stops)
        self.children = {(int(self.parents[i]), int(self.tokens[i])): i for i in range(1, n)}  # lookup's nodes
        self.looked_up = n  # nodes 1..looked_up - 1 are lookup's
        self.lookup_parents = frozenset(self.parents[1:n].tolist())
        self._lookup_mask: np.ndarray | None = None  # _overruled's, made when first needed
        self.n = n
        _keep_best(self.kept[:n], self.score[:n], self.depth[:n], self.parents[:n], config.budget)
        self.expand_room = room
        self.steps = 0
        self.budget = config.budget
        self.going_on = False

    def _add_branches(self, branches: list, acceptance: Acceptance | None, stops: frozenset[int]) -> int:
        """Lookup branches as nodes 1..k (their parents come first, -1: the root), but none below a stop token (the
        reply ends there), scored by lookup's measured `acceptance`; returns k."""
        tokens, parents, depth, score, draft, rank = self.tokens, self.parents, self.depth, self.score, self.draft, \
            self.rank
        node_of = {-1: 0}  # branch index -> its node
        best: dict[int, float] = {}  # the likeliest branch under each parent: the others are runner-ups (rank 1)
        for branch in branches:
            best[branch.parent] = max(best.get(branch.parent, 0.0), branch.probability)
        i = 0
        for index, branch in enumerate(branches):
            parent = node_of.get(branch.parent)
            if parent is None or (parent > 0 and int(tokens[parent]) in stops):
                continue
            i += 1
            node_of[index] = i
            tokens[i], parents[i], depth[i] = branch.token, parent, depth[parent] + 1
            draft[i] = np.log(branch.confidence)
            rank[i] = branch.probability < best[branch.parent]
            self.source[i] = LOOKED_UP
        added = slice(1, i + 1)
        gains = draft[added] if acceptance is None else acceptance.log_accept(draft[added], depth[added], rank[added])
        for node, gain in enumerate(gains.tolist(), 1):  # parents come first
            score[node] = score[parents[node]] + gain
        return i

    def step(self) -> bool:
        """One drafter pass; False (and nothing run) once growth has stopped."""
        config, n = self.config, self.n
        kept, score, depth, parents = self.kept, self.score, self.depth, self.parents
        if self.drafter is None or (not self.going_on and self.steps >= config.max_passes):
            return False
        # a lookup branch runs through the drafter only below a node that did (its keys must be there)
        candidates = np.flatnonzero(kept[:n] & ~self.expanded[:n] & (depth[:n] < config.max_depth)
                                    & ((parents[:n] < 0) | self.ran[np.maximum(parents[:n], 0)]))
        if int(kept[:n].sum()) - 1 >= self.budget:
            worst = score[:n][kept[:n]].min()
            candidates = candidates[score[candidates] > worst]  # tight stop: children score below parents
        beams = config.beams
        if self.steps >= config.max_steps and not self.going_on:  # extending: the best node alone, while likely
            candidates, beams = candidates[score[candidates] >= self.extend_from], 1
        take = min(beams, self.expand_room, len(candidates))
        if take == 0 or n + take * config.width > len(self.tokens):  # nothing to expand, or no room left
            return False
        order = np.lexsort((depth[candidates], -score[candidates]))
        nodes = candidates[order[:take]]
        view = TokenTree(self.tokens[:n], parents[:n], depth[:n], score[:n])
        ids, log_probs = (self.expand or self.drafter.expand)(view, nodes, config.width)  # [len(nodes), width] each
        if config.draft_temperature != 1.0:
            log_probs = _sharpen(log_probs, config.draft_temperature)
        self.expanded[nodes] = self.ran[nodes] = True
        self.expand_room -= len(nodes)
        self.steps += 1
        gain = log_probs if self.acceptance is None else self.acceptance.log_accept_children(log_probs,
                                                                                            depth[nodes] + 1)
        offered = np.isfinite(log_probs)  # [len(nodes), width]: False where a row had fewer children to give
        new_scores = score[nodes, None] + np.where(offered, gain, -np.inf)  # [len(nodes), width]
        if self.children:  # a token a lookup branch holds already: the node is shared, scored by the likelier source
            for row, column in zip(*np.nonzero(offered), strict=True):
                joined = self.children.get((int(nodes[row]), int(ids[row, column])))
                if joined is not None:
                    score[joined] = max(score[joined], new_scores[row, column])
                    self.draft[joined], self.rank[joined] = log_probs[row, column], column
                    self.source[joined] |= DRAFTED
                    kept[joined] = True
                    offered[row, column] = False
            self._overruled(nodes, log_probs)
        new = slice(n, n + ids.size)
        self.tokens[new] = ids.ravel()
        parents[new] = np.repeat(nodes, config.width)
        depth[new] = np.repeat(depth[nodes] + 1, config.width)
        self.draft[new] = log_probs.ravel()
        self.rank[new] = np.tile(np.arange(ids.shape[1], dtype=np.int32), len(nodes))  # each row best first
        score[new] = np.where(offered, new_scores, -np.inf).ravel()
        self.source[new] = DRAFTED
        kept[new] = offered.ravel()
        self.expanded[new] = np.isin(self.tokens[new], self.stops)
        self.n = n = n + ids.size
        _keep_best(kept[:n], score[:n], depth[:n], parents[:n], self.budget)
        return True

    def _overruled(self, nodes: np.ndarray, log_probs: np.ndarray) -> None:
        """Lookup's children of the nodes just expanded that the drafter did not offer among its top `width`: the
        drafter gives each less than its least offered child, so each is scored no higher than such a runner-up
        would be, and its lookup branch below it loses as much. Where a copy meets an edit, lookup goes on with the
        old text and the drafter with the edit: a lookup branch scored by its own rate alone would keep budget the
        drafter's likelier children need. (A child the drafter offered shares its node: scored by the likelier.)"""
        score, end = self.score, self.looked_up
        for row, node in enumerate(nodes.tolist()):
            if node not in self.lookup_parents:
                continue
            kids = np.flatnonzero(self.parents[1:end] == node) + 1
            kids = kids[self.source[kids] & DRAFTED == 0]  # not offered: the offered ones share their node
            given = log_probs[row][np.isfinite(log_probs[row])]
            if len(kids) == 0 or len(given) == 0:
                continue
            below = given.min(keepdims=True)  # what the drafter leaves an unlisted token: less than any it offered
            gain = below if self.acceptance is None else self.acceptance.log_accept(below, self.depth[node] + 1, 1)
            cap = score[node] + gain[0]
            over = kids[score[kids] > cap]
            if len(over):
                if self._lookup_mask is None:  # [i, j]: j is i or an ancestor of i, among lookup's nodes
                    self._lookup_mask = TokenTree(self.tokens[:end], self.parents[:end], self.depth[:end],
                                                  score[:end]).ancestor_mask()
                score[:end] += self._lookup_mask[:, over] @ (cap - score[over])  # the siblings' branches are apart

    def tree(self) -> tuple[TokenTree, np.ndarray]:
        """The kept tree, and the index in this growth of each of its nodes."""
        n = self.n
        whole = TokenTree(self.tokens[:n], self.parents[:n], self.depth[:n], self.score[:n], self.draft[:n],
                          self.rank[:n], self.source[:n])
        return whole.subset(self.kept[:n]), np.flatnonzero(self.kept[:n])

    def go_on(self, budget: int) -> None:
        """From now on grow past the tree already taken, up to `budget` kept nodes, a pass at a time as long as
        step() is called: best first, `beams` nodes a pass, with no step limit (the caller stops when the target's
        pass is done)."""
        self.going_on = True
        self.budget = max(self.budget, budget)
        n = self.n  # the nodes the smaller budget turned away may come back: the best `budget` of all offered
        self.kept[:n] = np.isfinite(self.score[:n]) & (self.depth[:n] <= self.config.max_depth)
        _keep_best(self.kept[:n], self.score[:n], self.depth[:n], self.parents[:n], self.budget)

    def subtree(self, node: int, budget: int, max_depth: int) -> TokenTree | None:
        """The kept nodes below `node` (an index in this growth), re-rooted there: its best `budget` nodes, no deeper
        than `max_depth` below it. None where it has no kept child."""
        n = self.n
        keep = np.zeros(n, bool)
        keep[node] = True
        base_depth, base_score = self.depth[node], self.score[node]
        deepest = min(base_depth + max_depth, int(self.depth[:n].max()))
        for d in range(base_depth + 1, deepest + 1):  # a level at a time: parents come first
            level = np.flatnonzero(self.kept[:n] & (self.depth[:n] == d))
            keep[level] = keep[self.parents[level]]
        if keep.sum() < 2:
            return None
        _keep_best(keep, self.score[:n], self.depth[:n], self.parents[:n], budget)  # `node` is its first kept node
        index = np.flatnonzero(keep)
        new_index = np.full(n, -1, np.int64)
        new_index[index] = np.arange(len(index))
        parents = np.where(index == node, -1, new_index[np.maximum(self.parents[index], 0)]).astype(np.int32)
        return TokenTree(self.tokens[index].copy(), parents, (self.depth[index] - base_depth).astype(np.int32),
                         (self.score[index] - base_score).astype(np.float32), self.draft[index].copy(),
                         self.rank[index].copy(), self.source[index].copy())

    def find(self, tokens: list[int]) -> int | None:
        """The node (an index in this growth) at the end of `tokens` from the root (tokens[0] is the root's), among
        the nodes offered so far; None where growth has no such path."""
        node = 0
        if int(self.tokens[0]) != tokens[0]:
            return None
        for token in tokens[1:]:
            hits = np.flatnonzero((self.parents[: self.n] == node) & (self.tokens[: self.n] == token)
                                  & np.isfinite(self.score[: self.n]))
            if len(hits) == 0:
                return None
            node = int(hits[0])
        return node




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
