"""What each round of generation does, chosen in one place: the shape of its tree (or none: plain decoding) and the
rule that accepts it.

Two parts make the choice: a budget policy (a fixed tree every round, or edge.budget.AutoBudget for `--budget auto`)
and the acceptance rule ("match", "residual", or edge.residual.AutoRule for `--accept auto`). Greedy decoding is
always sample-and-match (at temperature 0 the rules are the same), decided here and nowhere else. The policy also
keeps the measured acceptance rates growth ranks nodes by (edge/acceptance.py), one table per rule: they depend on
how the target samples, so they start over when that changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge.acceptance import Acceptance
from edge.errors import UserError
from edge.grow import GrowConfig
from edge.lookup import LookupTree
from edge.options import ACCEPT_RULES
from edge.residual import AutoRule
from edge.sampling import SamplingConfig
from edge.speculative import RULES, RoundResult
from edge.tree import LOOKED_UP, TokenTree

# a lookup branch less likely than this to be reached and taken adds too little to price a pass for
MIN_REACH = 0.01
GREEDY_DRAFT_TEMPERATURE = 0.5  # measured: tokens per pass 5.7 -> 6.3 at budget 64 (docs/performance.md)


class BudgetPolicy(Protocol):
    """Chooses each round's tree shape (None: plain decoding) and learns from the round that ran."""

    def choose(self, max_nodes: int) -> GrowConfig | None: ...  # a tree of at most max_nodes nodes, root included
    def observe(self, config: GrowConfig | None, result: RoundResult) -> None: ...
    def pass_s(self, tokens: int) -> float | None: ...  # a target pass over so many tokens, where measured


@dataclass(frozen=True)
class FixedBudget:
    """The same tree shape every round (None: plain decoding every round)."""

    config: GrowConfig | None

    def choose(self, max_nodes: int) -> GrowConfig | None:
        return self.config

    def observe(self, config: GrowConfig | None, result: RoundResult) -> None:
        pass

    def pass_s(self, tokens: int) -> float | None:
        return None  # not measured: a fixed tree takes every lookup branch it has room for


@dataclass(frozen=True)
class RoundPlan:
    grow: GrowConfig | None  # None: plain decoding
    rule: str = "match"  # "match" (sample-and-match) or "residual"
    lookup: LookupTree | None = None  # lookup branches to merge into the tree (edge/lookup.py)
    drafting: bool = False  # the drafter grows the tree (else its nodes are the lookup branches alone)
    # lookup's proposal where the round decodes plainly: its first tokens are checked against the target's token, so
    # lookup's measured rates keep learning while no tree of its own runs (one early miss would stop them for good)
    unverified: LookupTree | None = None


