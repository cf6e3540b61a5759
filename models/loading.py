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
from typing import cast

from edge.models.cache import ensure_space
from edge.models.kept import open_corpus
from edge.models.opening import drafter_model, graph_folder, head_ids, materialize, open_drafter, phase
from edge.models.pair import NESTED, Pair, budget_refused, tree_nodes
from edge.models.registry import ModelSpec, PairSpec, Registry, Source, load_registry
from edge.models.sources import model_path
from edge.offload.direct import reads_directly
from edge.offload.libc import loading_side_by_side
from edge.offload.plan import AUTO_MAX_BUDGET
from edge.offload.probe import memory_limit
from edge.runtimes import (
    DRAFTERS,
    ModelOptions,
    SplitsLayers,
    check_name,
    default_threads,
    drafts_from,
    runtime,
    traits,
)

from edge.chat_template import ChatTemplate
from edge.errors import UserError
from edge.options import LoadOptions
from edge.protocols import Drafter, Target
from edge.sampling import LLAMA_DEFAULTS, SamplingConfig

Report = Callable[[str], None]
MOST_LANES = 4  # serve --parallel auto: at most this many requests at once
LANE_SLOWDOWN = 1.1  # ... and a request alone at most this much slower for the memory their KV caches take
STOCK_KV = "f16"  # the KV cache a runtime's default gives (llama.cpp's), for a target decoding plainly alone


def _quiet(_message: str) -> None:
    pass


def open_pair(options: LoadOptions, report: Report = _quiet) -> Pair:
    """Load the pair that `options` names, where the plan puts it (edge.load)."""
    times: dict[str, float] = {}
    with phase(times, "models.toml and plan"):
        spec, models_file = resolve_spec(options)
        planned = planned_target(planned_spec(spec, options), models_file, report, options.drafter_model,
                                 _chooses(spec, options), options.lookup_drafts, options.placement == "ssd",
                                 plain=_plain_lanes(options))  # None until the files are here
    return load_pair(spec, options, report, models_file, times, planned)


def planned_spec(spec: PairSpec, options: LoadOptions) -> PairSpec:
    """The pair as the plan sizes it: with lanes (parallel), the KV caches of every lane and of the target's own
    context (Pair.lanes), each of the pair's context, and as many again for the cells lanes let go of
    (TreeLanes.dead_room)."""
    if options.parallel == 1:
        return spec
    lanes = 2 * options.parallel
    return replace(spec, ctx=spec.ctx * (lanes + 1), contexts=lanes + 1)


def lanes_that_fit(options: LoadOptions, most: int = MOST_LANES, machine: str | None = None) -> tuple[int, str]:
    """`serve --parallel auto`: how many requests to decode together, with the reason in words. Lanes pay where a pass
    is bound by moving the weights (read from the drive, or on a GPU): N requests' tokens then ride in one pass for
    about the price of one. On a CPU with the target in RAM they pay only while several requests run: lanes there
    pad every pass to the 4 rows of llama.cpp's repacked kernel (kernels.REPACK_ROWS: four clients got 3.23x one
    alone, 0.85x llama-server's four, docs/server.md), so a lone request pays a 4-row pass, where alone it runs on
    llama.cpp's kernels at one row. So: the most lanes, up to `most` (ollama's and llama-server's four), whose KV caches
    the memory holds with the target placed as for one request and its one-token pass at most LANE_SLOWDOWN slower
    (the cells lanes take are weights read again every pass, which a lone client pays for); else 1. `machine`: a
    described one (edge-spec plan --machine)."""
    from edge.models.planning import make_plan
    from edge.offload.plan import pass_cost

    if str(options.drafter) == "lookup" and options.lookup_drafts:
        return 1, "lanes decode plainly, and this pair drafts by lookup"
    spec, models_file = resolve_spec(options)

    def plan(n: int):
        lanes = replace(options, parallel=n)
        return make_plan(planned_spec(spec, lanes), machine, models_file, options.placement == "ssd",
                         drafts=lanes.drafter_model, plain=_plain_lanes(lanes))

    try:
        alone = plan(1)
    except UserError:  # no facts before the files are here, or the pair as named does not fit: loading says so
        return 1, "the plan cannot place the pair as named yet"
    if alone.target.placement == "ram":
        return 1, ("the target's passes compute on the CPU, where lanes pad a lone request's pass to 4 rows (about "
                   "twice its time), and one request alone runs on llama.cpp's kernels at one row")
    for n in range(most, 1, -1):
        try:
            shared = plan(n)
        except UserError:
            continue
        slower = pass_cost(shared.target, shared.machine, 1).seconds / alone.one_token.seconds
        if shared.target.placement == alone.target.placement and slower <= LANE_SLOWDOWN:
            return n, f"the memory holds {n} requests' KV caches beside the target, and they share its passes"
    return 1, ("a second request's KV caches would leave less of the target in memory, read again every pass: "
               "--parallel N serves several at a lone client's cost")


