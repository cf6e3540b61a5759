"""What each round of generation does, chosen in one place: the shape of its tree (or none: plain decoding) and the
rule that accepts it.

Two parts make the choice: a budget policy (a fixed tree every round, or edge.budget.AutoBudget for `--budget auto`)
and the acceptance rule (edge/rules.py: "match", "residual", or "coupled"; `--accept auto` chooses between the
residual rule and coupled sampling round by round, by what each has yielded: edge.rules.RuleChoice). Greedy decoding
is always sample-and-match (at temperature 0 the rules are the same), decided here and nowhere else. `--accept
coupled` is a reply's rule, not a round's: every round of the reply draws by its noise (edge/coupled.py). The
policy also keeps the measured acceptance rates growth ranks nodes by (edge/acceptance.py), one table per rule: they
depend on how the target samples, so they start over when that changes. A round's plan
carries all of it: the tree's shape, the rule, lookup's branches and the rates to learn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from edge.acceptance import Acceptance
from edge.errors import UserError
from edge.grow import GrowConfig
from edge.lookup import LookupTree
from edge.options import ACCEPT_RULES
from edge.rules import AUTO_RULES, MATCH, RULES, Rule, RuleChoice
from edge.sampling import SamplingConfig
from edge.speculative import RoundPlan, RoundResult

# a lookup branch less likely than this to be reached and taken adds too little to price a pass for
MIN_REACH = 0.01
# Lookup's rates are measured branch by branch, but its trees' tokens are not the sum of independent chances (a copy
# that breaks breaks every branch below): the expected tokens are scaled by what lookup's trees have yielded against
# what was expected of them, a running ratio (YIELD_SMOOTHING: the newest tree's weight), never above 1 and no lower
# than MIN_YIELD, and drawn back towards 1 by YIELD_RECOVERY a plain round, so that trees are tried again later.
YIELD_SMOOTHING = 0.25
MIN_YIELD = 0.05
YIELD_RECOVERY = 0.01
LOOKUP_BRANCHES = 64  # continuations lookup proposes a round, at most (the round's budget takes the likeliest)


class BudgetPolicy(Protocol):
    """Chooses each round's tree shape (None: plain decoding) and learns from the round that ran."""

    # a tree of at most max_nodes nodes, root included, for a round that `rule` verifies
    def choose(self, max_nodes: int, rule: str = "match") -> GrowConfig | None: ...
    def observe(self, config: GrowConfig | None, result: RoundResult, rule: str = "match") -> None: ...
    def pass_s(self, tokens: int) -> float | None: ...  # a target pass over so many tokens, where measured
    # held: choose by the pass times the pair loaded with alone, not by how long rounds took (a seeded reply repeats)
    def hold_timing(self, held: bool) -> None: ...


@dataclass(frozen=True)
class FixedBudget:
    """The same tree shape every round (None: plain decoding every round)."""

    config: GrowConfig | None

    def choose(self, max_nodes: int, rule: str = "match") -> GrowConfig | None:
        return self.config

    def observe(self, config: GrowConfig | None, result: RoundResult, rule: str = "match") -> None:
        pass

    def pass_s(self, tokens: int) -> float | None:
        return None  # not measured: a fixed tree takes every lookup branch it has room for

    def hold_timing(self, held: bool) -> None:
        pass  # no time chooses a fixed tree


