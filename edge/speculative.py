"""One round of lossless tree speculation: grow, verify, accept, commit (run_round).

    tree      = grow(drafter, root, budget)            # SpecExec best-first, drafter only
    logits    = target.verify(tree)                    # ONE target pass over every node
    path, tok = accept(tree, logits, ...)              # the round's rule (edge/rules.py) draws at each node
    target.commit(path); drafter.commit(path)          # both caches hold the committed text
    emit tokens of path[1:], then tok                  # tok is the next round's root

Acceptance walks the tree from the root: at node v the target's token x is drawn (by the rule: sample-and-match
draws from the target's own distribution; the residual rule tests the drafter's candidates first; coupled sampling
draws by the reply's noise); if some child of v carries x, the walk moves there, else x is emitted and the round
stops. Every emitted token is a draw from the target given exactly the tokens before it, so the output has the
target's distribution (greedy: the target's argmax, token for token); the drafter only decides how many draws one
pass yields. The tree must not depend on those draws, and it does not: growth uses the drafter alone.

With an Overlap (edge/overlap.py) the same round runs its pass in a worker thread while the drafter grows on, and
the tree grown for the outcome that happened becomes the next round's: where the rule allows it (not the residual
rule, whose tree is drawn as it is verified). What each round does is the round policy's plan (edge/policy.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from edge.acceptance import Acceptance
from edge.errors import ModelFault
from edge.grow import GrowConfig, Growth
from edge.lookup import LookupTree
from edge.protocols import Drafter, Target, verifies_chains_only
from edge.rules import MATCH, Reply, RoundRule, Rule
from edge.tree import DRAFTED, LOOKED_UP, TokenTree

if TYPE_CHECKING:
    from edge.overlap import Overlap


@dataclass(frozen=True)
class RoundPlan:
    grow: GrowConfig | None  # None: plain decoding
    rule: Rule = MATCH  # edge/rules.py: sample-and-match, the residual rule or coupled sampling
    lookup: LookupTree | None = None  # lookup branches to merge into the tree (edge/lookup.py)
    drafting: bool = False  # the drafter grows the tree (else its nodes are the lookup branches alone)
    acceptance: Acceptance | None = None  # the rule's measured rates: growth ranks the drafter's nodes by them
    lookup_acceptance: Acceptance | None = None  # lookup's, where the tree has its branches
    # lookup's proposal where the round decodes plainly: its first tokens are checked against the target's token, so
    # lookup's measured rates keep learning while no tree of its own runs (one early miss would stop them for good)
    unverified: LookupTree | None = None
    expected: float = 0.0  # a tree of lookup's alone: the tokens its pass was expected to yield


def accept(tree: TokenTree, logits: np.ndarray, history: Sequence[int], rule: RoundRule) -> tuple[list[int], int]:
    """logits: [n_nodes, n_vocab]. Returns the accepted path (node ids, root first) and the target's next token, drawn
    by `rule` at each node. Touches only the rows on one path; `history` is the committed text before the root, for
    penalties."""
    path = [0]
    seen = [*history, int(tree.tokens[0])]
    while True:
        row = logits[path[-1]]  # read once: a replayed target's rows can be read only down one path
        if np.isnan(row).any():
            raise ModelFault("the target's logits are not numbers (NaN): its model file is damaged or was changed "
                             "while loaded; remove it and download it again")
        token = rule.token(row, seen)
        child = tree.child(path[-1], token)
        if child is None:
            return path, token
        path.append(child)
        seen.append(token)


def accept_and_learn(tree: TokenTree, logits: np.ndarray, history: Sequence[int], rule: RoundRule,
                     plan: RoundPlan) -> tuple[list[int], int]:
    """accept(), then each measured rate of the plan learns from the round: the drafter's nodes, and lookup's."""
    path, token = accept(tree, logits, history, rule)
    if plan.acceptance is not None:
        plan.acceptance.observe(tree, path, token, DRAFTED)
    if plan.lookup_acceptance is not None:
        plan.lookup_acceptance.observe(tree, path, token, LOOKED_UP)
    return path, token


class Stopwatch:
    """Seconds by step of one round: `with clock("verify"):` adds the block's time to clock.seconds["verify"]."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class RoundResult:
    tokens: list[int]  # accepted path tokens after the root, then the target's own token
    tree: TokenTree  # what was verified (the root alone in a plain round)
    path: list[int]  # the accepted path, node ids, root first
    drafter_passes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # by step: grow, verify, commit, drafter commit
    pregrown: bool = False  # its tree was grown during the previous round's pass (edge/overlap.py)

    @property
    def tree_size(self) -> int:
        return len(self.tree)

    @property
    def grow_s(self) -> float:  # growing the tree (drafter passes)
        return self.seconds.get("grow", 0.0)

    @property
    def draft_s(self) -> float:  # all drafter time: growth plus keeping the accepted path
        return self.grow_s + self.seconds.get("drafter commit", 0.0)

    @property
    def verify_s(self) -> float:  # the target's pass and acceptance
        return self.seconds.get("verify", 0.0)