def _plain_lanes(options: LoadOptions) -> bool:
    """Lanes that decode plainly (no drafter model): the target verifies no tree."""
    return options.parallel > 1 and not options.drafter_model


def _chooses(spec: PairSpec, options: LoadOptions) -> bool:
    """Whether the plan may choose the pair's use of the memory: asked (speculate auto), with budget auto, and with
    the drafter the pair names (one given on the command line is wanted)."""
    budget = spec.budget if options.budget is None else options.budget
    return options.speculate == "auto" and budget == "auto" and options.drafter_model and options.drafter is None


def base_model(options: LoadOptions) -> str | None:
    """The pair's name when the target `options` names has no chat template, read from its header without loading
    anything; None otherwise, and while its file is not here yet (loading fetches it, and tells then)."""
    from edge.runtimes.gguf_file import check_gguf

    spec = resolve_spec(options)[0]
    path = model_path(spec.target)
    return spec.name if path is not None and path.is_file() and not check_gguf(path).chat_template else None


def resolve_spec(options: LoadOptions) -> tuple[PairSpec, Path | None]:
    """The pair `options` names, with the options that rewrite it applied; and the models.toml it came from. A
    model is a pair of models.toml, a GGUF file or a Hugging Face reference (`pair`, or `target`), with `drafter`
    (a file or reference) or drafting for itself."""
    drafter = options.drafter if options.drafter_model else None  # lookup or none: the target alone
    if options.target is not None:
        spec, models_file = spec_for_models(options.target, drafter, options.ctx or 4096), None
    else:
        registry = load_registry(options.models_file)
        if options.pair is None or options.pair in registry.pairs:
            if drafter is not None:
                raise UserError(f"drafter goes with a model file or a Hugging Face reference: the pair "
                                f"{registry.pair(options.pair).name} has its own drafter (models.toml)", "drafter")
            spec, models_file = registry.pair(options.pair), registry.path
        else:
            spec, models_file = spec_for_models(options.pair, drafter, options.ctx or 4096, registry), None
    if options.drafter_model and spec.drafter.runtime == BY_ARCHITECTURE and (here := model_path(spec.drafter)) \
            is not None and here.is_file():
        spec = replace(spec, drafter=replace(spec.drafter, runtime=drafter_runtime_for(here)))
    if options.ctx:
        spec = replace(spec, ctx=options.ctx)
    if options.provider is not None:  # overrides models.toml for every ONNX model of the pair
        spec = replace(spec, target=replace(spec.target, provider=options.provider),
                       drafter=replace(spec.drafter, provider=options.provider))
    if options.target_dtype is not None:
        quantize = None if options.target_dtype == "as-is" else options.target_dtype
        spec = replace(spec, target=replace(spec.target, quantize=quantize))
    if options.drafter_model and (options.drafter_runtime or options.drafter_vocab is not None
                                  or options.drafter_quantize):
        runtime_name = options.drafter_runtime and check_name(options.drafter_runtime)
        spec = replace(spec, drafter=drafter_model(spec.drafter, runtime_name, options.drafter_vocab,
                                                    options.drafter_quantize))
    if options.placement == "ssd" and not traits(spec.target.runtime).streams:
        raise UserError(f"placement ssd streams a target from its file: a {spec.target.runtime} target cannot be",
                        "placement")
    return spec, models_file


