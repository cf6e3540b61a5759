"""What the commands share: their option types (the Annotated aliases), one-line user errors, and the helpers that
read the prompt, name a pair and load it behind a spinner."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from edge.cli.render import Working, err, error, report, worded

from edge.errors import UserError
from edge.options import LoadOptions

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(command: F) -> F:
    """A user's mistake becomes one line on stderr and exit code 1, never a traceback; a Ctrl-C that stops a command
    (one loading its models, say), "(interrupted)" and exit code 130, as a shell reports a command it stopped."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except UserError as problem:
            error(worded(problem))
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("(interrupted)")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


# Options shared by the commands (chat, generate, serve, bench, prepare, check, plan).
MODEL_HELP = ("a pair of models.toml (`edge-spec models`), a GGUF file, or a Hugging Face user/repo:QUANT "
              "(default: the default pair)")
PairOpt = Annotated[str | None, typer.Option("--model", "-m", "--pair", help=MODEL_HELP, show_default=False)]
ModelArg = Annotated[str | None, typer.Argument(help=MODEL_HELP, show_default=False, metavar="MODEL")]
TargetOpt = Annotated[Path | None, typer.Option(help="target GGUF file (the same as naming it as the model)",
                                                show_default=False)]
DrafterOpt = Annotated[str | None, typer.Option(
    help="the drafter, for a model that is not a pair: a GGUF file or Hugging Face user/repo:QUANT (default: the "
         "model drafts for itself, on ONNX Runtime where it can); with any model, lookup: no drafter model, drafting "
         "by lookup alone (none: the same, or plain decoding with --lookup off)", show_default=False)]
LookupOpt = Annotated[str, typer.Option(
    help="drafting by lookup: continuations of the text found earlier in the prompt, the conversation and past "
         "replies, merged into the drafter's tree; on, off, or keep (past replies kept across runs, in the cache)")]
BudgetOpt = Annotated[str | None, typer.Option(
    help="draft tree size in nodes, or auto: the fastest for this machine, chosen as the text goes (default: the "
         "pair's, auto unless models.toml says)", show_default=False)]
AcceptOpt = Annotated[str, typer.Option(
    help="how a sampled reply accepts draft tokens: auto (residual or coupled, whichever yields more tokens a pass "
         "here, measured as the text goes), coupled (the target samples by noise fixed by "
         "each token's position, which the drafter ranks its drafts on: most tokens per pass with a smaller drafter), "
         "residual (drafts drawn from the drafter's distribution, accepted with probability min(1, p/q): most with a "
         "drafter nearly its target) or match (sample-and-match); under match and coupled a seed gives --no-spec's "
         "exact text; greedy decoding is the same with all")]
PlacementOpt = Annotated[str, typer.Option(
    help="where the target's weights live: ram, or ssd (mmap'd and read from the disk every pass, as for a model "
         "larger than RAM)")]
ReadaheadOpt = Annotated[bool, typer.Option(
    "--readahead/--no-readahead", help="ssd: read the next pass's weights while the drafter works")]
OverlapOpt = Annotated[str, typer.Option(
    help="the drafter grows the next tree while the target's pass runs: on, off, or auto (on where the target's "
         "layers are on a GPU, leaving the CPU's cores to the drafter)")]
SpeculateOpt = Annotated[str, typer.Option(
    help="auto: with --budget auto, the plan weighs the drafter's memory against the target's and may decode with "
         "the target alone (plainly, on llama.cpp's own kernels where it fits in RAM, or by lookup); on: always load "
         "the pair's drafter")]
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
MAX_INPUT_BYTES = 16 << 20  # a prompt read from standard input, or one line of a piped chat
RECOMMENDED = "default: the model's recommended sampling (its GGUF's general.sampling.*), else llama.cpp's"
ThreadsOpt = Annotated[int | None, typer.Option(
    help="CPU threads (default: all cores; the drafter one fewer while an SSD target is read ahead)",
    show_default=False)]
ProviderOpt = Annotated[str | None, typer.Option(
    help="execution provider for ONNX models: cpu, cuda, directml, openvino (its CPU; openvino-gpu, openvino-npu: "
         "OpenVINO's runtime where onnxruntime lacks it), qnn (default: models.toml)",
    show_default=False)]
