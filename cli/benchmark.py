"""`edge-spec bench`: plain decoding and tree speculation over the same prompts, one run, one JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from edge.errors import UserError
from edge.generate import Decoder, Stats
from edge.grow import GrowConfig
from edge.sampling import SamplingConfig

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "benchmarks" / "chat-prompts.txt"


def parse_budgets(text: str) -> list[int]:
    try:
        budgets = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--budgets takes comma-separated integers, like 1,16,64,255 (got {text!r})") from None
    if not budgets or any(not 1 <= b <= 255 for b in budgets):
        raise UserError(f"--budgets must be between 1 and 255 (got {text!r})")
    return budgets


def read_prompts(path: Path | None) -> list[str]:
    path = path or DEFAULT_PROMPTS
    try:
        prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as error:
        raise UserError(f"cannot read prompts file {path}: {error.strerror}") from None
    if not prompts:
        raise UserError(f"prompts file {path} has no prompts (one per line)")
    return prompts


def run_bench(loaded, prompts: list[str], budgets: list[int], max_tokens: int, sampling: SamplingConfig,
              raw: bool, report) -> dict[str, Any]:
    from cli.main import prompt_for
    from offload.probe import probe_machine

    raw = raw or loaded.template is None
    prompt_tokens = [prompt_for(loaded, prompt, raw) for prompt in prompts]
    rows, reference = [], None
    for method, budget in [("plain", None), *(("tree", b) for b in budgets)]:
        report(f"{method}{'' if budget is None else f' budget {budget}'}: {len(prompts)} prompts")
        grow = GrowConfig.for_budget(budget) if budget else None
        decoder = Decoder(loaded.target, loaded.drafter, grow, sampling)
        total, outputs = Stats(), []
        for tokens in prompt_tokens:
            decoder.set_sampling(sampling)  # the same seed for every method: sampled runs are comparable
            decoder.load(tokens)
            steps = list(decoder.generate(max_tokens))
            outputs.append([s.token for s in steps if s.token is not None and s.finish_reason is None])
            total.add(steps[-1].stats)
        reference = reference or outputs
        rows.append(_row(method, budget, total, outputs == reference))
    return {"pair": loaded.name, "machine": probe_machine(), "prompts": len(prompts), "max_tokens": max_tokens,
            "temperature": sampling.temperature, "lossless_warning": loaded.lossless_warning, "rows": rows}


def _row(method: str, budget: int | None, stats: Stats, matches_plain: bool) -> dict[str, Any]:
    rounds = max(stats.rounds, 1)
    return {
        "method": method,
        "budget": budget or 0,
        "tokens_per_pass": round(stats.tokens_per_pass, 3),
        "draft_s_per_round": round(stats.draft_s / rounds, 5),
        "verify_s_per_round": round(stats.verify_s / rounds, 5),
        "tokens_per_s": round(stats.tokens_per_s, 2),
        "target_passes": stats.target_passes,
        "rounds": stats.rounds,
        "new_tokens": stats.new_tokens,
        "drafter_passes_per_round": round(stats.drafter_passes / rounds, 3),
        "tree_nodes_per_round": round(stats.tree_nodes / rounds, 1),
        "matches_plain": matches_plain,
    }


def render_table(result: dict[str, Any], console: Console) -> None:
    table = Table("method", "budget", "tokens/pass", "draft s/round", "verify s/round", "tokens/s", "passes",
                  "same as plain", title=f"{result['pair']} on {result['machine']['cpu']} "
                  f"({result['prompts']} prompts x {result['max_tokens']} tokens, T={result['temperature']})")
    for row in result["rows"]:
        table.add_row(row["method"], str(row["budget"] or "-"), f"{row['tokens_per_pass']:.2f}",
                      f"{row['draft_s_per_round']:.4f}", f"{row['verify_s_per_round']:.4f}",
                      f"{row['tokens_per_s']:.1f}", str(row["target_passes"]), "yes" if row["matches_plain"] else "NO")
    console.print(table)