# A model named where it is used: user/repo:QUANT, with hf.co/ or huggingface.co/ before it (as ollama and
# llama.cpp's -hf take them). Without :QUANT, Q4_K_M, as theirs.
_HF_REFERENCE = re.compile(r"^(?:https?://)?(?:hf\.co/|huggingface\.co/)?([\w.-]+/[\w.-]+)(?::(\S+))?$")
BY_ARCHITECTURE = "by-architecture"  # a drafter runtime decided at load: the fastest that can run the file


def model_source(model: str | Path, registry: Registry | None = None) -> Source:
    """Where a model named on the command line comes from: a GGUF file, or a Hugging Face reference."""
    text = str(model)
    if not text.strip():
        raise UserError("the model's name is empty: name a pair of models.toml, a GGUF file, or a Hugging Face "
                        "reference user/repo:QUANT")
    path = Path(text).expanduser()
    try:
        here = path.exists()
    except OSError:  # a name longer than a file name may be (255 bytes): not a file here
        here = False
    if isinstance(model, Path) or here or text.lower().endswith(".gguf"):
        if len(path.name.encode()) > 255:
            raise UserError(f"the model file name {path.name[:40]!r}... is longer than a file name may be (255 "
                            "bytes)")
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
    """The first runtime of DRAFTERS (fastest first) that drafts from this file's architecture."""
    from edge.runtimes.gguf_file import gguf_header

    architecture = gguf_header(drafter_file).field("general.architecture")
    return next(name for name in DRAFTERS if drafts_from(name, architecture))


@dataclass(frozen=True)
class PlannedTarget:
    """What `edge-spec plan` decides for loading the target."""

    gpu_layers: int  # target layers on the GPU (0 without one)
    streamed: bool  # its weights do not fit in RAM: used from the file's mapping (never repacked), read every pass
    max_tree: int | None = None  # auto's largest tree, where a memory limit leaves room for no larger (None: no bound)
    resident: int = 0  # streamed: bytes of its weights that stay in RAM (partial residency), the rest read every pass
    use: str = "drafter"  # offload/choice.py's: "drafter" (the pair as named), "plain" or "lookup" (the target alone)
    note: str | None = None  # the plan's choice and why, in one line (where it chose)
    rates: tuple[tuple[str, float], ...] = ()  # where it chose: each use weighed and its predicted tokens/s
    # streamed: the KV cache's cells the plan gave room to besides `resident`, and its bytes a cell (past them the
    # resident set gives the cache room: offload/window.py, WindowedTarget); 0: room for the whole context
    kv_cells: int = 0
    kv_cell_bytes: float = 0.0
    read_bytes: int = 0  # streamed: what a pass reads from the drive (0: all of it resident)