class RoundPolicy:
    """The Decoder's one source of each round's plan. `budget` chooses trees; `accept` is the rule when sampling:
    "match", "residual" or "auto" (the one measured to yield more)."""

    def __init__(self, budget: BudgetPolicy, accept: str = "match", drafts: bool = True, lookup: bool = True,
                 max_lookup: int | None = None) -> None:
        """`drafts`: a drafter grows the trees; `lookup`: lookup's branches join them, and make trees of their own
        where the budget policy decodes plainly, of at most `max_lookup` nodes (a fixed budget's; None: as many as
        pay)."""
        if accept not in ACCEPT_RULES:
            raise UserError(f"accept must be one of {', '.join(ACCEPT_RULES)} (got {accept!r})", "accept")
        self.budget, self.accept, self.drafts, self.uses_lookup = budget, accept, drafts, lookup
        self.max_lookup = max_lookup
        self.sampling = SamplingConfig()
        self._reset_rates()

    def _reset_rates(self) -> None:
        self.acceptances = {rule: Acceptance(greedy=self.sampling.greedy) for rule in RULES}
        self.lookup_acceptance = Acceptance(greedy=self.sampling.greedy)
        self.auto_rule = AutoRule()

    def set_sampling(self, sampling: SamplingConfig) -> None:
        """The rates the target accepts at (and so the measured rates and `auto`'s choice) depend on how it samples,
        not on the seed: they are kept while only the seed changes."""
        unchanged = dataclasses.replace(sampling, seed=None) == dataclasses.replace(self.sampling, seed=None)
        self.sampling = sampling
        if not unchanged:
            self._reset_rates()

    def rule(self, choose: bool = True) -> str:
        """The rule a round runs: sample-and-match when greedy, else the flag's, or auto's choice (`choose`: a round
        asks, and auto counts it; otherwise what it runs now)."""
        if self.sampling.greedy or self.accept == "match":
            return "match"
        if self.accept == "residual":
            return "residual"
        return (self.auto_rule.choose() if choose else self.auto_rule.choice) or "match"

    @property
    def acceptance(self) -> Acceptance:
        """The measured rates of the rule that runs now."""
        return self.acceptances[self.rule(choose=False)]

    def plan(self, room: int, wanted: int, lookup: LookupTree | None = None) -> RoundPlan:
        """The next round's plan: a tree of at most `room` nodes (root included: the context and the target's pass
        bound it) and no deeper than the `wanted` tokens left of the reply can use. `lookup`: the continuations lookup
        proposes now; they join the drafter's tree, and where the budget policy decodes plainly they may make a tree
        of their own, where their expected tokens pay for the larger pass."""
        lookup = lookup if self.uses_lookup and lookup else None
        config = self.budget.choose(room) if self.drafts else None
        if config is None:
            most = room - 1 if self.max_lookup is None else min(room - 1, self.max_lookup)
            size = 0 if lookup is None or most < 1 else self._lookup_size(lookup, most)
            if not size:
                return RoundPlan(None, unverified=lookup)
            config = GrowConfig(budget=size, beams=1, width=1, max_depth=max(wanted - 1, 1), max_steps=0)
            return RoundPlan(config, "match", lookup, drafting=False)
        rule = self.rule()
        # top-k scores sharpened to the target's temperature (sharper still when greedy); residual q already is at it
        draft_temperature = 1.0 if rule == "residual" else (
            GREEDY_DRAFT_TEMPERATURE if self.sampling.greedy else self.sampling.temperature)
        config = dataclasses.replace(config, draft_temperature=draft_temperature).within_reply(wanted)
        if config.budget + 1 > room:
            if room <= 1:
                return RoundPlan(None)
            config = dataclasses.replace(config, budget=room - 1)
        return RoundPlan(config, rule, lookup, drafting=True)

    def _lookup_size(self, lookup: LookupTree, most: int) -> int:
        """How many of the lookup branches (the likeliest, by their measured acceptance) a tree of their own should
        take: the count whose expected tokens per second of target pass is best, 0 where none beats a plain pass. A
        budget policy that has not measured passes (a fixed tree) takes all it has room for."""
        parents = [branch.parent for branch in lookup.branches]
        probability = np.array([branch.confidence for branch in lookup.branches])
        depth = np.ones(len(lookup), np.int64)
        best_sibling: dict[int, float] = {}
        for i, (parent, p) in enumerate(zip(parents, probability.tolist(), strict=True)):  # parents come first
            best_sibling[parent] = max(best_sibling.get(parent, 0.0), p)
            if parent >= 0:
                depth[i] = depth[parent] + 1
        rank = (probability < np.array([best_sibling[parent] for parent in parents])).astype(np.int64)
        rates = np.exp(self.lookup_acceptance.log_accept(np.log(np.maximum(probability, 1e-30)), depth, rank))
        reach = rates.tolist()  # the chance that the target accepts each branch's whole path
        for i, parent in enumerate(parents):
            if parent >= 0:
                reach[i] *= reach[parent]
        taken = np.sort(reach)[::-1][:most]  # a child's reach is below its parent's: the best k are a tree
        if self.budget.pass_s(1) is None:
            return len(taken)
        taken = taken[taken >= MIN_REACH]
        if not len(taken):
            return 0
        expected = 1.0 + np.cumsum(taken)
        rates = [expected[k] / self.budget.pass_s(k + 2) for k in range(len(taken))]
        best = int(np.argmax(rates))
        return best + 1 if rates[best] > 1.0 / self.budget.pass_s(1) else 0

    def observe(self, plan: RoundPlan, result: RoundResult) -> None:
        if plan.drafting or plan.grow is None:  # a tree of lookup branches alone says nothing of the drafter's
            self.budget.observe(plan.grow, result)
        if plan.unverified is not None and result.tokens:
            self.lookup_acceptance.observe(_first_tokens(plan.unverified), [0], result.tokens[0], LOOKED_UP)
        if plan.drafting and self.accept == "auto" and not self.sampling.greedy:
            self.auto_rule.observe(plan.rule, result.tree, result.path)


def _first_tokens(lookup: LookupTree) -> TokenTree:
    """The first tokens of lookup's branches under a root (whose token does not matter here), as a tree for
    Acceptance.observe: what a plain round's token says of them."""
    first = [branch for branch in lookup.branches if branch.parent < 0]
    confidence = np.array([branch.confidence for branch in first], np.float32)
    n = len(first) + 1
    rank = np.concatenate([[0], confidence < confidence.max(initial=0.0)]).astype(np.int32)
    return TokenTree(np.array([0, *(branch.token for branch in first)], np.int32),
                     np.array([-1, *[0] * len(first)], np.int32), np.minimum(np.arange(n), 1).astype(np.int32),
                     np.zeros(n, np.float32), np.log(np.concatenate([[1.0], confidence])).astype(np.float32), rank,
                     np.array([0, *[LOOKED_UP] * len(first)], np.uint8))
