"""`edge-spec plan --acceptance FILE`: the tokens per second a plan expects at each tree budget, and the budget it
would pick, from the tokens per target pass a bench run measured (FILE: `edge-spec bench --json`).

    tokens/s(b) = tokens(b) / (draft(b) + t(b + tokens(b)))        tokens/s(plain) = 1 / t(1)

tokens(b) and draft(b), the drafter's seconds per round, are the bench's; t(n) is the plan's predicted pass time
(offload/plan.py) over the tree's b nodes, its root and the previous round's accepted tokens, which the pass also
carries (as `--budget auto` counts them: offload/tuning.py). The acceptance belongs to the pair the bench ran, so the
prediction is for a target that agrees with its drafter as that pair's did.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from edge.offload.plan import Plan, pass_cost

from edge.errors import Remedy, UserError

BENCH_JSON = Remedy("bench", options=(("json", None),))  # its output, saved to a file, is a bench JSON


@dataclass(frozen=True)
class BenchYield:
    """Tokens per target pass and drafter seconds per round by tree budget, from one bench run."""

    tokens_per_pass: dict[int, float]
    draft_s: dict[int, float]
    source: str  # what ran: pair, placement, sampling


@dataclass(frozen=True)
class ExpectedRate:
    """A round's price, the plan's one economy (offload/choice.py prices the uses of the memory with it too):
    tokens/s = tokens per pass / (drafting + the target's pass), as --budget auto prices a budget (edge/budget.py)."""

    budget: int  # 0: plain decoding
    tokens_per_pass: float
    draft_s: float
    verify_s: float

    @property
    def round_s(self) -> float:
        return self.draft_s + self.verify_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_pass / self.round_s

    def as_dict(self) -> dict:
        return {"budget": self.budget, "tokens_per_pass": round(self.tokens_per_pass, 3),
                "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4),
                "tokens_per_s": round(self.tokens_per_s, 4)}


MAX_BENCH_JSON = 64 << 20  # a bench's JSON is kilobytes; past this it is not one


def read_acceptance(path: Path) -> BenchYield:
    """The tree rows of a bench JSON (`edge-spec bench --json`): for a budget run several times (acceptance rules,
    drafters), the row with the most tokens per pass."""
    what = f"acceptance {path}"  # the option, as each front end words it (UserError.option)
    try:
        if path.exists() and not path.is_file():  # a FIFO or a device would be read forever
            raise UserError(f"{what} is not a regular file; write one with a bench run's JSON output", "acceptance",
                            BENCH_JSON)
        with path.open("rb") as f:
            text = f.read(MAX_BENCH_JSON + 1)
        if len(text) > MAX_BENCH_JSON:
            raise UserError(f"{what} is larger than {MAX_BENCH_JSON >> 20} MiB: not a bench JSON", "acceptance")
        data = json.loads(text.decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what}: no such file; write one with a bench run's JSON output", "acceptance",
                        BENCH_JSON) from None
    except (OSError, ValueError, RecursionError) as problem:  # JSONDecodeError and UnicodeDecodeError among them
        raise UserError(f"{what} is not a bench JSON ({problem}); write one with a bench run's JSON output",
                        "acceptance", BENCH_JSON) from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise UserError(f"{what} has no \"rows\": not a bench run's JSON output", "acceptance", BENCH_JSON)
    best: dict[int, dict] = {}
    for row in rows:
        if not isinstance(row, dict) or row.get("method") != "tree" or isinstance(row.get("budget"), bool) \
                or not isinstance(row.get("budget"), int):
            continue  # plain decoding, chains, and `auto` (no single budget)
        if not all(isinstance(row.get(key), int | float) for key in ("tokens_per_pass", "draft_s_per_round")):
            raise UserError(f"{what}: the tree row of budget {row['budget']} lacks tokens_per_pass or "
                            "draft_s_per_round; run the bench again", "acceptance")
        if row["budget"] not in best or row["tokens_per_pass"] > best[row["budget"]]["tokens_per_pass"]:
            best[row["budget"]] = row
    if not best:
        raise UserError(f"{what} has no tree rows with a fixed budget; run a bench with fixed budgets", "acceptance",
                        Remedy("bench", options=(("budgets", "16,64,255"), ("json", None))))
    source = (f"{data.get('pair')} ({data.get('target')}, placement {data.get('placement')}, "
              f"{data.get('sampling') or 'T=' + str(data.get('temperature'))})")
    return BenchYield({b: float(r["tokens_per_pass"]) for b, r in sorted(best.items())},
                      {b: float(r["draft_s_per_round"]) for b, r in sorted(best.items())}, source)


def expected_rates(plan: Plan, acceptance: BenchYield) -> list[ExpectedRate]:
    """Plain decoding first, then each budget of `acceptance`, with the plan's pass times."""
    rows = [ExpectedRate(0, 1.0, 0.0, plan.one_token.seconds)]
    for budget, tokens in acceptance.tokens_per_pass.items():
        verify = pass_cost(plan.target, plan.machine, budget + max(round(tokens), 1)).seconds
        rows.append(ExpectedRate(budget, tokens, acceptance.draft_s[budget], verify))
    return rows


def pick(rates: list[ExpectedRate]) -> ExpectedRate:
    """The fastest: plain decoding where no tree beats it."""
    return max(rates, key=lambda rate: (rate.tokens_per_s, -rate.budget))
