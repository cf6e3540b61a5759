"""The `edge-spec` command. Every command works with no arguments on the default pair."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from cli.render import err, error, note, reply_stats, report, warning
from edge.errors import UserError
from edge.options import MIN_CTX, LoadOptions
from models.registry import Registry, load_registry

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Run models larger than your memory at interactive speed: lossless tree speculative decoding.",
)
F = TypeVar("F", bound=Callable[..., Any])


def _help_without_type_labels() -> None:
    """--help without typer's <int> / <bool> / <str> beside every option: a flag takes no value, and the option's
    name and help say what the others take (as llama-cli's and ollama's help read)."""
    from typer import core

    for kind in (getattr(core, "TyperOption", None), getattr(core, "TyperArgument", None)):
        if kind is not None and hasattr(kind, "display_type_rich"):
            kind.display_type_rich = lambda self, ctx: self.metavar  # None unless an option names its own


_help_without_type_labels()


def user_errors(command: F) -> F:
    """A user's mistake becomes one line on stderr and exit code 1, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except UserError as problem:
            error(str(problem))
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def registry(ctx: typer.Context) -> Registry:
    return load_registry(ctx.obj)


@app.callback()
def main_options(
    ctx: typer.Context,
    models: Annotated[Path | None, typer.Option("--models", help="models.toml to use (default: the packaged one)",
                                                 show_default=False)] = None,
    version: Annotated[bool, typer.Option("--version", help="print edge-spec's version and exit",
                                          callback=lambda shown: _print_version(shown), is_eager=True)] = False,
) -> None:
    ctx.obj = models


def _print_version(asked: bool) -> None:
    if not asked:
        return
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        print(f"edge-spec {installed('edge-spec')}")
    except PackageNotFoundError:
        print("edge-spec (not installed as a package)")
    raise typer.Exit(0)


# Options shared by chat, generate and bench.
MODEL_HELP = ("a pair of models.toml (`edge-spec models`), a GGUF file, or a Hugging Face user/repo:QUANT "
              "(default: the default pair)")
PairOpt = Annotated[str | None, typer.Option("--model", "-m", "--pair", help=MODEL_HELP, show_default=False)]
ModelArg = Annotated[str | None, typer.Argument(help=MODEL_HELP, show_default=False, metavar="MODEL")]
TargetOpt = Annotated[Path | None, typer.Option(help="target GGUF file (the same as naming it as the model)",
                                                show_default=False)]
DrafterOpt = Annotated[str | None, typer.Option(
    help="the drafter, for a model that is not a pair: a GGUF file or Hugging Face user/repo:QUANT (default: the "
         "model drafts for itself, on ONNX Runtime where it can)", show_default=False)]
BudgetOpt = Annotated[str | None, typer.Option(
    help="draft tree size in nodes, or auto: the fastest for this machine, chosen as the text goes (default: the "
         "pair's, auto unless models.toml says)", show_default=False)]
AcceptOpt = Annotated[str, typer.Option(
    help="how a sampled reply accepts draft tokens: match (sample-and-match: a seed gives --no-spec's exact text), "
         "residual (drafts drawn from the drafter's distribution, accepted with probability min(1, p/q): more tokens "
         "per pass when sampling), or auto (the one measured to yield more); greedy decoding is the same with all")]
PlacementOpt = Annotated[str, typer.Option(
    help="where the target's weights live: ram, or ssd (mmap'd and read from the disk every pass, as for a model "
         "larger than RAM)")]
ReadaheadOpt = Annotated[bool, typer.Option(
    "--readahead/--no-readahead", help="ssd: read the next pass's weights while the drafter works")]
MlockOpt = Annotated[bool, typer.Option("--mlock", help="lock the target's weights in RAM")]
TargetDtypeOpt = Annotated[str | None, typer.Option(
    "--target-dtype", help="rewrite the target with llama.cpp's quantizer first (cached): f16, f32, bf16, q8_0, q4_0, "
    "or as-is (the source file); default: models.toml's", show_default=False)]
CtxOpt = Annotated[int | None, typer.Option("--ctx", help="context size in tokens (default: the pair's)",
                                            show_default=False)]
TempOpt = Annotated[float, typer.Option(help="0 = greedy")]
TopKOpt = Annotated[int, typer.Option(help="0 = off")]
TopPOpt = Annotated[float, typer.Option()]
MinPOpt = Annotated[float, typer.Option()]
RepeatOpt = Annotated[float, typer.Option(help="1 = off")]
SeedOpt = Annotated[int | None, typer.Option(show_default=False)]
ChatSamplingOpt = Annotated[float | None, typer.Option(
    help="default: the model's recommended sampling (its GGUF's general.sampling.*), else llama.cpp's",
    show_default=False)]
