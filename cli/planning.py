"""`edge-spec plan`: a pair's shapes (GGUF headers of files already here, else models.toml facts), the machine
(probed or described), and the plan as a table. Nothing is loaded or downloaded."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from cli.loading import model_path
from edge.errors import UserError
from edge.registry import ModelSpec, PairSpec
from edge.sources import cache_dir, source_path
from offload.plan import GIB, Machine, Plan, Shape, parse_machine, plan_pair, probe_here


def make_plan(pair: PairSpec, machine: str | None, models_file: Path) -> Plan:
    target_file = _local_file(pair.target)
    target = model_shape(pair, "target", pair.target, models_file)
    drafter = model_shape(pair, "drafter", pair.drafter, models_file)
    here: Machine = parse_machine(machine) if machine is not None else probe_here(target_file or cache_dir() / "models")
    return plan_pair(pair, target, drafter, here)


def model_shape(pair: PairSpec, role: str, model: ModelSpec, models_file: Path) -> Shape:
    """The model's shape from its file when it is here, else from models.toml facts; never downloads."""
    path = _local_file(model)
    if path is not None:
        return Shape.from_gguf(path)
    if model.facts is not None:
        return Shape.from_facts(model.facts)
    source = source_path(model.source)
    if model.quantize and source is not None and source.is_file():
        raise UserError(f"pair {pair.name}: the {role} is not prepared yet ({model.quantize} of {source.name}); "
                        f"run `edge-spec prepare {pair.name}` first")
    raise UserError(f"pair {pair.name}: the {role} file is not here and {models_file} gives no facts about it; "
                    f"run `edge-spec prepare {pair.name}` (downloads it), or add {role}.size_gb, {role}.layers, "
                    f"{role}.embd, {role}.kv_heads and {role}.head_dim to the pair")


def render_plan(plan: Plan, console: Console) -> None:
    table = Table("", "GiB", "layers", "placement", "GPU layers", "KV GiB", "RAM/VRAM GiB", box=box.SIMPLE_HEAD,
                  pad_edge=False,
                  title=f"plan for {plan.pair}: ctx {plan.ctx}, budget {_budget(plan)}")
    for model in (plan.target, plan.drafter):
        table.add_row(model.role, _gib(model.shape.file_bytes), str(model.shape.n_layers), model.placement,
                      str(model.n_gpu_layers), f"{_gib(model.kv_bytes)} {model.kv_type}",
                      f"{_gib(model.ram_bytes)} / {_gib(model.vram_bytes)}")
    console.print(table)
    one, tree = plan.one_token, plan.tree
    lines = [
        *(f"{model.role}: {model.shape.source} ({model.runtime})" for model in (plan.target, plan.drafter)),
        f"machine: {plan.machine.describe()}",
        f"target pass: 1 token {_seconds(one.seconds)} ({one.bound}), {tree.n_tokens} tokens "
        f"{_seconds(tree.seconds)} ({tree.bound})",
        f"memory: RAM {_gib(plan.target.ram_bytes + plan.drafter.ram_bytes)} GiB, "
        f"VRAM {_gib(plan.target.vram_bytes + plan.drafter.vram_bytes)} GiB, "
        f"read from the drive per pass {_gib(plan.ssd_bytes)} GiB",
        *(f"{role} settings: {_settings(options)}" for role, options in plan.placement().items()),
        *plan.notes,
    ]
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False, markup=False)


def _local_file(model: ModelSpec) -> Path | None:
    path = model_path(model)
    return path if path is not None and path.is_file() else None




def _settings(options: dict) -> str:
    return " ".join(f"{key}={'on' if value is True else 'off' if value is False else value}"
                    for key, value in options.items())


def _budget(plan: Plan) -> str:
    return f"auto (up to {plan.tree.n_tokens - 1})" if plan.budget == "auto" else str(plan.budget)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.2f}"


def _seconds(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
