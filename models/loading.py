"""Loading a pair: from load options (a pair of models.toml, or GGUF paths) to a target and a drafter loaded,
checked against each other and placed where the plan puts them. `edge.load` is `open_pair` here.

Runtimes are looked up by name (runtimes.runtime) and imported only when a model of theirs loads.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from edge.chat_template import ChatTemplate
from edge.errors import UserError
from edge.grow import MAX_LEAVES
from edge.options import LoadOptions
from edge.protocols import Drafter
from edge.sampling import CHAT_DEFAULTS, SamplingConfig
from models.opening import drafter_model, graph_folder, head_ids, materialize, open_drafter, phase
from models.pair import NESTED, Pair, budget_refused, tree_nodes
from models.registry import ModelSpec, PairSpec, Registry, Source, load_registry
from models.sources import model_path
from runtimes import runtime

Report = Callable[[str], None]


def _quiet(_message: str) -> None:
    pass


def open_pair(options: LoadOptions, report: Report = _quiet) -> Pair:
    """Load the pair that `options` names, where the plan puts it (edge.load)."""
    times: dict[str, float] = {}
    with phase(times, "models.toml and plan"):
        spec, models_file = resolve_spec(options)
        planned = planned_target(spec, models_file, report)  # None until a model file is here (fetched first)
    return load_pair(spec, options, report, models_file, times, planned)


def base_model(options: LoadOptions) -> str | None:
    """The pair's name when the target `options` names has no chat template, read from its header without loading
    anything; None otherwise, and while its file is not here yet (loading fetches it, and tells then)."""
    from runtimes.gguf_file import check_gguf

    spec = resolve_spec(options)[0]
    path = model_path(spec.target)
    return spec.name if path is not None and path.is_file() and not check_gguf(path).chat_template else None


def resolve_spec(options: LoadOptions) -> tuple[PairSpec, Path | None]:
    """The pair `options` names, with the options that rewrite it applied; and the models.toml it came from. A
    model is a pair of models.toml, a GGUF file or a Hugging Face reference (`pair`, or `target`), with `drafter`
    (a file or reference) or drafting for itself."""
    if options.target is not None:
        spec, models_file = spec_for_models(options.target, options.drafter, options.ctx or 4096), None
    else:
        registry = load_registry(options.models_file)
        if options.pair is None or options.pair in registry.pairs:
            if options.drafter is not None:
                raise UserError(f"--drafter goes with a model file or a Hugging Face reference: the pair "
                                f"{registry.pair(options.pair).name} has its own drafter (models.toml)")
            spec, models_file = registry.pair(options.pair), registry.path
        else:
            spec, models_file = spec_for_models(options.pair, options.drafter, options.ctx or 4096, registry), None
    if spec.drafter.runtime == BY_ARCHITECTURE and (here := model_path(spec.drafter)) is not None and here.is_file():
        spec = replace(spec, drafter=replace(spec.drafter, runtime=drafter_runtime_for(here)))
    if options.ctx:
        spec = replace(spec, ctx=options.ctx)
    if options.provider is not None:  # overrides models.toml for every ONNX model of the pair
        spec = replace(spec, target=replace(spec.target, provider=options.provider),
                       drafter=replace(spec.drafter, provider=options.provider))
    if options.target_dtype is not None:
        quantize = None if options.target_dtype == "as-is" else options.target_dtype
        spec = replace(spec, target=replace(spec.target, quantize=quantize))
    if options.drafter_runtime or options.drafter_vocab is not None or options.drafter_quantize:
        spec = replace(spec, drafter=drafter_model(spec.drafter, options.drafter_runtime, options.drafter_vocab,
                                                    options.drafter_quantize))
    if options.placement == "ssd" and spec.target.runtime == "onnx":
        raise UserError("--placement ssd streams a llama.cpp target from its file: not with an onnx target")
    return spec, models_file


# A model named where it is used: user/repo:QUANT, with hf.co/ or huggingface.co/ before it (as ollama and
# llama.cpp's -hf take them). Without :QUANT, Q4_K_M, as theirs.
_HF_REFERENCE = re.compile(r"^(?:https?://)?(?:hf\.co/|huggingface\.co/)?([\w.-]+/[\w.-]+)(?::(\S+))?$")
BY_ARCHITECTURE = "by-architecture"  # a drafter runtime decided at load: onnx where its graph builder knows the file


def model_source(model: str | Path, registry: Registry | None = None) -> Source:
    """Where a model named on the command line comes from: a GGUF file, or a Hugging Face reference."""
    text = str(model)
    path = Path(text).expanduser()
    if isinstance(model, Path) or path.exists() or text.lower().endswith(".gguf"):
        return Source(path=path)
    found = _HF_REFERENCE.match(text)
    if found and not text.startswith((".", "/", "~")):
        return Source(hf=f"{found.group(1)}:{found.group(2) or 'Q4_K_M'}")
    known = f" (pairs: {', '.join(registry.pairs)})" if registry is not None else ""
    raise UserError(f"unknown model {text!r}: name a pair of models.toml{known}, a GGUF file, or a Hugging Face "
                    "reference user/repo:QUANT")


def spec_for_models(target: str | Path, drafter: str | Path | None, ctx: int,
                    registry: Registry | None = None) -> PairSpec:
    """A pair made from models named on the command line (files or Hugging Face references). Without a drafter
    the target drafts for itself. The drafter runs on ONNX Runtime (int4, a 4-bit KV cache) as the shipped pairs'
    do, where the graph builder knows its architecture, else on llama.cpp."""
    target_source = model_source(target, registry)
    target_spec = ModelSpec(target_source, kv_type="bf16")
    drafter_source = target_source if drafter is None else model_source(drafter, registry)
    drafter_spec = ModelSpec(drafter_source, kv_type="q4_0", runtime=BY_ARCHITECTURE)
    name = target_source.path.name if target_source.path is not None else str(target_source.hf)
    return PairSpec(name=name, about="named on the command line", target=target_spec, drafter=drafter_spec, ctx=ctx)


def drafter_runtime_for(drafter_file: Path) -> str:
    from runtimes.gguf_file import gguf_header
    from runtimes.onnx.arch import ARCHITECTURES

    return "onnx" if gguf_header(drafter_file).field("general.architecture") in ARCHITECTURES else "llama_cpp"


@dataclass(frozen=True)
class PlannedTarget:
    """What `edge-spec plan` decides for loading the target."""

    gpu_layers: int  # target layers on the GPU (0 without one)
    streamed: bool  # its weights do not fit in RAM: used from the file's mapping (never repacked), read every pass


def planned_target(spec: PairSpec, models_file: Path | None, report: Report = _quiet) -> PlannedTarget | None:
    """Apply `edge-spec plan`: refuse a pair that cannot run here (with the numbers), give the target's GPU layers
    when a GPU is visible, and say whether the target streams from the drive. The rest of the plan is what loading
    does anyway (mmap'd weights, the kernel streams what RAM cannot hold). None while a model file is not here yet
    (load_pair plans once it is fetched)."""
    if any(path is None or not path.is_file() for path in (model_path(spec.target), model_path(spec.drafter))):
        return None
    from models.planning import make_plan
    from offload.probe import probe_gpus

    plan = make_plan(spec, None, models_file)
    streamed = plan.target.placement == "ssd"
    if streamed:
        report(f"plan: the target does not fit in RAM ({plan.machine.ram_free / 2**30:.1f} GiB free): "
               f"{plan.ssd_bytes / 2**30:.1f} GiB of its weights are read from the drive on every pass")
    if not probe_gpus():
        return PlannedTarget(0, streamed)
    report(f"plan: {plan.target.n_gpu_layers} target layers on the GPU, the rest in {plan.target.placement}")
    return PlannedTarget(plan.target.n_gpu_layers, streamed)


def load_pair(spec: PairSpec, options: LoadOptions, report: Report = _quiet, models_file: Path | None = None,
              times: dict[str, float] | None = None, planned: PlannedTarget | None = None) -> Pair:
    """Load `spec` (already resolved: resolve_spec) with `options`' placement, threads and budget, where `planned`
    (planned_target; made here once the files are) puts the target; `times` gathers the seconds of each phase.

    A target the plan streams is used from its file's mapping: the kernel reads it on every pass and evicts it.
    placement "ssd": the same for a target that would fit, its pages evicted after every pass (offload/ssd.py)."""
    from runtimes.gguf_file import check_gguf

    times = {} if times is None else times
    with phase(times, "model files"):
        target_file = materialize(spec.target, report)
        info = check_gguf(target_file)
        drafter_file = materialize(spec.drafter, report)  # here, not beside the target's load: one download at a time
    if planned is None:
        with phase(times, "plan"):
            planned = planned_target(spec, models_file, report) or PlannedTarget(0, False)
    if options.gpu_layers is None:
        options = replace(options, gpu_layers=planned.gpu_layers)
    if spec.drafter.runtime == BY_ARCHITECTURE:
        spec = replace(spec, drafter=replace(spec.drafter, runtime=drafter_runtime_for(drafter_file)))
    draft_threads = drafter_threads(options.threads, options.placement, options.readahead)
    budget = spec.budget if options.budget is None else options.budget
    nodes = tree_nodes(budget)
    if spec.target.runtime == "onnx" and nodes > MAX_LEAVES + 1:  # refused before anything loads
        raise UserError(budget_refused(spec.name, int(budget), MAX_LEAVES + 1))
    streamed = planned.streamed and spec.target.runtime != "onnx"
    if spec.target.runtime == "onnx":
        with phase(times, "target and drafter (QuantSpec)"):
            target, drafter = _load_quantspec(spec, target_file, options.threads, report)
        warning = None
    else:
        llama = runtime("llama_cpp")
        llama.prefer_tiled(streamed or options.placement == "ssd")  # the faster invariant K-quant kernel for it
        repack = not (streamed or options.placement == "ssd") and llama.keeps_repacking(info.weight_types)
        target, drafter = _load_side_by_side(spec, options, target_file, draft_threads, report, times, nodes, repack)
        if options.placement == "ssd":
            try:
                with phase(times, "ssd placement check"):
                    target = on_ssd(target, target_file, options.readahead)
            except BaseException:
                drafter.close()
                raise
        warning = llama.lossless_guarantee(info.weight_types, spec.target.kv_type, _dtype_fix(spec, models_file))
        if target.n_ctx != spec.ctx:
            report(f"context: {target.n_ctx} tokens, not {spec.ctx} (llama.cpp sizes contexts in steps of 256)")
    with phase(times, "chat template"):
        template = _template(info.chat_template, target)
    return Pair(spec.name, target, drafter, template, budget, warning, spec, options, models_file, draft_threads,
                sampling=chat_sampling(target_file, report), load_seconds=times, report=report, streamed=streamed)


def _dtype_fix(spec: PairSpec, models_file: Path | None) -> str:
    """How the user who named this target rewrites it as Q8_0: in their models.toml, or on the command line."""
    if models_file is None:
        return "--target-dtype q8_0 (target_dtype=\"q8_0\" in Python)"
    return f'target.quantize = "q8_0" under [pairs."{spec.name}"] in {models_file}'


def chat_sampling(target_file: Path, report: Report = _quiet) -> SamplingConfig:
    """The sampling the model's GGUF recommends (general.sampling.*), over CHAT_DEFAULTS for what it leaves out."""
    from runtimes.gguf_file import recommended_sampling

    recommended = recommended_sampling(target_file)
    try:
        return replace(CHAT_DEFAULTS, **recommended)
    except UserError as problem:
        report(f"{target_file.name} recommends sampling edge-spec cannot use ({problem}); using llama.cpp's defaults")
        return CHAT_DEFAULTS


def _load_side_by_side(spec: PairSpec, options: LoadOptions, target_file: Path, draft_threads: int | None,
                       report: Report, times: dict[str, float], max_tree: int,
                       repack: bool = True) -> tuple[Any, Drafter]:
    """The llama.cpp target and the drafter, the drafter loading on a thread while the target loads: both spend
    their time in native code (llama.cpp mapping weights and allocating its KV cache, onnxruntime reading and
    packing the drafter's), so on a machine with two cores or more the slower of the two is what start-up waits.
    Both take trees of up to `max_tree` nodes; `repack` False keeps the target's weights in its file's mapping."""
    llama = runtime("llama_cpp")
    run = llama.RunOptions(n_ctx=spec.ctx, kv_type=spec.target.kv_type, n_threads=options.threads,
                           n_gpu_layers=options.gpu_layers or 0, use_mlock=options.mlock, repack=repack)
    beside: dict[str, float] = {}  # the two sides' own times, shown under the block's wall time
    with phase(times, "target and drafter, side by side"), \
            ThreadPoolExecutor(1, thread_name_prefix="edge-spec-drafter") as pool:
        future = pool.submit(open_drafter, spec, spec.drafter, target_file, draft_threads, options.gpu_layers or 0,
                             report, beside, max_tree)
        try:
            with phase(beside, "target"):
                target = llama.load_target(target_file, run, max_tree)
        except BaseException:
            _close_when_loaded(future)
            raise
        try:
            drafter = future.result()
        except BaseException:
            target.close()
            raise
    times.update({f"{NESTED}{name}": seconds for name, seconds in beside.items()})
    return target, drafter


def _close_when_loaded(future: Future) -> None:
    with suppress(BaseException):  # the drafter failed too: the target's error is the one to report
        future.result().close()


def drafter_threads(threads: int | None, placement: str, readahead: bool) -> int | None:
    """The drafter's CPU threads: with the target streamed from the SSD and read ahead while the tree grows, one
    core is left to the readahead (on 2 cores, a drafter on both grew its trees no faster and delayed the reading
    into the target's pass; docs/performance.md)."""
    if threads is not None or placement != "ssd" or not readahead:
        return threads
    return max(1, runtime("llama_cpp").default_threads() - 1)


def on_ssd(target: Any, path: Path, readahead: bool) -> Any:
    """The target streamed from its file; refused when a pass does not read its weights from the mapping (a guard:
    the target is loaded without llama.cpp's repacked buffers, which copy e.g. Q4_0 weights into RAM on x86). A pass
    counts as reading the file when its pages are in the page cache after it, or when the process read that much
    from the drive during it (under a memory limit smaller than the file the pass's first pages are gone by its end)."""
    from edge.tree import TokenTree
    from offload.ssd import SsdStreamer, SsdTarget, read_bytes, resident_fraction

    probe = SsdStreamer(path, readahead=False)
    probe.evict()
    before = read_bytes()
    target.verify(TokenTree.root(max(target.model.bos, 0)))  # a pass with logits: the head is read too
    after = read_bytes()
    size = max(path.stat().st_size, 1)
    read = (after - before) / size if before is not None and after is not None else 0.0
    touched = max(resident_fraction(path), read)
    target.truncate(0)
    probe.close()
    if touched < 0.5:
        target.close()
        raise UserError(f"--placement ssd: a pass of {path.name} read only {touched:.0%} of the file (llama.cpp "
                        "copied its weights into RAM); use --target-dtype f16 or q8_0")
    return SsdTarget(target, path, readahead)


def _load_quantspec(spec: PairSpec, target_file: Path, threads: int | None, report: Report) -> tuple[Any, Any]:
    """QuantSpec mode: ONNX target and drafter sharing one hierarchical KV cache."""
    if spec.drafter.runtime != "onnx":
        raise UserError(f"pair {spec.name}: an onnx target (QuantSpec mode) needs an onnx drafter "
                        "(drafter.runtime = \"onnx\")")
    drafter_file = materialize(spec.drafter, report)
    onnx = runtime("onnx")
    tokenizer = runtime("llama_cpp").Model(target_file)  # tokenizer and chat-template tokens; weights stay unused
    options = onnx.OnnxOptions(provider=spec.target.provider, threads=threads, n_ctx=spec.ctx,
                               graph_dir=graph_folder(target_file))
    target, drafter = onnx.load_quantspec(target_file, drafter_file, options, tokenizer, tokenizer.eog_tokens(),
                                          head_ids(spec, spec.drafter), report)
    target.model = tokenizer
    return target, drafter


def _template(source: str | None, target: Any) -> ChatTemplate | None:
    if not source:
        return None
    model = target.model
    text = model.token_bytes(model.bos, special=True).decode("utf-8", "replace") if model.bos >= 0 else ""
    eos = model.token_bytes(model.eos, special=True).decode("utf-8", "replace") if model.eos >= 0 else ""
    return ChatTemplate(source, text, eos)