def planned_target(spec: PairSpec, models_file: Path | None, report: Report = _quiet,
                   drafts: bool = True, choose: bool = False, lookup: bool = True,
                   stream: bool = False, plain: bool = False) -> PlannedTarget | None:
    """Apply `edge-spec plan`: refuse a pair that cannot run here (with the numbers), give the target's GPU layers
    when a GPU is visible, and say whether the target streams from the drive and how much of it stays resident. The
    rest of the plan is what loading does anyway. None while a model file is not here yet (load_pair plans once it
    is fetched). `drafts`: a drafter model loads too (not with lookup drafting alone); `choose`: the plan may
    instead give the drafter's memory to the target (offload/choice.py), and says why in one line; `lookup`: lookup
    drafting is allowed among its choices; `stream`: the target is read from the drive every pass, whatever fits
    (--placement ssd: what the plan weighs, though loading, not the plan, streams it); `plain`: the target verifies
    no tree (a server's lanes decode plainly)."""
    models = (spec.target, spec.drafter) if drafts else (spec.target,)
    if any(path is None or not path.is_file() for path in map(model_path, models)):
        return None
    from edge.models.planning import make_choice, make_plan
    from edge.offload.choice import reason

    use, note, rates = "drafter", None, ()
    if drafts and choose:
        chosen, uses = make_choice(spec, None, models_file, lookup, stream)
        plan, use, note = chosen.plan, chosen.name, f"plan: {reason(chosen, uses)}"
        rates = tuple((weighed.name, weighed.tokens_per_s) for weighed in uses)
        if plan.machine.capped or plan.target.placement == "ssd":  # in RAM it is what auto does anyway: said in chat
            report(note)
    else:
        plan = make_plan(spec, None, models_file, stream, drafts=drafts, plain=plain)
    streamed = plan.target.placement == "ssd" and not stream  # larger than RAM (--placement ssd loads its own way)
    max_tree = plan.tree.n_tokens if spec.budget == "auto" and plan.tree.n_tokens < AUTO_MAX_BUDGET + 1 else None
    if max_tree is not None and use == "drafter" and not plain:
        report(f"plan: auto's trees are at most {max_tree} nodes (the logits of larger ones would not fit under the "
               "memory limit)")
    resident = plan.target.resident_bytes
    if streamed:
        kept = f"{resident / 2**30:.2f} GiB of its weights stay in RAM, " if resident else ""
        report(f"plan: the target does not fit in RAM ({plan.machine.ram_free / 2**30:.1f} GiB free): {kept}"
               f"{plan.ssd_bytes / 2**30:.2f} GiB are read from the drive on every pass")
    # on a GPU the installed llama.cpp can use (models.planning.usable_gpus); load_pair says so unless told otherwise
    gpu_layers = plan.target.n_gpu_layers if plan.machine.vram_free else 0
    return PlannedTarget(gpu_layers, streamed, max_tree if use != "plain" else None, resident, use, note, rates,
                         plan.target.kv_cells, plan.target.kv_cell_bytes(), plan.ssd_bytes)


