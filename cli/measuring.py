"""The commands that measure: bench (plain against speculative decoding), check (batch invariance) and plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from edge.cli.app import app
from edge.cli.options import (
    PLACING,
    ModelArg,
    RawOpt,
    ThreadsOpt,
    load_flags,
    load_pair,
    named,
    sampling_flags,
    user_errors,
    working,
)
from edge.cli.render import err, report, warning
from rich.console import Console
from rich.markup import escape

from edge.options import LoadOptions
from edge.sampling import SamplingConfig


@app.command()
@user_errors
@load_flags("pair", "drafter", "lookup", "ctx", *PLACING, "target_dtype")
@sampling_flags(seed=0)
def bench(
    ctx: typer.Context,
    prompts: Annotated[Path | None, typer.Option(
        help="one prompt per line: text, or a JSON line (one string, or one list of chat messages) (default: the "
             "repo's chat prompts)", show_default=False)] = None,
    budgets: Annotated[str, typer.Option(
        help="comma-separated tree budgets; auto picks one per round")] = "auto,1,16,64,255",
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 128,
    accept: Annotated[str, typer.Option(
        help="acceptance rules to compare when sampling, comma-separated: match, residual, coupled, auto")] = "auto",
    raw: RawOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    drafters: Annotated[str | None, typer.Option(
        help="drafters to compare, comma-separated: llama_cpp, onnx, onnx:K (K-token head), each with an optional "
             "@QUANT (its file requantized, e.g. llama_cpp@q4_0) and +lookup (lookup's branches too), or lookup "
             "alone; default: the pair's drafter, with lookup unless --lookup off",
        show_default=False)] = None,
    methods: Annotated[str, typer.Option(help="plain, chain (one draft token per drafter pass), tree")] = "plain,tree",
    plot: Annotated[Path | None, typer.Option(help="write a PNG: tokens/s and tokens per pass against the budget",
                                              show_default=False)] = None,
    *,
    sampling: SamplingConfig,
    load: LoadOptions,
) -> None:
    """Plain decoding vs chain and tree speculation on the same prompts, the same placement, in one run."""
    from edge.cli.benchmark import parse_accepts, parse_budgets, parse_drafters, parse_methods, pyplot, render_table
    from edge.cli.benchmark import plot as plot_result
    from edge.models.bench import read_prompts, run_bench

    if plot is not None:
        pyplot()  # a missing matplotlib is said now, not after the whole run
    drafter_list = parse_drafters(drafters)
    budget_list = parse_budgets(budgets)
    method_list = parse_methods(methods)
    accept_list = parse_accepts(accept)
    prompt_list = read_prompts(prompts)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("bench: prompts x rows"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with load_pair(load) as loaded, \
            Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        loaded.fit_budget(max((b for b in budget_list if b != "auto"), default=1))  # a 1025-node batch for 1024
        task = bar.add_task("bench", total=None)
        result = run_bench(loaded, prompt_list, budget_list, max_tokens, sampling, raw, report, drafter_list,
                           tuple(method_list), lambda done, total: bar.update(task, completed=done, total=total),
                           accept_list)
    result["readahead"] = load.readahead if load.placement == "ssd" else None
    if as_json:  # the figures first: a plot that cannot be written loses nothing
        print(json.dumps(result, indent=2))
    else:
        render_table(result, Console())
    if plot is not None:
        plot_result(result, plot)


@app.command()
@user_errors
def check(
    ctx: typer.Context,
    model: ModelArg = None,
    kv_type: Annotated[str, typer.Option("--kv-type", help="KV cache type to check")] = "bf16",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    threads: ThreadsOpt = None,
    gpu_layers: Annotated[int, typer.Option(
        "--gpu-layers", help="target layers on the GPU for the check (all of them: its layer count + 1)")] = 0,
    lanes: Annotated[bool, typer.Option(
        "--lanes/--no-lanes", help="also check several requests in one pass, as serve --parallel runs them (the "
                                   "slowest part on a software GPU)")] = True,
) -> None:
    """Measure whether a model's target is batch-invariant here (the condition for bit-exact lossless
    speculation)."""
    from edge.models.checking import run_check
    from edge.models.opening import materialize
    from edge.models.planning import unused_gpu

    if (unused := unused_gpu()) is not None:
        warning(unused)
    with working("preparing the target") as said:
        target = materialize(named(ctx, model)[0].target, said)
    with working(f"checking {target.name} under tree batching") as said:
        result = run_check(target, kv_type, threads, said, gpu_layers, lanes)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    from rich.table import Table

    table = Table("tree", "nodes", "nodes checked", "max |logit diff|", "argmax differences",
                  title=escape(f"{target.name}, {kv_type} KV, on {result['backend']}"
                               + (f" ({gpu_layers} layers on the GPU)" if gpu_layers else "")
                               + f": {'bit-exact' if result['bit_exact'] else 'NOT bit-exact'}"))
    for row in result["shapes"]:
        table.add_row(row["shape"], str(row["nodes"]), str(row["nodes_checked"]), f"{row['max_abs_diff']:.4g}",
                      str(row["argmax_differences"]))
    Console().print(table)


@app.command()
@user_errors
@load_flags("drafter", "ctx", pair=ModelArg, placement=Annotated[str, typer.Option(
    help="ram: the target where it fits (RAM, else streamed from the drive); ssd: streamed from its file even where "
         "it would fit, as `--placement ssd` runs it")])
def plan(
    ctx: typer.Context,
    machine: Annotated[str | None, typer.Option(
        help="plan for a described machine instead of this one: ram=32G,vram=24G,disk=3GB/s (optional: cores=N, "
             "pcie=25GB/s, rambw=20GB/s)", show_default=False)] = None,
    acceptance: Annotated[Path | None, typer.Option(
        help="a bench JSON (edge-spec bench --json): print the tokens/s expected at each of its tree budgets from "
             "its tokens per pass and this plan's pass times, and the budget the plan would pick",
        show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    *,
    load: LoadOptions,
) -> None:
    """Where each part of a pair goes (GPU, RAM, SSD) and what a target pass costs; loads and downloads nothing."""
    from dataclasses import replace

    from edge.cli.planning import render_plan, render_rates, render_uses
    from edge.models.loading import resolve_spec
    from edge.models.planning import backend_line, make_choice, make_plan, unused_gpu
    from edge.offload.choice import reason
    from edge.offload.expected import expected_rates, pick, read_acceptance

    from edge.errors import UserError

    spec, models_file = resolve_spec(load)
    if (unused := unused_gpu()) is not None:
        warning(unused)
    measured = read_acceptance(acceptance) if acceptance is not None else None
    # the uses of the memory the plan weighs where the pair is left to choose (chat, generate and serve's default)
    choice = make_choice(spec, machine, models_file, load.lookup_drafts, stream=load.placement == "ssd") \
        if load.drafter_model else None
    try:
        result = make_plan(spec, machine, models_file, stream=load.placement == "ssd", drafts=load.drafter_model)
    except UserError as refusal:
        if choice is None:
            raise
        # the pair as named does not fit, a use without its drafter does: that is the plan `auto` applies
        result = replace(choice[0].plan, notes=(f"with its drafter it cannot run here ({refusal}); --speculate "
                                                f"auto runs it as planned here", *choice[0].plan.notes))
    rates = expected_rates(result, measured) if measured is not None else None
    # this machine's plan: what the installed llama.cpp can run the target's layers on (a described one's: unknown)
    backend = backend_line() if machine is None else None
    if as_json:
        out = result.as_dict()
        out["backend"] = backend
        if choice is not None:
            out["uses"] = {"chosen": choice[0].name, "reason": reason(*choice),
                           "weighed": [use.as_dict() for use in choice[1]]}
        if measured is not None and rates is not None:
            out["acceptance"] = {"file": str(acceptance), "measured_on": measured.source,
                                 "rates": [rate.as_dict() for rate in rates], "pick": pick(rates).budget}
        print(json.dumps(out, indent=2))
        return
    render_plan(result, Console())
    if backend is not None:
        Console().print(f"llama.cpp runs layers on: {backend}", soft_wrap=True, highlight=False, markup=False)
    if choice is not None:
        render_uses(*choice, Console())
    if measured is not None and rates is not None:
        render_rates(measured.source, rates, pick(rates), Console())