GpuOpt = Annotated[int | None, typer.Option(
    "--gpu-layers", help="target layers to place on a GPU (default: `edge-spec plan`'s, when a GPU is visible)",
    show_default=False)]
NoSpecOpt = Annotated[bool, typer.Option("--no-spec", help="decode with the target alone (the reference)")]
RawOpt = Annotated[bool, typer.Option("--raw", help="complete the prompt as-is, without the chat template")]


# LoadOptions' fields that commands take as flags, declared once: the field, its flag. A command lists the ones it
# takes (load_flags) and receives them as one LoadOptions; their defaults are LoadOptions'.
LOAD_FLAGS: dict[str, Any] = {
    "pair": PairOpt, "target": TargetOpt, "drafter": DrafterOpt, "ctx": CtxOpt, "budget": BudgetOpt,
    "accept": AcceptOpt, "threads": ThreadsOpt, "provider": ProviderOpt, "gpu_layers": GpuOpt,
    "placement": PlacementOpt, "readahead": ReadaheadOpt, "mlock": MlockOpt, "target_dtype": TargetDtypeOpt,
    "lookup": LookupOpt, "overlap": OverlapOpt, "speculate": SpeculateOpt,
}
# the command line's defaults where they differ from the library's (LoadOptions): a person gets the plan's choice
CLI_DEFAULTS: dict[str, Any] = {"speculate": "auto"}
# where and how models run
PLACING = ("threads", "provider", "gpu_layers", "placement", "readahead", "overlap", "mlock")
DECODING = ("drafter", "lookup", "budget", "accept", "ctx", "speculate", *PLACING)  # what the decoding commands share
PARAMETERS = {"ctx": "ctx_size"}  # a field whose name the command's typer.Context already takes
# SamplingConfig's fields that commands take as flags, declared once: the field, its flag, and its flag where the
# model's recommended sampling fills what is not given (chat)
SAMPLING_FLAGS: dict[str, tuple[Any, Any]] = {
    "temperature": (TempOpt, Annotated[float | None, typer.Option(help=RECOMMENDED, show_default=False)]),
    "top_k": (TopKOpt, Annotated[int | None, typer.Option(help=RECOMMENDED, show_default=False)]),
    "top_p": (TopPOpt, Annotated[float | None, typer.Option(help=RECOMMENDED, show_default=False)]),
    "min_p": (MinPOpt, Annotated[float | None, typer.Option(help=RECOMMENDED, show_default=False)]),
    "repeat_penalty": (RepeatOpt, Annotated[float | None, typer.Option(
        help=RECOMMENDED + "; chat's 1.1 where the model recommends none", show_default=False)]),
    "seed": (SeedOpt, SeedOpt),
}


def sampling_flags(recommended: bool = False, **defaults: Any) -> Callable[[F], F]:
    """Give a command the sampling flags (SAMPLING_FLAGS') and call it with them as `sampling`: a SamplingConfig
    (the flags' defaults SamplingConfig's, or `defaults`); with `recommended`, the flags given as a dict (None where
    not given: the model's recommended sampling fills them)."""
    from dataclasses import fields as dataclass_fields

    from edge.sampling import SamplingConfig

    own = {field.name: field.default for field in dataclass_fields(SamplingConfig)} | defaults

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        kept = [p for p in signature.parameters.values() if p.name != "sampling"]
        at = next((i for i, p in enumerate(kept) if p.kind is inspect.Parameter.KEYWORD_ONLY), len(kept))
        added = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                   default=None if recommended and name != "seed" else own[name],
                                   annotation=flag[1] if recommended else flag[0])
                 for name, flag in SAMPLING_FLAGS.items()]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            given = {name: kwargs.pop(name) for name in SAMPLING_FLAGS}
            return command(**kwargs, sampling=given if recommended else SamplingConfig(**given))

        parameters = [*kept[:at], *added, *kept[at:]]
        wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        return wrapper  # type: ignore[return-value]

    return decorate