class Measured:
    """What a pair's sampled decoders have measured, shared by them all (and so by `--accept auto`'s choice): by
    sampling (its seed aside) and budget, each rule's tokens a pass (RuleChoice); by sampling, each rule's acceptance
    rates. `kept`: what an earlier run measured for a key (RuleChoice.to_json's), where the pair keeps it between runs
    (models/kept.py); None keeps nothing. A server's principals each measure their own, kept by none.

    A seeded reply starts from the kept yields but keeps none: what it measured would change the next run's choices,
    and so the text the same seed gives there (as its trees hold to the kept pass times: AutoBudget.hold_timing)."""

    def __init__(self, kept: Callable[[str], object] | None = None) -> None:
        self.kept = kept
        self.choices: dict[str, RuleChoice] = {}
        self.rates: dict[SamplingConfig, dict[str, Acceptance]] = {}
        self.held: set[str] = set()  # keys a seeded reply measured: not kept

    def choice(self, sampling: SamplingConfig, budget: BudgetPolicy) -> RuleChoice:
        """The rules' yields for this sampling and budget policy, from the kept ones where this run has none."""
        key = _choice_key(sampling, budget)
        if sampling.seed is not None:
            self.held.add(key)
        return self._choice(key)

    def _choice(self, key: str) -> RuleChoice:
        if key not in self.choices:
            self.choices[key] = RuleChoice() if self.kept is None else RuleChoice.kept(self.kept(key))
        return self.choices[key]

    def rates_of(self, sampling: SamplingConfig) -> dict[str, Acceptance]:
        """Each rule's acceptance rates when the target samples so (its seed aside)."""
        return self.rates.setdefault(dataclasses.replace(sampling, seed=None),
                                     {rule: Acceptance() for rule in RULES})

    def afresh(self) -> Measured:
        """An empty measurement over the same kept one (a benchmark's row, measured apart from the others)."""
        return Measured(self.kept)

    def take(self, other: Measured, rules: Sequence[str] = AUTO_RULES) -> None:
        """The rounds `other` measured of `rules` join this one's (RuleChoice.take), to keep whether or not seeded
        replies measured them (a benchmark's rows: a measurement made to be kept)."""
        for key, choice in other.choices.items():
            self._choice(key).take(choice, rules)  # over the kept one: a rule `other` did not run stays as kept

    def to_json(self) -> dict[str, dict[str, list[float]]]:
        """The yields measured, by key, for the next run (none a seeded reply measured)."""
        kept = {key: choice.to_json() for key, choice in self.choices.items() if key not in self.held}
        return {key: value for key, value in kept.items() if value}


def _choice_key(sampling: SamplingConfig, budget: BudgetPolicy) -> str:
    """A measurement's key, the same in the next run: how the target samples (the seed aside) and the tree shape."""
    shape = budget.config if isinstance(budget, FixedBudget) else "auto"
    return f"{dataclasses.replace(sampling, seed=None)!r}|{shape!r}"


