"""What a pair does with the memory it has, chosen by predicted tokens per second (`edge-spec plan`, and loading
where the pair is left to choose: `speculate = "auto"`).

Under a memory limit the drafter's memory is memory the target cannot keep. Each use is planned (offload/plan.py)
and priced:

- "drafter": the pair as named, the target resident as far as it fits beside the drafter, the rest streamed;
  a round costs the drafter's tree and one target pass over it;
- "plain": no drafter; the target keeps the drafter's memory too. Wholly in RAM it loads as llama.cpp loads it by
  default (its repacked weights and kernels: faster for one token, not batch-invariant, so no tree is ever verified);
- "lookup": no drafter model; trees drafted from text already seen (edge/lookup.py), on the batch-invariant kernels.

    tokens/s = tokens(b) / (draft(b) + t(b + tokens(b)))      plain: 1 / t(1)

t(n) is the plan's pass time; tokens(b) and draft(b) are priors fitted to the shipped Qwen2.5-Coder pair's measured
rounds (docs/plan.md, "Choosing a use of the memory"): a pair whose drafter agrees less is priced too high, and
`--budget auto` then decodes plainly round by round, which the "drafter" use can always fall back to.
"""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from edge.offload.expected import ExpectedRate
from edge.offload.machine import gib
from edge.offload.plan import Plan, pass_cost, plan_pair

from edge.budget import prior_tokens
from edge.errors import UserError

if TYPE_CHECKING:
    from edge.models.registry import PairSpec
    from edge.offload.machine import Machine
    from edge.offload.plan import Shape

USES = ("drafter", "plain", "lookup")
BUDGETS = (4, 8, 16, 32, 64)  # the trees a use is priced at (the best is its price)
# Tokens a tree pass yields at budget b: --budget auto's prior (edge.budget.prior_tokens, 1 + 0.85 log2(1 + b)), the
# one prior of both. The real pair (Qwen2.5-Coder-1.5B drafted by its 0.5B) yielded 3.87 tokens a pass at a mean
# budget of 10.3 (from the SSD: the prior says 3.98) and 4.79 at 28 (under a limit: 5.13).
# drafter passes a tree of b nodes costs: DRAFT_FIXED_PASSES + b (the real pair: 0.28 s a round at budget 10 and
# 0.51 s at 28, with a drafter pass of about 13 ms)
DRAFT_FIXED_PASSES = 11
LOOKUP_TOKENS_PER_PASS = 1.15  # lookup alone on chat prompts: 1.0-1.3 tokens a pass (docs/performance.md)
LOOKUP_BUDGET = 8
PRIOR_MARGIN = 1.1  # a use that drafts is chosen over plain decoding only where its prior predicts 10% more


@dataclass(frozen=True)
class Use(ExpectedRate):
    """A use of the memory, priced as a round (ExpectedRate: the plan's one economy)."""

    name: str = "plain"  # one of USES
    plan: Plan | None = None

    def describe(self) -> str:
        target = self.plan.target
        if target.placement == "ssd":
            where = (f"{gib(target.resident_bytes)} of the target resident, {gib(self.plan.ssd_bytes)} read from "
                     "the drive a pass")
        elif target.placement == "gpu":
            where = "the target on the GPU"
        else:
            where = "the target wholly in RAM" + (" on llama.cpp's own kernels" if self.name == "plain" else "")
        how = {"drafter": f"the drafter's trees (budget {self.budget})", "plain": "plain decoding",
               "lookup": f"lookup drafting alone (budget {self.budget})"}[self.name]
        return f"{how}, {where}: {self.tokens_per_s:.3g} tokens/s predicted"

    def as_dict(self) -> dict:
        return {"use": self.name, "budget": self.budget, "tokens_per_pass": round(self.tokens_per_pass, 3),
                "round_s": round(self.round_s, 4), "tokens_per_s": round(self.tokens_per_s, 3),
                "resident_gib": round(self.plan.target.resident_bytes / 2**30, 3),
                "streamed_gib": round(self.plan.ssd_bytes / 2**30, 3), "placement": self.plan.target.placement}


def weigh_uses(pair: PairSpec, target: Shape, drafter: Shape | None, machine: Machine,
               lookup: bool = True, stream: bool = False) -> list[Use]:
    """Every use of the memory that fits here, priced; `lookup`: lookup drafting is allowed; `stream`: the target is
    read from the drive every pass whatever fits (--placement ssd). Raises the plan's UserError where none fits."""
    uses: list[Use] = []
    if drafter is not None:
        with suppress(UserError):
            uses.append(_drafting(pair, target, drafter, machine, stream))
    # the target alone needs the least memory of any use: where it does not fit, its refusal says what it needs
    alone = plan_pair(pair, target, None, machine, stream, plain=True)
    uses.append(Use(0, 1.0, 0.0, alone.one_token.seconds, "plain", alone))
    if lookup:
        with suppress(UserError):
            looked = plan_pair(replace(pair, budget=LOOKUP_BUDGET), target, None, machine, stream)
            verify = pass_cost(looked.target, machine, LOOKUP_BUDGET + 1).seconds
            uses.append(Use(LOOKUP_BUDGET, LOOKUP_TOKENS_PER_PASS, 0.0, verify, "lookup", looked))
    return uses


def _drafting(pair: PairSpec, target: Shape, drafter: Shape, machine: Machine, stream: bool = False) -> Use:
    plan = plan_pair(pair, target, drafter, machine, stream)
    drafter_pass = pass_cost(plan.drafter, machine, 1).seconds
    best: Use | None = None
    for budget in (b for b in BUDGETS if b + 1 <= plan.tree.n_tokens):
        tokens = prior_tokens(budget)
        draft = drafter_pass * (DRAFT_FIXED_PASSES + budget)
        verify = pass_cost(plan.target, machine, budget + max(round(tokens), 1)).seconds
        use = Use(budget, tokens, draft, verify, "drafter", plan)
        if best is None or use.tokens_per_s > best.tokens_per_s:
            best = use
    assert best is not None  # BUDGETS starts below the smallest tree a plan sizes (CAPPED_MIN_TREE)
    return best


def choose(uses: list[Use]) -> Use:
    """The fastest use, where drafting's predicted yield (a prior) beats plain decoding by a margin (PRIOR_MARGIN);
    a tie goes to the one listed first."""
    def score(use: Use) -> tuple[float, int]:
        return use.tokens_per_s / (1.0 if use.name == "plain" else PRIOR_MARGIN), -USES.index(use.name)

    return max(uses, key=score)


def reason(chosen: Use, uses: list[Use]) -> str:
    """One line: the choice and what it was weighed against (where nothing else fits, that)."""
    others = "; ".join(f"{use.name} {use.tokens_per_s:.3g}" for use in uses if use is not chosen)
    return f"{chosen.describe()} ({f'against {others} tokens/s' if others else 'nothing else fits'})"