ThreadsOpt = Annotated[int | None, typer.Option(
    help="CPU threads (default: all cores; the drafter one fewer while an SSD target is read ahead)",
    show_default=False)]
ProviderOpt = Annotated[str | None, typer.Option(
    help="onnxruntime execution provider for ONNX models: cpu, cuda, directml, openvino, qnn (default: models.toml)",
    show_default=False)]
GpuOpt = Annotated[int | None, typer.Option(
    "--gpu-layers", help="target layers to place on a GPU (default: `edge-spec plan`'s, when a GPU is visible)",
    show_default=False)]
NoSpecOpt = Annotated[bool, typer.Option("--no-spec", help="decode with the target alone (the reference)")]
RawOpt = Annotated[bool, typer.Option("--raw", help="complete the prompt as-is, without the chat template")]


def sampling_config(temperature: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
                    seed: int | None):
    from edge.sampling import SamplingConfig

    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=seed)


def read_stdin() -> str:
    try:
        return sys.stdin.read()
    except UnicodeDecodeError as problem:
        raise UserError(f"standard input is not UTF-8 text (byte {problem.start}); convert it (iconv)") from None


def named(command: typer.Context, model: str | None, drafter: str | None = None):
    """The pair a MODEL argument names (a pair of models.toml, a GGUF file, a Hugging Face reference; a file's
    drafter, if given), and the models.toml it came from."""
    from models.pair import resolve_spec

    return resolve_spec(LoadOptions(models_file=command.obj, pair=model, drafter=drafter))


def load(command: typer.Context, **options: Any):
    """The pair the command's flags name (LoadOptions' fields), loaded where the plan puts it."""
    return load_pair(LoadOptions(models_file=command.obj, **options))


@contextmanager
def working(what: str) -> Iterator[Callable[[str], None]]:
    """A spinner saying what is happening, on a terminal; yields the reporter of progress lines, which also moves the
    spinner to the step at hand (downloading, assembling, preparing, building a graph, timing passes)."""
    if not err.is_terminal:
        yield report
        return
    with err.status(escape(what), spinner="dots") as status:

        def said(message: str) -> None:
            report(message)
            status.update(escape(message))

        yield said


def load_pair(options: LoadOptions):
    """Load, with a spinner saying what is happening (on a terminal; elsewhere, progress lines only)."""
    from models.pair import open_pair

    what = options.pair or (options.target and Path(str(options.target)).name) or "the default pair"
    with working(f"loading {what}") as said:
        return open_pair(options, said)


def refuse_base_model(options: LoadOptions, what_to_do: str) -> None:
    """A base model cannot chat: say so from its header, before a load of many seconds."""
    from models.pair import base_model

    name = base_model(options)
    if name is not None:
        raise UserError(f"{name} has no chat template (a base model): {what_to_do}")