def load_flags(*fields: str, **flags: Any) -> Callable[[F], F]:
    """Give a command the flags of these LoadOptions fields (LOAD_FLAGS'; `flags` overrides one, e.g. the model as
    an argument), and call it with them as one `load=LoadOptions(...)` (the app's --models file included). The
    command's first parameter is its typer.Context."""
    from dataclasses import fields as dataclass_fields

    defaults = {field.name: field.default for field in dataclass_fields(LoadOptions)} | CLI_DEFAULTS
    names = [*fields, *(name for name in flags if name not in fields)]

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        kept = [p for p in signature.parameters.values() if p.name != "load"]
        added = [inspect.Parameter(PARAMETERS.get(name, name), inspect.Parameter.KEYWORD_ONLY, default=defaults[name],
                                   annotation=flags.get(name, LOAD_FLAGS[name])) for name in names]

        context_name = kept[0].name  # typer passes every parameter by name

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            given = {name: kwargs.pop(PARAMETERS.get(name, name)) for name in names}
            return command(**kwargs, load=LoadOptions(models_file=kwargs[context_name].obj, **given))

        wrapper.__signature__ = signature.replace(parameters=[*kept, *added])  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in (*kept, *added)}
        return wrapper  # type: ignore[return-value]

    return decorate


def argument_text(text: str, what: str = "the prompt") -> str:
    """A command-line argument as text: under a locale that is not UTF-8, bytes that are not UTF-8 arrive as lone
    surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as problem:
        raise UserError(f"{what} is not UTF-8 text (character {problem.start + 1}); pass UTF-8 text (a UTF-8 locale "
                        "such as LANG=C.UTF-8 passes it as typed)") from None
    return text


def read_stdin() -> str:
    """Standard input as UTF-8 text, decoded strictly (Python's own reading would let bytes that are not UTF-8
    through as surrogates under the C locale, to fail later in the tokenizer)."""
    if sys.stdin is None or sys.stdin.closed:
        raise UserError("standard input is closed: pipe the prompt in, or give it as an argument instead of -")
    try:
        data = (sys.stdin.buffer.read(MAX_INPUT_BYTES + 1) if hasattr(sys.stdin, "buffer")
                else sys.stdin.read(MAX_INPUT_BYTES + 1).encode())
        if len(data) > MAX_INPUT_BYTES:  # /dev/zero never ends
            raise UserError(f"standard input is longer than {MAX_INPUT_BYTES >> 20} MiB: not a prompt")
        return data.decode("utf-8")
    except UnicodeDecodeError as problem:
        raise UserError(f"standard input is not UTF-8 text (byte {problem.start}); convert it (iconv)") from None
    except (OSError, ValueError) as problem:  # a closed or unreadable descriptor
        raise UserError(f"cannot read standard input ({problem}): pipe the prompt in, or give it as an argument") \
            from None


def named(command: typer.Context, model: str | None, drafter: str | None = None):
    """The pair a MODEL argument names (a pair of models.toml, a GGUF file, a Hugging Face reference; a file's
    drafter, if given), and the models.toml it came from."""
    from edge.models.loading import resolve_spec

    return resolve_spec(LoadOptions(models_file=command.obj, pair=model, drafter=drafter))


def load(command: typer.Context, **options: Any):
    """The pair the command's flags name (LoadOptions' fields), loaded where the plan puts it."""
    return load_pair(LoadOptions(models_file=command.obj, **options))


@contextmanager
def working(what: str) -> Iterator[Callable[[str], None]]:
    """A spinner saying what is happening, on a terminal, with a row for each download under way; yields the reporter
    of progress lines, which also moves the spinner to the step at hand (downloading, assembling, preparing, building
    a graph, timing passes). Off a terminal, the progress lines only."""
    if not err.is_terminal:
        yield report
        return
    from rich.live import Live

    shown = Working(what)
    with Live(shown, console=err, transient=True, refresh_per_second=12.5):
        yield shown


def load_pair(options: LoadOptions):
    """Load, with a spinner saying what is happening (on a terminal; elsewhere, progress lines only)."""
    from edge.models.loading import open_pair

    what = options.pair or (options.target and Path(str(options.target)).name) or "the default pair"
    with working(f"loading {what}") as said:
        return open_pair(options, said)


def refuse_base_model(options: LoadOptions, what_to_do: str) -> None:
    """A base model cannot chat: say so from its header, before a load of many seconds."""
    from edge.models.loading import base_model

    name = base_model(options)
    if name is not None:
        raise UserError(f"{name} has no chat template (a base model): {what_to_do}")
