"""The acceptance rules, each one object: how its trees are drafted, how the target's token is drawn at each node of
the accepted path, and whether its trees may be grown during the previous round's pass (edge/overlap.py).

    rule = RULES[name]                                   # "match", "residual" or "coupled"
    round_rule = rule.start(drafter, history, reply)      # one round's: its `expand` for growth, and `token`
    token = round_rule.token(row, seen)                  # at each node of the path, the target's draw there

- **match** (sample-and-match): growth takes the drafter's top tokens; at each node the target draws from its own
  distribution and the round goes on where a child carries the draw. Lossless for any drafter.
- **residual** (SpecInfer's multi-candidate rule, edge/residual.py): growth draws each node's children from the
  drafter's q; at each node they are tested against the target's p in draw order. Its token has p's distribution.
  Its tree is drawn as it is verified, so it never grows during the previous pass.
- **coupled** (edge/coupled.py): sample-and-match whose draws come from noise fixed by each token's position, the
  noise growth ranks the drafter's children on. A reply's rule: every round draws by the reply's noise, plain ones
  too, so a seed gives the same reply with and without a tree.

A new rule is a new module with a Rule and its RoundRule, and one line in RULES.

`--accept auto` is RuleChoice: round by round, the candidate rule whose tree rounds have yielded the most tokens a
target pass, as measured on this pair at this temperature (each tried for a few rounds first, and again now and
then). Choosing by what earlier rounds yielded keeps every round's token the target's draw: the rng's next numbers,
or a coupled round's noise, are fresh for the round and so independent of the choice. A coupled round under auto
takes a new noise key (a key's noise at the positions past a round's end has already ranked its tree, and so swayed
the choice that follows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge.coupled import CoupledProposer, Noise, coupled_draw
from edge.grow import Expand
from edge.protocols import Drafter
from edge.residual import Proposer, residual_draw
from edge.sampling import SamplingConfig, distribution, draw

GREEDY_DRAFT_TEMPERATURE = 0.5  # measured: tokens per pass 5.7 -> 6.3 at budget 64 (docs/performance.md)


@dataclass(frozen=True)
class Reply:
    """What every round of one reply draws with: how the target samples, its random numbers (the target's, and the
    residual rule's drafter's, apart so that the target's draws never depend on the tree), a coupled reply's noise,
    and the tokens that end it (growth expands nothing past them)."""

    sampling: SamplingConfig
    rng: np.random.Generator
    draft_rng: np.random.Generator
    noise: Noise | None = None
    stop_tokens: frozenset[int] = frozenset()


class RoundRule(Protocol):
    """A rule's state for one round."""

    expand: Expand | None  # growth's expansion (None: the drafter's top tokens)

    def token(self, row: np.ndarray, seen: Sequence[int]) -> int:
        """The target's token at a node: `row` its logits there, `seen` the text up to and including the node."""
        ...


class Rule(Protocol):
    name: str
    overlaps: bool  # its trees may be grown during the previous round's pass (edge/overlap.py)
    coupled: bool  # every round of a reply, plain ones too, draws by the reply's noise

    def draft_temperature(self, sampling: SamplingConfig) -> float:
        """The temperature growth sharpens the drafter's scores to."""
        ...

    def start(self, drafter: Drafter | None, history: Sequence[int], reply: Reply) -> RoundRule:
        """The round's rule state; `drafter` None: nothing is drafted this round; `history`: the text before the
        root."""
        ...


@dataclass(frozen=True)
class _Drawn:
    """Sample-and-match's round: the target draws from its own distribution (by the reply's noise, coupled)."""

    reply: Reply
    expand: Expand | None = None

    def token(self, row: np.ndarray, seen: Sequence[int]) -> int:
        if self.reply.noise is not None:
            return coupled_draw(row, self.reply.sampling, seen, self.reply.noise)
        return draw(row, self.reply.sampling, seen, self.reply.rng)


class Match:
    name, overlaps, coupled = "match", True, False

    def draft_temperature(self, sampling: SamplingConfig) -> float:
        """Top-k scores sharpened to the target's temperature, sharper still when greedy."""
        return GREEDY_DRAFT_TEMPERATURE if sampling.greedy else sampling.temperature

    def start(self, drafter: Drafter | None, history: Sequence[int], reply: Reply) -> RoundRule:
        return _Drawn(reply)


class Coupled(Match):
    name, overlaps, coupled = "coupled", True, True

    def draft_temperature(self, sampling: SamplingConfig) -> float:
        return 1.0  # growth scores by the noisy keys' shares

    def start(self, drafter: Drafter | None, history: Sequence[int], reply: Reply) -> RoundRule:
        if drafter is None or reply.noise is None:
            return _Drawn(reply)
        return _Drawn(reply, CoupledProposer(drafter, reply.sampling, history, reply.noise).expand)


@dataclass(frozen=True)
class _Residual:
    """The residual rule's round: the candidates drawn at each expanded node are tested first."""

    reply: Reply
    proposer: Proposer | None
    history_length: int

    @property
    def expand(self) -> Expand | None:
        return None if self.proposer is None else self.proposer.expand

    def token(self, row: np.ndarray, seen: Sequence[int]) -> int:
        proposal = None if self.proposer is None else self.proposer.at(seen[self.history_length:])
        if proposal is None:
            return draw(row, self.reply.sampling, seen, self.reply.rng)
        return residual_draw(*distribution(row, self.reply.sampling, seen), proposal, self.reply.rng)


class Residual:
    name, overlaps, coupled = "residual", False, False

    def draft_temperature(self, sampling: SamplingConfig) -> float:
        return 1.0  # q is already at the target's temperature

    def start(self, drafter: Drafter | None, history: Sequence[int], reply: Reply) -> RoundRule:
        proposer = None if drafter is None else Proposer(drafter, reply.sampling, history, reply.draft_rng)
        return _Residual(reply, proposer, len(history))


RULES: dict[str, Rule] = {rule.name: rule for rule in (Match(), Residual(), Coupled())}
MATCH = RULES["match"]


AUTO_RULES = ("residual", "coupled")  # what `--accept auto` chooses between when sampling
EXPLORE_ROUNDS = 2  # tree rounds each candidate runs before auto compares them
# A candidate's score: its mean tokens a pass, plus UCB1's allowance for having run few rounds (a round's yield varies
# as much as its mean): BONUS x the candidates' mean x sqrt(ln(rounds of all) / its rounds). A rule behind by a third
# of the mean runs about 2.25 ln(rounds of all) rounds in all: some 10 of the first hundred, 16 of the first thousand.
BONUS = 0.5
# The newest round's weight in a candidate's mean once it has run 1 / YIELD_WEIGHT rounds; before, every round weighs
# alike. A round's yield varies about as much as its mean, so a mean over the last twenty rounds moves by a fifth, and a
# few poor rounds of the better rule sent the choice to the other (the real pair at budget 255: 92% of the residual
# rule's yield, docs/performance.md); weighing 128 rounds it moves by about 5%, and a rule whose yield falls from ten
# to three (the texts changed) is left within some 170 rounds (tests/test_residual.py).
YIELD_WEIGHT = 1 / 128
# What an earlier run measured counts as at most this many rounds of a rule: enough that a run's own first rounds do
# not overturn it by chance, few enough that a run whose rounds yield otherwise turns the choice within about as many
# rounds of its own. RuleChoice on rounds drawn from SmolLM2's at budget 64, started from 100 kept rounds a rule,
# reaches 100% of the better rule over 60 and 100 rounds; with 16 kept rounds and a mean of the last twenty
# (YIELD_WEIGHT 0.05) it reached 98% and 97% (benchmarks/rule_rounds.py).
KEPT_ROUNDS = 64
MAX_KEPT_YIELD = 1e4  # tokens a pass: more than any tree holds (a kept file is read as untrusted)


class RuleChoice:
    """`--accept auto`: each round the candidate rule that has yielded the most target tokens a pass, with room for
    the one measured less (UCB1). Every candidate runs EXPLORE_ROUNDS tree rounds first, the one measured least in
    turn."""

    def __init__(self, candidates: Sequence[str] = AUTO_RULES) -> None:
        self.candidates = tuple(candidates)
        self.rounds = dict.fromkeys(self.candidates, 0)
        self.mean = dict.fromkeys(self.candidates, 0.0)  # the last 128 rounds' or so (what the choice follows)
        self.average = dict.fromkeys(self.candidates, 0.0)  # every round's alike (what the next run starts from)
        self.start: dict[str, tuple[float, int]] = {}  # what it started from (kept): [tokens a pass, rounds]

    def pick(self) -> Rule:
        least = min(self.candidates, key=lambda name: self.rounds[name])
        if self.rounds[least] < EXPLORE_ROUNDS:
            return RULES[least]
        total = sum(self.rounds.values())
        scale = BONUS * sum(self.mean[name] * self.rounds[name] for name in self.candidates) / total
        return RULES[max(self.candidates, key=lambda name: self.mean[name] +
                         scale * math.sqrt(math.log(total) / self.rounds[name]))]

    def observe(self, rule: str, tokens: int) -> None:
        """A tree round of `rule` yielded `tokens` (its accepted drafts and the target's own token)."""
        if rule not in self.rounds:
            return
        self.rounds[rule] += 1
        self.mean[rule] += max(1.0 / self.rounds[rule], YIELD_WEIGHT) * (tokens - self.mean[rule])
        self.average[rule] += (tokens - self.average[rule]) / self.rounds[rule]

    def to_json(self) -> dict[str, list[float]]:
        """Each candidate measured: [tokens a pass over all its rounds, rounds], for the next run (RuleChoice.kept).
        Not the recent rounds' mean the choice follows, which a long conversation has moved to its last texts."""
        return {name: [round(self.average[name], 4), self.rounds[name]] for name in self.candidates
                if self.rounds[name]}

    @classmethod
    def kept(cls, entry: object) -> RuleChoice:
        """A choice that starts from what an earlier run measured (to_json's), each candidate's rounds counted as at
        most KEPT_ROUNDS. The entry comes from a file anyone who could write the cache made: what is not a
        candidate's [tokens a pass, rounds] is left out."""
        choice = cls()
        for name in choice.candidates:
            value = entry.get(name) if isinstance(entry, dict) else None
            if not (isinstance(value, list) and len(value) == 2 and
                    all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)):
                continue
            mean, rounds = value
            if math.isfinite(mean) and 0 <= mean <= MAX_KEPT_YIELD and math.isfinite(rounds) and rounds >= 1:
                choice.rounds[name] = min(int(rounds), KEPT_ROUNDS)
                choice.mean[name] = choice.average[name] = float(mean)
                choice.start[name] = (float(mean), choice.rounds[name])
        return choice

    def own(self, name: str) -> tuple[float, int]:
        """The tokens and rounds of `name` this choice measured itself, past what it started from."""
        start_mean, start_rounds = self.start.get(name, (0.0, 0))
        return self.average[name] * self.rounds[name] - start_mean * start_rounds, self.rounds[name] - start_rounds

    def take(self, other: RuleChoice, rules: Sequence[str] = AUTO_RULES) -> None:
        """The rounds `other` measured itself of `rules` join this one's, each rule's averaged over both (a
        benchmark's rows, each run apart from the same kept start, join the pair's measurements; the start is
        counted once)."""
        for name in self.candidates:
            tokens, rounds = other.own(name) if name in other.rounds and name in rules else (0.0, 0)
            if rounds > 0:
                self.average[name] = (self.average[name] * self.rounds[name] + tokens) / (self.rounds[name] + rounds)
                self.rounds[name] += rounds
                self.mean[name] = self.average[name]

    def described(self) -> str:
        """Each candidate's measured tokens a pass (and rounds), for the chat's /show."""
        return ", ".join(f"{name} {self.mean[name]:.2f} a pass ({self.rounds[name]} rounds)"
                         for name in self.candidates)
