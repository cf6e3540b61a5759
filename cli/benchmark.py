"""`edge-spec bench` on the command line: its flags parsed, its result (models/bench.py) as a table or a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edge.models.bench import LOOKUP, METHODS, DrafterChoice
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from edge.errors import UserError
from edge.options import MAX_BUDGET


def parse_budgets(text: str) -> list[int | str]:
    """'auto,1,16,64' -> ["auto", 1, 16, 64]."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    try:
        budgets = [part if part == "auto" else int(part) for part in parts]
    except ValueError:
        raise UserError(f"--budgets takes comma-separated integers or auto, like auto,1,16,64,255 (got {text!r})"
                        ) from None
    if not budgets or any(b != "auto" and not 1 <= b <= MAX_BUDGET for b in budgets):
        raise UserError(f"--budgets must be auto or between 1 and {MAX_BUDGET} (got {text!r})")
    return budgets


def parse_methods(text: str) -> list[str]:
    methods = [part.strip() for part in text.split(",") if part.strip()]
    if not methods or any(m not in METHODS for m in methods):
        raise UserError(f"--methods takes {', '.join(METHODS)}, comma-separated (got {text!r})")
    return methods


def parse_accepts(text: str) -> tuple[str, ...]:
    from edge.options import ACCEPT_RULES

    accepts = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not accepts or any(a not in ACCEPT_RULES for a in accepts):
        raise UserError(f"--accept takes {', '.join(ACCEPT_RULES)}, comma-separated (got {text!r})")
    return accepts


def method_label(row: dict[str, Any], result: dict[str, Any]) -> str:
    """The row's method, with its acceptance rule where the run compared rules and its drafter where it compared
    drafters."""
    label = row["method"]
    if row.get("accept") and len({r.get("accept") for r in result["rows"] if r["method"] != "plain"}) > 1:
        label += f" {row['accept']}"
    return label if len(result.get("drafters", [])) < 2 else f"{label} ({row['drafter']})"


def parse_drafters(text: str | None) -> list[DrafterChoice] | None:
    """'llama_cpp,onnx:32768,llama_cpp@q4_0,lookup,onnx+lookup' -> drafters to compare: a runtime, a trimmed head
    (onnx:K), a requantization of the pair's drafter file (@QUANT), lookup alone, and any of them with lookup."""
    from edge.models.registry import FTYPES, names, traits

    if text is None:
        return None
    runtimes = names()
    trimming = [name for name in runtimes if traits(name).trims_head]
    choices = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part == LOOKUP:
            choices.append(DrafterChoice(None, lookup=True))
            continue
        model, plus, looked = part.partition("+")
        if plus and looked != LOOKUP:
            raise UserError(f"--drafters: a drafter joins lookup as NAME+lookup (got {part!r})")
        head, _, quantize = model.partition("@")
        runtime, _, vocab = head.partition(":")
        if (runtime not in runtimes or (vocab and (runtime not in trimming or not vocab.isdigit()))
                or ("@" in part and quantize not in FTYPES)):
            raise UserError(f"--drafters takes {', '.join(runtimes)}, or {' or '.join(trimming)}:K (a vocabulary "
                            f"size), each optionally with @QUANT (the drafter requantized: {', '.join(FTYPES)}) and "
                            f"+lookup (lookup's branches in its trees too), or lookup (alone), comma-separated (got "
                            f"{part!r})")
        choices.append(DrafterChoice(runtime, int(vocab) if vocab else None, quantize or None, lookup=bool(plus)))
    if not choices:
        raise UserError("--drafters is empty")
    return choices