def load_pair(spec: PairSpec, options: LoadOptions, report: Report = _quiet, models_file: Path | None = None,
              times: dict[str, float] | None = None, planned: PlannedTarget | None = None) -> Pair:
    """Load `spec` (already resolved: resolve_spec) with `options`' placement, threads and budget, where `planned`
    (planned_target; made here once the files are) puts the target; `times` gathers the seconds of each phase.

    A target the plan streams is used from its file's mapping: the kernel reads it on every pass and evicts it.
    placement "ssd": the same for a target that would fit, its pages evicted after every pass (offload/ssd.py)."""
    from edge.models.planning import check_gpu_layers
    from edge.runtimes.gguf_file import check_gguf

    times = {} if times is None else times
    with phase(times, "model files"):
        target_file = materialize(spec.target, report)
        info = check_gguf(target_file)
        drafts = options.drafter_model
        # here, not beside the target's load: one download at a time
        drafter_file = materialize(spec.drafter, report) if drafts else None
    if planned is None:
        with phase(times, "plan"):
            planned = planned_target(planned_spec(spec, options), models_file, report, drafts, _chooses(spec, options),
                                     options.lookup_drafts, options.placement == "ssd",
                                     plain=_plain_lanes(options)) or PlannedTarget(0, False)
    stock = False
    if planned.use != "drafter":  # the plan gave the drafter's memory to the target
        drafts, drafter_file = False, None
        options = replace(options, drafter=planned.use if planned.use == "lookup" else "none",
                          lookup="off" if planned.use == "plain" else options.lookup)
        # decoding plainly: loaded as its runtime loads it by default, KV cache included (streamed: not repacked)
        stock = planned.use == "plain" and options.parallel == 1  # lanes stay on the batch-invariant kernels
        if stock and traits(spec.target.runtime).own_kv is None:
            spec = replace(spec, target=replace(spec.target, kv_type=STOCK_KV))
    if options.gpu_layers is None:
        options = replace(options, gpu_layers=planned.gpu_layers)
        if planned.gpu_layers:
            report(f"plan: {planned.gpu_layers} target layers on the GPU")
    if traits(spec.target.runtime).splits_layers:  # its layers go where gpu_layers says
        check_gpu_layers(options.gpu_layers)
    if drafter_file is not None and spec.drafter.runtime == BY_ARCHITECTURE:
        spec = replace(spec, drafter=replace(spec.drafter, runtime=drafter_runtime_for(drafter_file)))
    draft_threads = drafter_threads(options.threads, options.placement, options.readahead)
    budget = spec.budget if options.budget is None else options.budget
    nodes = tree_nodes(budget)
    if planned.max_tree is not None:  # a memory limit: no larger batch than the plan fits (or the budget asks)
        nodes = min(nodes, max(planned.max_tree, 1 if budget == "auto" else int(budget) + 1))
    kind = traits(spec.target.runtime)
    if kind.max_tree is not None and nodes > kind.max_tree:  # refused before anything loads
        raise budget_refused(spec.name, int(budget), kind.max_tree)
    streamed = planned.streamed and kind.streams
    if kind.shared_cache and drafter_file is not None:
        with phase(times, "target and drafter (one shared KV cache)"):
            target, drafter = _load_shared(spec, target_file, drafter_file, options.threads, report)
    else:
        # passes read through the page cache (a streamed target's resident set has its layers read directly, which
        # takes little CPU: target_threads)
        reads = options.placement == "ssd" or (planned.read_bytes > 0 and not (
            planned.resident and reads_directly(target_file)))
        target, drafter = _load_side_by_side(spec, options, target_file, draft_threads, report, times, nodes,
                                             streamed or options.placement == "ssd", drafts, stock, reads)
        if options.placement == "ssd":
            try:
                with phase(times, "ssd placement check"):
                    target = on_ssd(target, target_file, options.readahead)
            except BaseException:
                if drafter is not None:
                    drafter.close()
                raise
        elif streamed and options.readahead:
            threads = target_threads(options, stock, reads) or default_threads()
            # plainly: stock, or in lanes that grow no tree (no drafter beside its pages)
            target = streamed_in_window(target, target_file, report, planned.resident,
                                        stock or _plain_lanes(options), planned.kv_cells, planned.kv_cell_bytes,
                                        threads)
        if target.n_ctx != spec.ctx:
            report(f"context: {target.n_ctx} tokens, not {spec.ctx} (llama.cpp sizes contexts in steps of 256)")
    # plain decoding verifies no tree, alone or in lanes (whose passes keep each row on one kernel: Lanes.split_rows)
    plain = stock or (options.parallel > 1 and not drafts)
    warning = None if plain else runtime(spec.target.runtime).lossless_guarantee(
        info.weight_types, spec.target.kv_type, _dtype_fix(spec, models_file))
    if warning is None and not stock and options.gpu_layers and kind.splits_layers:
        engine = cast(SplitsLayers, runtime(spec.target.runtime))
        warning = engine.gpu_guarantee(options.gpu_layers, engine.gpu_devices()[0].backend)
    with phase(times, "chat template"):
        special = target.special
        template = ChatTemplate(info.chat_template, special.bos_text, special.eos_text) if info.chat_template else None
    return Pair(spec.name, target, drafter, template, budget, warning, spec, options, models_file, draft_threads,
                **dict(zip(("sampling", "recommended"), model_sampling(target_file, report), strict=True)),
                load_seconds=times, report=report, streamed=streamed,
                max_tree=planned.max_tree, plan_note=planned.note, plan_use=planned.use, plan_rates=dict(planned.rates),
                corpus=open_corpus(target_file, options.lookup, target.n_vocab, report))


def _dtype_fix(spec: PairSpec, models_file: Path | None) -> str:
    """How the user who named this target rewrites it as Q8_0: in their models.toml, or on the command line."""
    if models_file is None:
        return "--target-dtype q8_0 (target_dtype=\"q8_0\" in Python)"
    return f'target.quantize = "q8_0" under [pairs."{spec.name}"] in {models_file}'


def model_sampling(target_file: Path, report: Report = _quiet) -> tuple[SamplingConfig, tuple[str, ...]]:
    """The sampling the model's GGUF recommends (general.sampling.*), over llama.cpp's defaults (LLAMA_DEFAULTS) for
    what it leaves out, and the fields it gave."""
    from edge.runtimes.gguf_file import recommended_sampling

    recommended = recommended_sampling(target_file)
    try:
        return replace(LLAMA_DEFAULTS, **recommended), tuple(sorted(recommended))
    except UserError as problem:
        report(f"{target_file.name} recommends sampling edge-spec cannot use ({problem}); using llama.cpp's defaults")
        return LLAMA_DEFAULTS, ()


