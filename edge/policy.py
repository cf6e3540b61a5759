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

from edge.acceptance import Acceptance
from edge.errors import UserError
from edge.grow import GrowConfig
from edge.options import ACCEPT_RULES
from edge.residual import AutoRule
from edge.sampling import SamplingConfig
from edge.speculative import RULES, RoundResult

GREEDY_DRAFT_TEMPERATURE = 0.5  # measured: tokens per pass 5.7 -> 6.3 at budget 64 (docs/performance.md)


class BudgetPolicy(Protocol):
    """Chooses each round's tree shape (None: plain decoding) and learns from the round that ran."""

    def choose(self, max_nodes: int) -> GrowConfig | None: ...  # a tree of at most max_nodes nodes, root included
    def observe(self, config: GrowConfig | None, result: RoundResult) -> None: ...


@dataclass(frozen=True)
class FixedBudget:
    """The same tree shape every round (None: plain decoding every round)."""

    config: GrowConfig | None

    def choose(self, max_nodes: int) -> GrowConfig | None:
        return self.config

    def observe(self, config: GrowConfig | None, result: RoundResult) -> None:
        pass


@dataclass(frozen=True)
class RoundPlan:
    grow: GrowConfig | None  # None: plain decoding
    rule: str = "match"  # "match" (sample-and-match) or "residual"


class RoundPolicy:
    """The Decoder's one source of each round's plan. `budget` chooses trees; `accept` is the rule when sampling:
    "match", "residual" or "auto" (the one measured to yield more)."""

    def __init__(self, budget: BudgetPolicy, accept: str = "match") -> None:
        if accept not in ACCEPT_RULES:
            raise UserError(f"accept must be one of {', '.join(ACCEPT_RULES)} (got {accept!r})")
        self.budget, self.accept = budget, accept
        self.sampling = SamplingConfig()
        self._reset_rates()

    def _reset_rates(self) -> None:
        self.acceptances = {rule: Acceptance(greedy=self.sampling.greedy) for rule in RULES}
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

    def plan(self, room: int, wanted: int) -> RoundPlan:
        """The next round's plan: a tree of at most `room` nodes (root included: the context and the target's pass
        bound it) and no deeper than the `wanted` tokens left of the reply can use."""
        config = self.budget.choose(room)
        if config is None:
            return RoundPlan(None)
        rule = self.rule()
        # top-k scores sharpened to the target's temperature (sharper still when greedy); residual q already is at it
        draft_temperature = 1.0 if rule == "residual" else (
            GREEDY_DRAFT_TEMPERATURE if self.sampling.greedy else self.sampling.temperature)
        config = dataclasses.replace(config, draft_temperature=draft_temperature).within_reply(wanted)
        if config.budget + 1 > room:
            if room <= 1:
                return RoundPlan(None)
            config = dataclasses.replace(config, budget=room - 1)
        return RoundPlan(config, rule)

    def observe(self, plan: RoundPlan, result: RoundResult) -> None:
        self.budget.observe(plan.grow, result)
        if plan.grow is not None and self.accept == "auto" and not self.sampling.greedy:
            self.auto_rule.observe(plan.rule, result.tree, result.path)