def render_table(result: dict[str, Any], console: Console) -> None:
    table = Table("method", "drafter", "budget", "tokens/pass", "draft s/round", "verify s/round", "tokens/s",
                  "speedup", "MB read/pass", "passes", "same as plain",
                  title=escape(f"{result['pair']} ({result.get('target')}, placement {result.get('placement')}) on "
                  f"{result['machine']['cpu']} ({result['prompts']} prompts x {result['max_tokens']} tokens, "
                  f"{result.get('sampling') or 'T=' + str(result['temperature'])})"))
    for row in result["rows"]:
        budget = str(row["budget"] or "-")
        if row["budget"] == "auto":
            budget += f" (mean {row['mean_budget']:g}, {row['plain_rounds']} plain rounds)"
        read = row.get("bytes_read_per_pass")
        same = {True: "yes", False: "NO", None: "n/a (sampled)"}[row["matches_plain"]]
        table.add_row(method_label(row, result), row.get("drafter", "-"), budget, f"{row['tokens_per_pass']:.2f}",
                      f"{row['draft_s_per_round']:.4f}", f"{row['verify_s_per_round']:.4f}",
                      f"{row['tokens_per_s']:.1f}", f"{row.get('speedup', 1.0):.2f}x",
                      "-" if read is None else f"{read / 1e6:.1f}", str(row["target_passes"]),
                      same)
    console.print(table)
    for runtime, times in result.get("target_pass_ms", {}).items():
        console.print(f"target pass, {runtime}: " + " · ".join(f"{n} tokens {ms:.1f} ms" for n, ms in times.items()))
    for info in result.get("drafters", []):
        expand = " · ".join(f"{n} nodes {ms:.1f} ms" for n, ms in info["expand_ms"].items())
        console.print(f"drafter {info['drafter']}: expand {expand} · KV {info['kv_bytes_per_token']:.0f} B/token")


def pyplot() -> Any:
    """matplotlib's pyplot on a file backend, or one line saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'edge-spec[plot]' (or pip install matplotlib)") from None
    return plt


def plot(result: dict[str, Any], path: Path) -> None:
    """tokens/s and tokens per pass against the budget, one line per method (and drafter); plain decoding as a line
    across, `auto` as a star at the mean budget it chose. Both axes start at 0; budgets are labelled as numbers."""
    plt = pyplot()
    from matplotlib.ticker import FixedLocator, ScalarFormatter

    figure, (speed, per_pass) = plt.subplots(1, 2, figsize=(11, 4.2))
    plain = next(r for r in result["rows"] if r["method"] == "plain")
    lines: dict[str, list[dict]] = {}
    for row in result["rows"]:
        if row["method"] != "plain":
            label = method_label(row, result)
            lines.setdefault(label, []).append(row)
    for label, rows in lines.items():
        fixed = sorted((r for r in rows if r["budget"] != "auto"), key=lambda r: r["budget"])
        if fixed:
            budgets = [r["budget"] for r in fixed]
            speed.plot(budgets, [r["tokens_per_s"] for r in fixed], marker="o", label=label)
            per_pass.plot(budgets, [r["tokens_per_pass"] for r in fixed], marker="o", label=label)
        for row in rows:
            if row["budget"] == "auto":
                at = max(row["mean_budget"], 1)
                speed.scatter([at], [row["tokens_per_s"]], marker="*", s=160, zorder=3,
                              label=f"{label}, auto (mean budget {row['mean_budget']:g})")
                per_pass.scatter([at], [row["tokens_per_pass"]], marker="*", s=160, zorder=3)
    speed.axhline(plain["tokens_per_s"], color="black", linestyle="--", linewidth=1.5, zorder=4,
                  label=f"plain decoding ({plain['tokens_per_s']:.1f} tok/s)")
    per_pass.axhline(plain["tokens_per_pass"], color="black", linestyle="--", linewidth=1.5, zorder=4)
    budgets = sorted({max(r["budget"] if r["budget"] != "auto" else r["mean_budget"], 1) for r in result["rows"]
                      if r["method"] != "plain"} or {1})
    axes = ((speed, "tokens/s", "tokens_per_s"), (per_pass, "tokens per target pass", "tokens_per_pass"))
    for axis, name, key in axes:
        axis.set_xscale("log", base=2)
        axis.xaxis.set_major_locator(FixedLocator(budgets))
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.xaxis.set_minor_locator(FixedLocator([]))
        axis.set_xlabel("tree budget (draft nodes; auto at the mean it chose)")
        axis.set_ylabel(name)
        axis.set_ylim(0, 1.12 * max(r[key] for r in result["rows"]))  # from 0, the plain line below the top edge
        axis.grid(alpha=0.3)
    speed.legend(fontsize=8)
    figure.suptitle(f"{result['pair']} · {result.get('target')} · placement {result.get('placement')} · "
                    f"{result['machine']['cpu']}, {result['machine']['cores']} cores", fontsize=10)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=110)
    except OSError as error:
        raise UserError(f"cannot write the plot to {path}: {error.strerror}") from None
    finally:
        plt.close(figure)