def target_threads(options: LoadOptions, stock: bool, reads: bool) -> int | None:
    """The target's CPU threads (None: every core). A target decoding plainly whose passes read from the drive
    through the page cache (`reads`) leaves a core to the read-ahead: ggml's threads spin between ops, and the
    read-ahead needs a core of its own to read while the pass computes. Layers read directly (offload/direct.py)
    need no core of their own: under 1049 MiB, alternated 4 times (`peer_llama_cpp.py -m qwen2.5-coder-1.5b -n 32
    --prompts FILE --cap-mb 1049 --auto-only --edge-only`, with and without `--threads 2`), one thread ran 12.67,
    9.45, 13.74 and 11.22 tokens/s, two 16.39, 10.88, 15.94 and 13.50. Where a pass reads nothing (all of a streamed
    target resident) that core would only be taken from the arithmetic: Qwen2.5-Coder-1.5B under 1175 MiB, wholly
    resident, ran 21.7 tokens/s on one thread, 28.5 on two. A server's lanes keep every core: their passes carry
    several requests' rows, whose arithmetic outweighs the read (Qwen2.5-Coder-1.5B under 1049 MiB, 153 MB read a
    pass: 4 lanes' pass 601 ms on one thread, 317 on two; a lone lane's 179 and 169)."""
    if options.threads is None and stock and reads and options.readahead:
        return max(1, default_threads() - 1)
    return options.threads


def _load_side_by_side(spec: PairSpec, options: LoadOptions, target_file: Path, draft_threads: int | None,
                       report: Report, times: dict[str, float], max_tree: int, streams: bool = False,
                       drafts: bool = True, stock: bool = False, reads: bool = True) -> tuple[Target, Drafter | None]:
    """The target and the drafter, the drafter loading on a thread while the target loads: both spend their time in
    native code (mapping weights and allocating a KV cache, reading and packing a drafter's), so on a machine with
    two cores or more the slower of the two is what start-up waits. Both take trees of up to `max_tree` nodes;
    `streams`: the target is read from the drive every pass (its weights stay in its file's mapping). Without
    `drafts`, the target alone (lookup drafting); `stock`: loaded for plain decoding alone (ModelOptions.stock);
    `reads`: a streamed target's passes read from the drive (not where all of it stays resident)."""
    threads = target_threads(options, stock, streams and reads)
    model = ModelOptions(n_ctx=spec.ctx, kv_type=spec.target.kv_type, threads=threads,
                         gpu_layers=options.gpu_layers or 0, mlock=options.mlock, streamed=streams,
                         provider=spec.target.provider, stock=stock,
                         lock_pass_pages=stock and not streams and not options.mlock and memory_limit() is not None,
                         lanes=options.parallel if options.parallel > 1 else 0, plain=not drafts)
    if not drafts:
        with phase(times, "target"):
            return runtime(spec.target.runtime).open_target(target_file, model, max_tree), None
    beside: dict[str, float] = {}  # the two sides' own times, shown under the block's wall time
    with phase(times, "target and drafter, side by side"), loading_side_by_side(), \
            ThreadPoolExecutor(1, thread_name_prefix="edge-spec-drafter") as pool:
        future = pool.submit(open_drafter, spec, spec.drafter, target_file, draft_threads, options.gpu_layers or 0,
                             report, beside, max_tree)
        try:
            with phase(beside, "target"):
                target = runtime(spec.target.runtime).open_target(target_file, model, max_tree)
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
    return max(1, default_threads() - 1)