def run_round(target: Target, drafter: Drafter | None, context: Sequence[int], plan: RoundPlan, reply: Reply,
              overlap: Overlap | None = None) -> RoundResult:
    """One round as `plan` says: context holds every committed token, its last one the root. A plan without a tree
    (or one with neither a drafter nor lookup branches) is plain decoding; the drafter grows only where the plan
    drafts. With `overlap`, where the plan drafts and its rule allows it, the round takes the tree grown during the
    previous pass for this root (if any) and grows on during its own pass (edge/overlap.py)."""
    from edge.overlap import GROW_ON_EXPANSIONS, Pending, grow_on_budget

    clock, history = Stopwatch(), context[:-1]
    drafting = drafter if plan.drafting else None
    rule = plan.rule.start(drafting, history, reply)
    ahead = overlap if overlap is not None and drafting is not None and plan.rule.overlaps else None
    tree = None if ahead is None or plan.grow is None else ahead.take(context, plan.grow)
    pregrown, growth = tree is not None, None
    with clock("grow"):
        if plan.grow is not None and (drafting is not None or plan.lookup):
            config = replace(plan.grow, grow_on=GROW_ON_EXPANSIONS) if ahead is not None else plan.grow
            growth = Growth(drafting, context[-1], config, plan.acceptance, reply.stop_tokens, rule.expand,
                            plan.lookup, plan.lookup_acceptance)
            if tree is None:
                if drafting is not None:
                    target.prefetch()  # a streamed target reads its weights while we draft
                while growth.step():
                    pass
                tree = growth.tree()[0]
        if tree is None:
            tree = TokenTree.root(context[-1])
        if verifies_chains_only(target) and not tree.is_chain():
            tree = tree.spine()  # its other nodes would round otherwise on this target's backend
    with clock("verify"):
        if ahead is not None and growth is not None:
            verified = ahead.submit(target, tree)
            growth.go_on(grow_on_budget(plan.grow))
            started = time.perf_counter()
            while not verified.done() and growth.step():
                pass
            clock.seconds["hidden"] = time.perf_counter() - started
            logits = verified.result()
        else:
            logits = target.verify(tree)
        path, token = accept_and_learn(tree, logits, history, rule, plan)
    with clock("commit"):
        target.commit(tree, path)
    with clock("drafter commit"):
        if drafting is not None:
            drafting.commit(tree, path)  # by its tokens: whatever growth ran past the path goes
    accepted = tree.path_tokens(path)
    if ahead is not None and growth is not None:
        node = growth.find([*accepted, token])
        if node is not None and token not in reply.stop_tokens:
            ahead.pending = Pending(len(context) + len(accepted), token, growth, node)
    passes = 0 if growth is None else growth.steps  # drafter passes, before the target's pass and during it
    return RoundResult([*accepted[1:], token], tree, path, passes, clock.seconds, pregrown)