class RoundPolicy:
    """The Decoder's one source of each round's plan. `budget` chooses trees; `accept` is the rule when sampling:
    "match", "residual", "coupled" or "auto" (the residual rule or coupled sampling, whichever has yielded more
    tokens a pass on this pair at this temperature: edge.rules.RuleChoice)."""

    def __init__(self, budget: BudgetPolicy, accept: str = "match", drafts: bool = True, lookup: bool = True,
                 max_lookup: int | None = None, choices: Measured | None = None) -> None:
        """`drafts`: a drafter grows the trees; `lookup`: lookup's branches join them, and make trees of their own
        where the budget policy decodes plainly, of at most `max_lookup` nodes (a fixed budget's; None: as many as
        pay). `choices`: the pair's measured yields by rule (RuleChoice), by sampling and budget, and when sampling
        its acceptance rates by rule, which every decoder of the pair adds to (Measured, Pair.rule_choices): what one
        decoder measured, the next chooses and grows by (a rule `--accept auto` runs seldom keeps what it learned)."""
        if accept not in ACCEPT_RULES:
            raise UserError(f"accept must be one of {', '.join(ACCEPT_RULES)} (got {accept!r})", "accept")
        self.budget, self.accept, self.drafts, self.uses_lookup = budget, accept, drafts, lookup
        self.max_lookup = max_lookup
        self.choices = Measured() if choices is None else choices
        self._price: float | None = None  # _node_price()
        self.sampling = SamplingConfig()
        self._reset_rates()
        self.choice = self.choices.choice(self.sampling, self.budget)

    def _reset_rates(self) -> None:
        if self.sampling.greedy:
            self.acceptances = {rule: Acceptance(greedy=True) for rule in RULES}
        else:  # sampled: every decoder sharing `choices` learns one table a rule, as `--accept auto` compares them
            self.acceptances = self.choices.rates_of(self.sampling)
        self.lookup_acceptance = Acceptance(greedy=self.sampling.greedy)
        self.lookup_yield = 1.0  # lookup trees' tokens beyond the target's own, measured / expected: _lookup_size

    def set_sampling(self, sampling: SamplingConfig) -> None:
        """The rates the target accepts at (and so the measured rates) depend on how it samples, not on the seed: they
        are kept while only the seed changes."""
        unchanged = dataclasses.replace(sampling, seed=None) == dataclasses.replace(self.sampling, seed=None)
        self.sampling = sampling
        if not unchanged:
            self._reset_rates()
        # --accept auto's measured yields, for this sampling (its seed aside) and this budget policy
        self.choice = self.choices.choice(sampling, self.budget)
        # a seeded sampled reply's trees shape its draws (the residual rule draws the drafter's children): trees chosen
        # by how long rounds took on a busy machine would make the same seed give another text
        self.budget.hold_timing(sampling.seed is not None and not sampling.greedy)

    def rule(self) -> Rule:
        """The rule the next round runs: sample-and-match when greedy, else the flag's ("auto": RuleChoice's)."""
        if self.sampling.greedy or self.accept == "match":
            return MATCH
        return self.choice.pick() if self.chooses else RULES[self.accept]

    @property
    def chooses(self) -> bool:
        """The rule is chosen round by round (`--accept auto` when sampling): a coupled round draws by noise of its
        own, and a plain round by the random numbers."""
        return self.accept == "auto" and not self.sampling.greedy

    @property
    def coupled(self) -> bool:
        """Every round of a reply draws by the reply's noise (edge/coupled.py), plain rounds included."""
        return not self.chooses and self.rule().coupled

    @property
    def acceptance(self) -> Acceptance:
        """The measured rates of the rule that runs now."""
        return self.acceptances[self.rule().name]

    def plan(self, room: int, wanted: int, lookup: LookupTree | None = None) -> RoundPlan:
        """The next round's plan: a tree of at most `room` nodes (root included: the context and the target's pass
        bound it) and no deeper than the `wanted` tokens left of the reply can use. `lookup`: the continuations lookup
        proposes now; they join the drafter's tree, and where the budget policy decodes plainly they may make a tree
        of their own, where their expected tokens pay for the larger pass."""
        lookup = lookup if self.uses_lookup and lookup else None
        rule = self.rule() if self.drafts else MATCH  # the budget's measured yield is the rule's own
        config = self.budget.choose(room, rule.name) if self.drafts else None
        if config is None:
            most = room - 1 if self.max_lookup is None else min(room - 1, self.max_lookup)
            size, expected = (0, 1.0) if lookup is None or most < 1 else self._lookup_size(lookup, most)
            if not size:
                return RoundPlan(None, unverified=lookup)
            config = GrowConfig(budget=size, beams=1, width=1, max_depth=max(wanted - 1, 1), max_steps=0)
            return RoundPlan(config, MATCH, lookup, drafting=False, lookup_acceptance=self.lookup_acceptance,
                             expected=expected)
        config = dataclasses.replace(config, draft_temperature=rule.draft_temperature(self.sampling))
        config = config.within_reply(wanted)
        if config.budget + 1 > room:
            if room <= 1:
                return RoundPlan(None)
            config = dataclasses.replace(config, budget=room - 1)
        return RoundPlan(config, rule, lookup, drafting=True, acceptance=self.acceptances[rule.name],
                         lookup_acceptance=self.lookup_acceptance if lookup is not None else None)

    def _lookup_size(self, lookup: LookupTree, most: int) -> tuple[int, float]:
        """How many of the lookup branches (the likeliest, by their measured acceptance) a tree of their own should
        take, and the tokens its pass is expected to yield: the count whose expected tokens per second of target pass
        is best, 0 where none beats a plain pass. A budget policy that has not measured passes (a fixed tree) takes
        all it has room for. The branches' rates are scaled by what lookup's trees have yielded against what was
        expected of them (`lookup_yield`).

        It runs every round that decodes plainly, so it is plain Python (numpy's per-call cost had made it a third
        of auto's own time in such a round) and gives up early: no node of a tree is likelier to be reached than its
        first token, so where the likeliest first token could not pay for a node at the cheapest price a larger pass
        charges per node, no tree of them can."""
        if self.budget.pass_s(1) is None:
            return min(len(lookup), most), 1.0
        rate, scale = self.lookup_acceptance.rate, self.lookup_yield
        first = [branch.confidence for branch in lookup.branches if branch.parent < 0]
        top = max(first, default=0.0)
        if scale * max((rate(c, 1, int(c < top)) for c in first), default=0.0) <= self._node_price():
            return 0, 1.0
        best_sibling: dict[int, float] = {}
        for branch in lookup.branches:  # the likeliest branch under each parent: the others are runner-ups (rank 1)
            best_sibling[branch.parent] = max(best_sibling.get(branch.parent, 0.0), branch.confidence)
        depth: list[int] = []
        reach: list[float] = []  # the chance that the target accepts each branch's whole path
        for branch in lookup.branches:  # parents come first
            below = branch.parent >= 0
            depth.append(depth[branch.parent] + 1 if below else 1)
            if below and reach[branch.parent] < MIN_REACH:  # below a parent too unlikely to take: so is it
                reach.append(0.0)
                continue
            confidence = branch.confidence
            r = rate(confidence, depth[-1], int(confidence < best_sibling[branch.parent]))
            reach.append(r * reach[branch.parent] if below else r)
        taken = sorted(reach, reverse=True)[:most]  # a child's reach is below its parent's: the best k are a tree
        best, best_rate, best_expected, expected = 0, 1.0 / self.budget.pass_s(1), 1.0, 1.0
        for k, r in enumerate(taken, 1):
            if r < MIN_REACH:
                break
            expected += scale * r
            if (k_rate := expected / self.budget.pass_s(k + 1)) > best_rate:
                best, best_rate, best_expected = k, k_rate, expected
        return best, best_expected

    def _node_price(self) -> float:
        """The least a node of a lookup tree costs, in plain passes: min over k of (t(k + 1) / t(1) - 1) / k, for the
        tree sizes lookup proposes (a tree of k nodes pays only if its expected accepted tokens, at most k times its
        likeliest first token's chance, exceed that). The measured pass times' scale cancels: computed once."""
        if self._price is None:
            plain_s = self.budget.pass_s(1)
            self._price = min((self.budget.pass_s(k + 1) / plain_s - 1) / k for k in range(1, LOOKUP_BRANCHES + 1))
        return self._price

    def observe(self, plan: RoundPlan, result: RoundResult) -> None:
        if plan.drafting or plan.grow is None:  # a tree of lookup branches alone says nothing of the drafter's
            self.budget.observe(plan.grow, result, plan.rule.name)
        if plan.drafting and not self.sampling.greedy:  # every rule's rounds: what auto will choose by
            self.choice.observe(plan.rule.name, len(result.tokens))
        if plan.unverified is not None and result.tokens:
            _observe_first_tokens(self.lookup_acceptance, plan.unverified, result.tokens[0])
            self.lookup_yield += (1.0 - self.lookup_yield) * YIELD_RECOVERY
        if plan.expected > 1.0:  # a tree of lookup's alone: what it yielded against what it was expected to
            got = (len(result.tokens) - 1) / (plan.expected - 1.0)  # already scaled: the yield moves by this ratio
            blended = self.lookup_yield * (1 - YIELD_SMOOTHING + YIELD_SMOOTHING * got)
            self.lookup_yield = min(max(blended, MIN_YIELD), 1.0)


def _observe_first_tokens(acceptance: Acceptance, lookup: LookupTree, token: int) -> None:
    """What a plain round's token says of lookup's first tokens, counted as Acceptance.observe counts the children
    of a tree's root (their draft probability: their confidence; rank 1 below the likeliest)."""
    first = [branch for branch in lookup.branches if branch.parent < 0]
    if not first:
        return
    top = max(branch.confidence for branch in first)
    acceptance.fade()
    for branch in first:
        acceptance.count(1, int(branch.confidence < top), branch.confidence, branch.token == token)
