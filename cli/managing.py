"""The commands that manage model files: models (list the pairs), rm, pull and prepare."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from edge.cli.app import app
from edge.cli.options import MODEL_HELP, ModelArg, ThreadsOpt, load, named, user_errors, working
from edge.cli.render import err, note
from edge.models.registry import Registry, load_registry
from rich.console import Console
from rich.markup import escape

from edge.errors import UserError


def registry(ctx: typer.Context) -> Registry:
    return load_registry(ctx.obj)


@app.command()
@user_errors
def models(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """List the pairs in models.toml: their files, sizes, and whether they are here."""
    from edge.models.sources import model_path

    reg = registry(ctx)
    listing = {}
    for name, spec in reg.pairs.items():
        entry: dict[str, Any] = {"about": spec.about, "default": name == reg.default}
        for role, model in (("target", spec.target), ("drafter", spec.drafter)):
            path = model_path(model)
            present = bool(path and path.is_file())
            entry[role] = {"source": model.source.describe(), "quantize": model.quantize, "kv_type": model.kv_type,
                           "path": str(path) if path else None, "present": present,
                           "size_bytes": path.stat().st_size if present and path else None,
                           "size_gb": model.facts.size_gb if model.facts else None}
        listing[name] = entry
    if as_json:
        print(json.dumps(listing, indent=2))
        return
    from rich.table import Table

    table = Table("pair", "here", "size", "files", title=escape(f"pairs in {reg.path}"), title_justify="left",
                  box=None, padding=(0, 1), show_edge=False)
    table.columns[0].overflow = table.columns[3].overflow = "fold"
    for name, entry in listing.items():
        spec = reg.pairs[name]
        target, drafter = entry["target"], entry["drafter"]
        here = "yes" if target["present"] and drafter["present"] else "no"
        same = spec.drafter.source == spec.target.source and spec.drafter.quantize == spec.target.quantize
        roles = [target] if same else [target, drafter]
        sizes = [role["size_bytes"] / 1e9 if role["size_bytes"] else role["size_gb"] for role in roles]
        size = "?" if None in sizes else f"{sum(sizes):.2f} GB"
        lines = [f"target  {_short_source(spec.target)}",
                 f"drafter {'the same file' if same else _short_source(spec.drafter)}"]
        table.add_row(escape(f"{name} (default)" if entry["default"] else name), here, size,
                      escape("\n".join(lines)) + f"\n[dim]{escape(entry['about'])}[/]")
        table.add_row()
    Console().print(table)


def _short_source(model: Any) -> str:
    """Where a model's file comes from, in a few words: its path, hf.co/REPO:QUANT, or its file from PyPI."""
    source = model.source
    if source.path is not None:
        text = str(source.path)
    elif source.hf is not None:
        text = f"hf.co/{source.hf}"
    else:
        name = source.name or Path(source.files[-1]).name
        more = f" and {len(source.pypi) - 1} more wheels" if len(source.pypi) > 1 else ""
        text = f"{name} (PyPI {source.pypi[0]}{more})"
    return text + (f", as {model.quantize}" if model.quantize else "")


@app.command()
@user_errors
def rm(ctx: typer.Context,
       model: Annotated[str, typer.Argument(help=MODEL_HELP, show_default=False, metavar="MODEL")]) -> None:
    """Remove a model's files from the cache: its download and what was prepared from it (requantized copies,
    vocabularies, ONNX graphs). Pairs that share them fetch or build them again when next used."""
    from edge.models.sources import cached_files

    spec = named(ctx, model)[0]
    removed, freed = 0, 0
    for source in dict.fromkeys([spec.target.source, spec.drafter.source]):
        files, kept = cached_files(source)
        for path in files:
            size = path.stat().st_size
            path.unlink(missing_ok=True)
            removed, freed = removed + 1, freed + size
            print(f"removed {path}")
        if kept:
            note(kept)
    print(f"{spec.name}: {removed} files removed, {freed / 1e9:.2f} GB freed" if removed else
          f"{spec.name}: nothing of it is in the cache")


@app.command()
@user_errors
def pull(ctx: typer.Context, pair: ModelArg = None) -> None:
    """Download a model's files (verified by sha256) into the cache."""
    from edge.models.sources import fetch

    spec = named(ctx, pair)[0]
    for role, model in (("target", spec.target), ("drafter", spec.drafter)):
        with working(f"fetching the {role}") as said:
            path = fetch(model.source, said)
        print(f"{role}: {path}")


@app.command()
@user_errors
def prepare(
    ctx: typer.Context,
    pair: ModelArg = None,
    vocab: Annotated[list[str] | None, typer.Option(
        help="also build a frequency-ranked vocabulary of K tokens (repeat, or comma-separate: 8192,16384)",
        metavar="K", show_default=False)] = None,
    prompts: Annotated[Path | None, typer.Option(
        help="calibration prompts, one per line (default: the packaged chat or text set)", show_default=False)] = None,
    calibration_tokens: Annotated[int | None, typer.Option(
        help="tokens the target generates per calibration prompt (default: 128)", show_default=False)] = None,
    threads: ThreadsOpt = None,
) -> None:
    """Download a model and build its prepared files (requantized target / drafter, --vocab vocabularies)."""
    from edge.models.opening import materialize

    spec = named(ctx, pair)[0]
    sizes: list[int] = []
    if vocab:
        from edge.models.vocabulary import parse_vocab_sizes

        sizes = parse_vocab_sizes(vocab)
    elif prompts is not None or calibration_tokens is not None:
        raise UserError("--prompts and --calibration-tokens apply to a vocabulary: add --vocab K")
    n_tokens = 128 if calibration_tokens is None else calibration_tokens
    if n_tokens < 1:
        raise UserError(f"--calibration-tokens must be at least 1 (got {n_tokens})")
    for role, model in (("target", spec.target), ("drafter", spec.drafter)):
        with working(f"preparing the {role}") as said:
            prepared = materialize(model, said)
        print(f"{role}: {prepared}")
    if sizes:
        from edge.models.vocabulary import build_vocabs
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn("calibrating {task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn())
        with load(ctx, pair=pair, threads=threads, gpu_layers=0) as loaded, \
                Progress(*columns, console=err) as progress:
            task = progress.add_task(f"{loaded.name} ({n_tokens} tokens per prompt)", total=None)
            built_vocabs = build_vocabs(loaded, spec.target, sizes, prompts, n_tokens,
                                        lambda done, total: progress.update(task, completed=done, total=total))
        for built in built_vocabs:
            print(f"vocab {built.k}: {built.path} (coverage {built.coverage:.2%} of {built.counted} "
                  f"calibration tokens, {built.distinct} distinct)")