@app.command()
@user_errors
def generate(
    ctx: typer.Context,
    prompt: Annotated[str, typer.Argument(help="the prompt ('-' reads stdin)")],
    pair: PairOpt = None,
    target: TargetOpt = None,
    drafter: DrafterOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 256,
    temperature: TempOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    min_p: MinPOpt = 0.0,
    repeat_penalty: RepeatOpt = 1.0,
    seed: SeedOpt = None,
    budget: BudgetOpt = None,
    accept: AcceptOpt = "auto",
    ctx_size: CtxOpt = None,
    no_spec: NoSpecOpt = False,
    raw: RawOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    threads: ThreadsOpt = None,
    provider: ProviderOpt = None,
    gpu_layers: GpuOpt = None,
    placement: PlacementOpt = "ram",
    readahead: ReadaheadOpt = True,
    mlock: MlockOpt = False,
    target_dtype: TargetDtypeOpt = None,
) -> None:
    """Complete one prompt, streaming the text (or one JSON object with --json)."""
    if max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1 (got {max_tokens})")
    sampling = sampling_config(temperature, top_k, top_p, min_p, repeat_penalty, seed)
    text = read_stdin() if prompt == "-" else prompt
    import edge

    options = LoadOptions(models_file=ctx.obj, pair=pair, target=target, drafter=drafter, ctx=ctx_size, budget=budget,
                          accept=accept, threads=threads, gpu_layers=gpu_layers, provider=provider,
                          placement=placement, mlock=mlock,
                          readahead=readahead, target_dtype=target_dtype)
    if not raw:
        refuse_base_model(options, "pass --raw to complete the prompt as-is")
    from cli.repl import interruptible

    with load_pair(options) as loaded, interruptible() as stopped:  # Ctrl-C: stop reading or replying, then exit
        if loaded.lossless_warning and not no_spec:
            warning(loaded.lossless_warning)
        steps = edge.stream_generate(loaded, text, max_tokens=max_tokens, sampling=sampling, speculate=not no_spec,
                                     raw=raw, should_stop=stopped)
        if as_json:
            reply = edge.Generation.from_steps(steps, loaded.lossless_warning)
            print(json.dumps(reply.as_dict()))
            finish = reply.finish_reason
        else:
            for step in steps:
                sys.stdout.write(step.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            finish = step.finish_reason
            reply_stats(step)
    if finish == "interrupted":
        raise typer.Exit(130)  # as a shell reports a command stopped by Ctrl-C


@app.command()
@user_errors
def chat(
    ctx: typer.Context,
    pair: ModelArg = None,
    drafter: DrafterOpt = None,
    system: Annotated[str | None, typer.Option(help="system prompt", show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="most tokens per reply")] = 1024,
    temperature: ChatSamplingOpt = None,
    top_k: Annotated[int | None, typer.Option(help="default: the model's recommended, else 40", show_default=False)
                     ] = None,
    top_p: ChatSamplingOpt = None,
    min_p: ChatSamplingOpt = None,
    repeat_penalty: ChatSamplingOpt = None,
    seed: SeedOpt = None,
    budget: BudgetOpt = None,
    accept: AcceptOpt = "auto",
    ctx_size: CtxOpt = None,
    no_spec: NoSpecOpt = False,
    threads: ThreadsOpt = None,
    provider: ProviderOpt = None,
    gpu_layers: GpuOpt = None,
    placement: PlacementOpt = "ram",
    readahead: ReadaheadOpt = True,
    mlock: MlockOpt = False,
) -> None:
    """Talk to a model. Piped stdin: one prompt per line, replies on stdout. Samples as the model recommends (its
    GGUF's general.sampling.*, else temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); --temperature 0 is greedy."""
    from cli.repl import HISTORY_FILE, greedy_penalty, run_chat
    from models.cache import cache_dir

    if max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1 (got {max_tokens})")
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p,
             "min_p": min_p, "repeat_penalty": repeat_penalty, "seed": seed}
    options = LoadOptions(models_file=ctx.obj, pair=pair, drafter=drafter, ctx=ctx_size, budget=budget,
                          accept=accept, threads=threads, gpu_layers=gpu_layers, provider=provider,
                          placement=placement, mlock=mlock,
                          readahead=readahead)
    refuse_base_model(options, "use `edge-spec generate --raw`")
    with load_pair(options) as loaded:
        if loaded.template is None:
            raise UserError(f"{loaded.name} has no chat template (a base model): use `edge-spec generate --raw`")
        from dataclasses import replace

        if repeat_penalty is None and temperature is not None:  # --temperature 0 alone: generate's greedy text
            given["repeat_penalty"] = greedy_penalty(temperature, loaded.sampling.repeat_penalty)
        sampling = replace(loaded.sampling, **{name: value for name, value in given.items() if value is not None})
        history = os.environ.get("EDGE_SPEC_CHAT_HISTORY") or cache_dir() / HISTORY_FILE
        run_chat(loaded, sampling, system, max_tokens, no_spec, err, Path(history), repeat_penalty is not None)