def streamed_in_window(target: Target, path: Path, report: Report = _quiet, resident: int = 0,
                       plain: bool = False, kv_cells: int = 0, kv_cell_bytes: float = 0.0, threads: int = 0) -> Target:
    """A target the plan streams (it does not fit beside the rest): the first `resident` bytes in pass order kept in
    RAM, the rest read ahead in a window that follows its passes (offload/window.py), both sized by the memory left
    now that both models are loaded, less room for `kv_cells` cells of its KV cache (`kv_cell_bytes` each: the resident
    set gives it room past them); `plain`: it decodes plainly (one row of logits, no tree beside its pages); `threads`:
    the CPU threads its passes compute on (kept with their times, models.kept.keep_streamed_pass)."""
    from edge.offload.probe import free_beside_locked, mapped_file_bytes
    from edge.offload.window import WindowedTarget, free_memory, resident_room, window_bytes

    room = free_memory(path) - round(kv_cells * kv_cell_bytes)
    resident = resident_room(resident, room, plain)
    window = window_bytes(room - resident, plain)
    libraries = mapped_file_bytes(exclude=path)  # (free_memory's: they stay mapped as they are)

    def fit(resident_bytes: int, held: int) -> int | None:  # the window the memory free now allows (refit)
        if streamed.streamer.locked:
            free = free_beside_locked(resident_bytes)
        else:  # the resident set's pages are page cache never dropped, which both measures count as free
            unlocked = free_beside_locked(0)
            free = None if unlocked is None else unlocked - resident_bytes
        if free is None:
            return None
        return window_bytes(free + held - libraries - streamed.kv_reserve, plain)

    streamed = WindowedTarget(target, path, window, resident, kv_cells, kv_cell_bytes, threads, fit)
    streamer = streamed.streamer
    if streamer.resident_bytes:
        how = "locked" if streamer.locked else "read once, never dropped (mlock was refused)"
        report(f"plan: {streamer.resident_bytes / 2**20:.0f} MiB of the target stay in RAM ({how}); "
               f"{streamer.streamed_bytes / 2**20:.0f} MiB stream from the drive every pass")
    when = "every pass" if plain or streamer.resident_bytes else "while a tree grows"
    report(f"plan: {when}, the target is read ahead up to {window / 2**20:.0f} MiB past its pass")
    return streamed


def on_ssd(target: Target, path: Path, readahead: bool) -> Target:
    """The target streamed from its file; refused when a pass does not read its weights from the mapping (a guard:
    the target is loaded without llama.cpp's repacked buffers, which copy e.g. Q4_0 weights into RAM on x86). A pass
    counts as reading the file when its pages are in the page cache after it, or when the process read that much
    from the drive during it (under a memory limit smaller than the file the pass's first pages are gone by its end)."""
    from edge.offload.ssd import SsdStreamer, SsdTarget, read_bytes, resident_fraction

    from edge.tree import TokenTree

    probe = SsdStreamer(path, readahead=False)
    probe.evict()
    before = read_bytes()
    target.verify(TokenTree.root(max(target.special.bos, 0)))  # a pass with logits: the head is read too
    after = read_bytes()
    size = max(path.stat().st_size, 1)
    read = (after - before) / size if before is not None and after is not None else 0.0
    touched = max(resident_fraction(path), read)
    target.truncate(0)
    probe.close()
    if touched < 0.5:
        target.close()
        raise UserError(f"placement ssd: a pass of {path.name} read only {touched:.0%} of the file (its runtime "
                        "copied the weights into RAM); rewrite the target as f16 or q8_0 (target_dtype)", "placement")
    return SsdTarget(target, path, readahead)


def _load_shared(spec: PairSpec, target_file: Path, drafter_file: Path, threads: int | None,
                 report: Report) -> tuple[Target, Drafter]:
    """A target and its drafter on one KV cache (QuantSpec: the target writes it, the drafter reads its nibbles)."""
    if spec.drafter.runtime != spec.target.runtime:
        raise UserError(f"pair {spec.name}: a {spec.target.runtime} target shares its KV cache with its drafter, "
                        f"which must run on the same runtime (drafter.runtime = \"{spec.target.runtime}\")")
    options = ModelOptions(n_ctx=spec.ctx, threads=threads, provider=spec.target.provider,
                           derived_dir=graph_folder(target_file), reserve=ensure_space)
    return runtime(spec.target.runtime).open_shared(target_file, drafter_file, options, head_ids(spec, spec.drafter),
                                                    report)
