"""`edge-spec plan` rendered: the plan (models/planning.py) as a table and a few lines."""

from __future__ import annotations

from edge.offload.choice import Use, reason
from edge.offload.expected import ExpectedRate
from edge.offload.plan import GIB, Plan
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def render_plan(plan: Plan, console: Console) -> None:
    table = Table("", "GiB", "layers", "placement", "GPU layers", "KV GiB", "RAM/VRAM GiB", box=box.SIMPLE_HEAD,
                  pad_edge=False,
                  title=escape(f"plan for {plan.pair}: ctx {plan.ctx}, budget {_budget(plan)}"))
    models = [model for model in (plan.target, plan.drafter) if model.placement != "none"]  # none: no drafter loads
    for model in models:
        table.add_row(model.role, _gib(model.shape.file_bytes), str(model.shape.n_layers), model.placement,
                      str(model.n_gpu_layers), f"{_gib(model.kv_bytes)} {model.kv_type}",
                      f"{_gib(model.ram_bytes)} / {_gib(model.vram_bytes)}")
    console.print(table)
    one, tree = plan.one_token, plan.tree
    lines = [
        *(f"{model.role}: {model.shape.source} ({model.runtime})" for model in models),
        f"machine: {plan.machine.describe()}",
        f"target pass: 1 token {_seconds(one.seconds)} ({one.bound}), {tree.n_tokens} tokens "
        f"{_seconds(tree.seconds)} ({tree.bound})",
        f"memory: RAM {_gib(plan.target.ram_bytes + plan.drafter.ram_bytes)} GiB, "
        f"VRAM {_gib(plan.target.vram_bytes + plan.drafter.vram_bytes)} GiB, "
        f"target resident {_gib(plan.target.resident_bytes if plan.target.placement == 'ssd' else 0)} GiB, "
        f"read from the drive per pass {_gib(plan.ssd_bytes)} GiB",
        *(f"{role} settings: {_settings(options)}" for role, options in plan.placement().items()
          if role == "target" or plan.drafter.placement != "none"),
        *plan.notes,
    ]
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False, markup=False)


def render_uses(chosen: Use, uses: list[Use], console: Console) -> None:
    """The uses of the memory weighed (offload/choice.py), and the one chat, generate and serve take by default."""
    table = Table("use", "target resident GiB", "read a pass GiB", "budget", "tokens/pass", "round", "tokens/s",
                  box=box.SIMPLE_HEAD, pad_edge=False, title="uses of the memory (speculate auto)")
    for use in uses:
        resident = use.plan.target.resident_bytes if use.plan.target.placement == "ssd" else \
            use.plan.target.ram_bytes - use.plan.target.kv_bytes
        table.add_row(("* " if use is chosen else "") + use.name, _gib(resident), _gib(use.plan.ssd_bytes),
                      str(use.budget or "-"), f"{use.tokens_per_pass:.2f}", _seconds(use.round_s),
                      f"{use.tokens_per_s:.3g}")
    console.print(table)
    console.print(f"chosen: {reason(chosen, uses)}", soft_wrap=True, highlight=False, markup=False)


def render_rates(source: str, rates: list[ExpectedRate], best: ExpectedRate, console: Console) -> None:
    """plan --acceptance: the expected tokens/s at each budget, and the pick."""
    plain = rates[0].tokens_per_s
    table = Table("budget", "tokens/pass", "draft s/round", "verify s/round", "tokens/s", "vs plain",
                  box=box.SIMPLE_HEAD, pad_edge=False,
                  title=escape(f"expected with the tokens per pass of {source}"))
    for rate in rates:
        table.add_row("plain" if rate.budget == 0 else str(rate.budget), f"{rate.tokens_per_pass:.2f}",
                      f"{rate.draft_s:.3f}", _seconds(rate.verify_s), f"{rate.tokens_per_s:.3g}",
                      f"{rate.tokens_per_s / plain:.2f}x")
    console.print(table)
    choice = "plain decoding" if best.budget == 0 else f"budget {best.budget}"
    console.print(f"the plan would pick {choice}: {best.tokens_per_s:.3g} tokens/s, "
                  f"{best.tokens_per_s / plain:.2f}x plain decoding", highlight=False, markup=False)


def _settings(options: dict) -> str:
    return " ".join(f"{key}={'on' if value is True else 'off' if value is False else value}"
                    for key, value in options.items())


def _budget(plan: Plan) -> str:
    if plan.tree.n_tokens == 1:
        return "none (plain decoding)"
    return f"auto (up to {plan.tree.n_tokens - 1})" if plan.budget == "auto" else str(plan.budget)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.2f}"


def _seconds(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