@app.command()
@user_errors
def serve(
    ctx: typer.Context,
    pair: ModelArg = None,
    target: TargetOpt = None,
    drafter: DrafterOpt = None,
    host: Annotated[str, typer.Option(help="address to listen on; 0.0.0.0: every interface (other machines too)")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on (0: any free port)")] = 8080,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="EDGE_SPEC_API_KEY",
        help="require `Authorization: Bearer KEY` on every /v1 request (or set EDGE_SPEC_API_KEY)",
        show_default=False)] = None,
    cors_origin: Annotated[list[str] | None, typer.Option(
        "--cors-origin", help="let web pages from this origin call the API (repeat; * for any)",
        show_default=False)] = None,
    budget: BudgetOpt = None,
    accept: AcceptOpt = "auto",
    ctx_size: CtxOpt = None,
    no_spec: NoSpecOpt = False,
    threads: ThreadsOpt = None,
    provider: ProviderOpt = None,
    gpu_layers: GpuOpt = None,
    placement: PlacementOpt = "ram",
    readahead: ReadaheadOpt = True,
    mlock: MlockOpt = False,
    target_dtype: TargetDtypeOpt = None,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level: debug, info, warning, error")] = "info",
) -> None:
    """Serve the pair over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions), one generation at
    a time (docs/server.md)."""
    from serve.run import bind, is_loopback, serve, url

    if log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
        raise UserError(f"--log-level must be debug, info, warning or error (got {log_level!r})")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key is empty: give a key, or leave the option out")
    options = LoadOptions(models_file=ctx.obj, pair=pair, target=target, drafter=drafter, ctx=ctx_size, budget=budget,
                          accept=accept, threads=threads, gpu_layers=gpu_layers, provider=provider,
                          placement=placement, mlock=mlock,
                          readahead=readahead, target_dtype=target_dtype)
    sock = bind(host, port)  # a port in use is said before a load of seconds
    try:
        if not is_loopback(host):
            warning(f"listening on {host}: other machines can reach this server"
                    + ("" if api_key else "; anyone who can is able to use it (add --api-key KEY)"))
        with load_pair(options) as loaded:
            if loaded.lossless_warning and not no_spec:
                warning(loaded.lossless_warning)
            if not no_spec and loaded.drafter is not None and loaded.budget == "auto":
                loaded.auto_budget()  # the pass times, measured now (once per machine) rather than in a first request
            base = url(sock, host)
            chat_note = "" if loaded.template is not None else " (a base model: /v1/completions only)"

            def ready() -> None:
                err.print(f"serving {escape(loaded.name)} at {base}/v1{chat_note} · one generation at a time, others "
                          "queue · Ctrl-C stops", soft_wrap=True, highlight=False)

            serve(loaded, sock, api_key=api_key, cors_origins=cors_origin or (), speculate=not no_spec,
                  budget=None, log_level=log_level.lower(), ready=ready)
    finally:
        sock.close()


@app.command()
@user_errors
def models(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """List the pairs in models.toml: their files, sizes, and whether they are here."""
    from models.sources import model_path

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
    from models.sources import cached_files

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
    from models.sources import fetch

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
    from models.pair import materialize

    spec = named(ctx, pair)[0]
    sizes: list[int] = []
    if vocab:
        from models.vocabulary import parse_vocab_sizes

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
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from models.vocabulary import build_vocabs

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


@app.command()
@user_errors
def bench(
    ctx: typer.Context,
    pair: PairOpt = None,
    drafter: DrafterOpt = None,
    prompts: Annotated[Path | None, typer.Option(help="one prompt per line (default: the repo's chat prompts)",
                                                 show_default=False)] = None,
    budgets: Annotated[str, typer.Option(
        help="comma-separated tree budgets; auto picks one per round")] = "auto,1,16,64,255",
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 128,
    temperature: TempOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    min_p: MinPOpt = 0.0,
    accept: Annotated[str, typer.Option(
        help="acceptance rules to compare when sampling, comma-separated: match, residual, auto")] = "auto",
    seed: SeedOpt = 0,
    raw: RawOpt = False,
    ctx_size: CtxOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    threads: ThreadsOpt = None,
    provider: ProviderOpt = None,
    drafters: Annotated[str | None, typer.Option(
        help="drafters to compare, comma-separated: llama_cpp, onnx, onnx:K (K-token head), each with an optional "
             "@QUANT (its file requantized, e.g. llama_cpp@q4_0); default: the pair's",
        show_default=False)] = None,
    methods: Annotated[str, typer.Option(help="plain, chain (one draft token per drafter pass), tree")] = "plain,tree",
    placement: PlacementOpt = "ram",
    readahead: ReadaheadOpt = True,
    mlock: MlockOpt = False,
    target_dtype: TargetDtypeOpt = None,
    plot: Annotated[Path | None, typer.Option(help="write a PNG: tokens/s and tokens per pass against the budget",
                                              show_default=False)] = None,
) -> None:
    """Plain decoding vs chain and tree speculation on the same prompts, the same placement, in one run."""
    from cli.benchmark import parse_accepts, parse_budgets, parse_drafters, parse_methods, pyplot, render_table
    from cli.benchmark import plot as plot_result
    from models.bench import read_prompts, run_bench

    if plot is not None:
        pyplot()  # a missing matplotlib is said now, not after the whole run
    drafter_list = parse_drafters(drafters)
    budget_list = parse_budgets(budgets)
    method_list = parse_methods(methods)
    accept_list = parse_accepts(accept)
    prompt_list = read_prompts(prompts)
    sampling = sampling_config(temperature, top_k, top_p, min_p, 1.0, seed)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("bench: prompts x rows"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with load(ctx, pair=pair, drafter=drafter, ctx=ctx_size, threads=threads, provider=provider, placement=placement,
              mlock=mlock, readahead=readahead, target_dtype=target_dtype) as loaded, \
            Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        loaded.fit_budget(max((b for b in budget_list if b != "auto"), default=1))  # a 1025-node batch for 1024
        task = bar.add_task("bench", total=None)
        result = run_bench(loaded, prompt_list, budget_list, max_tokens, sampling, raw, report, drafter_list,
                           tuple(method_list), lambda done, total: bar.update(task, completed=done, total=total),
                           accept_list)
    result["readahead"] = readahead if placement == "ssd" else None
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
) -> None:
    """Measure whether a model's target is batch-invariant here (the condition for bit-exact lossless
    speculation)."""
    from models.checking import run_check
    from models.pair import materialize
    from models.planning import unused_gpu

    if (unused := unused_gpu()) is not None:
        warning(unused)
    with working("preparing the target") as said:
        target = materialize(named(ctx, model)[0].target, said)
    with working(f"checking {target.name} under tree batching") as said:
        result = run_check(target, kv_type, threads, said)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    from rich.table import Table

    table = Table("tree", "nodes", "nodes checked", "max |logit diff|", "argmax differences",
                  title=escape(f"{target.name}, {kv_type} KV: "
                               f"{'bit-exact' if result['bit_exact'] else 'NOT bit-exact'}"))
    for row in result["shapes"]:
        table.add_row(row["shape"], str(row["nodes"]), str(row["nodes_checked"]), f"{row['max_abs_diff']:.4g}",
                      str(row["argmax_differences"]))
    Console().print(table)


@app.command()
@user_errors
def plan(
    ctx: typer.Context,
    pair: ModelArg = None,
    drafter: DrafterOpt = None,
    machine: Annotated[str | None, typer.Option(
        help="plan for a described machine instead of this one: ram=32G,vram=24G,disk=3GB/s (optional: cores=N, "
             "pcie=25GB/s, rambw=20GB/s)", show_default=False)] = None,
    ctx_size: CtxOpt = None,
    placement: Annotated[str, typer.Option(
        help="ram: the target where it fits (RAM, else streamed from the drive); ssd: streamed from its file even "
             "where it would fit, as `--placement ssd` runs it")] = "ram",
    acceptance: Annotated[Path | None, typer.Option(
        help="a bench JSON (edge-spec bench --json): print the tokens/s expected at each of its tree budgets from "
             "its tokens per pass and this plan's pass times, and the budget the plan would pick",
        show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Where each part of a pair goes (GPU, RAM, SSD) and what a target pass costs; loads and downloads nothing."""
    from dataclasses import replace

    from cli.planning import render_plan, render_rates
    from models.planning import make_plan, unused_gpu
    from offload.expected import expected_rates, pick, read_acceptance

    if ctx_size is not None and ctx_size < MIN_CTX:
        raise UserError(f"--ctx must be at least {MIN_CTX} tokens (got {ctx_size})")
    spec, models_file = named(ctx, pair, drafter)
    if (unused := unused_gpu()) is not None:
        warning(unused)
    if placement not in ("ram", "ssd"):
        raise UserError(f"--placement must be ram or ssd (got {placement!r})")
    measured = read_acceptance(acceptance) if acceptance is not None else None
    result = make_plan(replace(spec, ctx=ctx_size) if ctx_size else spec, machine, models_file,
                       stream=placement == "ssd")
    rates = expected_rates(result, measured) if measured is not None else None
    if as_json:
        out = result.as_dict()
        if measured is not None and rates is not None:
            out["acceptance"] = {"file": str(acceptance), "measured_on": measured.source,
                                 "rates": [rate.as_dict() for rate in rates], "pick": pick(rates).budget}
        print(json.dumps(out, indent=2))
        return
    render_plan(result, Console())
    if measured is not None and rates is not None:
        render_rates(measured.source, rates, pick(rates), Console())


def main() -> None:
    app(prog_name="edge-spec")
