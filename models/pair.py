"""Assembling a pair: from load options (a pair of models.toml, or GGUF paths) to a target and a drafter loaded,
checked against each other and placed where the plan puts them. `edge.load` is `open_pair` here.

Runtimes are looked up by name (runtimes.runtime) and imported only when a model of theirs loads.
"""

from __future__ import annotations

import errno
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.chat import Prompt, prompt_tokens
from edge.chat_template import ChatTemplate
from edge.errors import UserError
from edge.generate import Decoder
from edge.grow import MAX_LEAVES, GrowConfig
from edge.options import LoadOptions
from edge.protocols import Drafter, Target
from edge.sampling import CHAT_DEFAULTS, SamplingConfig
from models.cache import JsonFile, atomic_path, cache_dir, clean_stale, ensure_space
from models.registry import ModelSpec, PairSpec, Registry, Source, load_registry
from models.sources import download_folder, fetch, model_path, prepared_path, source_path, vocab_path
from runtimes import runtime

if TYPE_CHECKING:
    from offload.tuning import AutoBudget, Costs

Report = Callable[[str], None]

NESTED = "· "  # load_seconds keys of phases that ran inside the one before (their times overlap)
COSTS_VERSION = "costs 4"  # bumped when what the cached pass times measure changes (tree shapes, eviction, sizes)
# Timing passes for --budget auto needs some context; what it says does not matter.
CALIBRATION_TEXT = "The committee met on Tuesday to review the budget, and after a long discussion it agreed to"


def _quiet(_message: str) -> None:
    pass


@dataclass(eq=False)
class Pair:
    """A loaded target and drafter, ready to decode. Close it (or use `with`) to free their native memory."""

    name: str
    target: Target
    drafter: Drafter | None
    template: ChatTemplate | None  # None: a base model, prompts are completed as they are
    budget: int | str  # draft nodes per tree, or "auto"
    lossless_warning: str | None  # why this target's output may differ from plain decoding, if it may
    spec: PairSpec
    options: LoadOptions
    models_file: Path | None = None  # the models.toml the pair came from
    drafter_threads: int | None = None  # None: all cores
    sampling: SamplingConfig = CHAT_DEFAULTS  # chat's and the server's: the model's recommended, else llama.cpp's
    costs: Costs | None = None  # measured pass times for --budget auto, once per load
    load_seconds: dict[str, float] = field(default_factory=dict)  # where loading took its time, by phase
    report: Report = field(default=_quiet, repr=False)
    streamed: bool = False  # the plan put the target on the drive (larger than RAM): the kernel streams it
    _decoder: Decoder | None = field(default=None, repr=False)
    _decoder_key: tuple | None = field(default=None, repr=False)

    @property
    def placement(self) -> str:
        """"ssd" where the target is read from its file every pass: larger than RAM (the kernel evicts it), or
        --placement ssd (edge-spec evicts it after each pass); else "ram"."""
        return "ssd" if self.streamed else self.options.placement

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the models' native memory (llama.cpp contexts and weights, onnxruntime sessions)."""
        for model in (self.drafter, self.target):
            if model is not None:
                model.close()
        self.drafter = None
        self._decoder = self._decoder_key = None

    def prompt_tokens(self, prompt: Prompt, raw: bool | None = None) -> list[int]:
        """Token ids for a prompt: chat messages rendered with the pair's template; text in the template too, unless
        `raw` (completed as it is; None: raw only for a base model, which has no template); token ids as they are."""
        tokenizer = self.target.tokenizer
        if not isinstance(prompt, str) and all(isinstance(token, Integral) for token in prompt):
            return [int(token) for token in prompt]  # type: ignore[arg-type]
        if isinstance(prompt, str):
            if raw or (raw is None and self.template is None):
                return tokenizer.tokenize(prompt, add_special=True, parse_special=True)
            messages: list[Mapping[str, str]] = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)  # type: ignore[arg-type]
            if raw:
                raise UserError("chat messages are rendered with the pair's chat template; give text to complete raw")
        if self.template is None:
            raise UserError(f"{self.name} has no chat template (a base model): pass --raw to complete the prompt "
                            "as-is (raw=True in Python)")
        return prompt_tokens(tokenizer, self.template.render(_messages(messages)), self.template.bos_token)

    def decoder(self, sampling: SamplingConfig, speculate: bool = True, budget: int | str | None = None) -> Decoder:
        """A new Decoder for this pair: plain without `speculate`, a fixed budget, or --budget auto's policy."""
        budget = self.budget if budget is None else budget
        if not speculate or self.drafter is None:
            return Decoder(self.target, None, None, sampling)
        if budget != "auto":
            self.fit_budget(int(budget))
            return Decoder(self.target, self.drafter, GrowConfig.for_budget(int(budget)), sampling,
                           accept=self.options.accept)
        return Decoder(self.target, self.drafter, None, sampling, policy=self.auto_budget(), accept=self.options.accept)

    def reused_decoder(self, sampling: SamplingConfig, speculate: bool = True,
                       budget: int | str | None = None) -> Decoder:
        """The pair's decoder, kept from call to call while the tree policy stays the same: the KV caches still hold
        the last prompt and reply, so a prompt that extends them (a chat's next turn) runs only its new tokens."""
        key = (speculate, self.budget if budget is None else budget)
        if self._decoder is None or key != self._decoder_key:
            self._decoder, self._decoder_key = self.decoder(sampling, speculate, budget), key
        else:
            self._decoder.set_sampling(sampling)
        return self._decoder

    def fit_budget(self, budget: int) -> None:
        """Room for trees of `budget` draft nodes: a llama.cpp target and drafter get a larger batch and KV room over
        the same weights (their caches start empty), sized for what is asked, not for every run (a 2049-node batch
        over Gemma's 262144-token vocabulary holds 2 GB of logits). An onnx target verifies 256 nodes at most."""
        from offload.tuning import fit_trees

        before = self.target.max_tree
        if budget + 1 <= before and (self.drafter is None or budget <= self.drafter.expand_capacity):
            return
        if not fit_trees(self.target, self.drafter, budget + 1):
            raise UserError(budget_refused(self.name, budget, before))
        self._decoder = self._decoder_key = None  # the caches were emptied

    def auto_budget(self) -> AutoBudget:
        """--budget auto's policy; its pass times are measured once per machine, placement and pair (cached)."""
        from offload.tuning import AutoBudget, Costs, budget_limit, measure_costs

        if self.costs is None:
            with _phase(self.load_seconds, "pass times (--budget auto)"):
                key, cache = self._costs_key(), JsonFile(cache_dir() / "pass-times.json")
                known = cache.read()
                if key is not None and key in known:
                    with suppress(KeyError, TypeError, ValueError, AttributeError):  # a damaged entry is measured again
                        self.costs = Costs.from_json(known[key])
                if self.costs is None:
                    self.report("timing the target's and the drafter's passes for --budget auto (once for this "
                                "machine and pair; kept in the cache)")
                    prefix = self.target.tokenizer.tokenize(CALIBRATION_TEXT, add_special=True, parse_special=False)
                    self.costs = measure_costs(self.target, self.drafter, prefix, self.target.max_tree)
                    if key is not None:
                        cache.write(_newest({**known, key: {**self.costs.to_json(), "measured": time.time()}}))
        self.fit_budget(budget_limit(self.costs))  # the larger trees its measured flat passes allow
        return AutoBudget(self.costs)

    def swap_drafter(self, runtime_name: str | None = None, vocab: int | None = None, quantize: str | None = None,
                     report: Report = _quiet) -> Drafter:
        """Close the pair's drafter and open the same file as another drafter: on another runtime, with a
        `vocab`-token head (onnx; 0: the full head), or requantized. One drafter at a time: idle llama.cpp thread
        pools slow the others down. Benchmarks compare drafters this way."""
        if self.spec.target.runtime == "onnx":
            raise UserError("another drafter needs a pair with a llama.cpp target (QuantSpec pairs have one drafter)")
        model = _drafter_model(self.spec.drafter, runtime_name, vocab, quantize)
        head_ids(self.spec, model)  # a missing vocabulary fails before the pair's drafter is closed
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None
        self._decoder = self._decoder_key = None
        self.costs = None
        self.drafter = open_drafter(self.spec, model, self.target.model.path, self.drafter_threads, 0, report,
                                    max_tree=self.target.max_tree)
        return self.drafter

    def _costs_key(self) -> str | None:
        from offload.probe import machine_key

        path = model_path(self.spec.target)
        if path is None or not path.is_file() or self.drafter is None:
            return None
        stat = path.stat()
        drafter = f"{type(self.drafter).__name__}:{self.drafter.vocab}"
        streamer = getattr(self.target, "streamer", None)  # offload.ssd.SsdTarget
        readahead = None if streamer is None else streamer.readahead
        return (f"{machine_key(path)}|{path.name}|{stat.st_size}|{stat.st_mtime_ns}|{drafter}|{self.placement}|"
                f"readahead {readahead}|drafter threads {self.drafter_threads}|{COSTS_VERSION}")


PASS_TIMES_KEPT = 64  # pass-times.json keeps the newest entries: one is made per machine, placement and file


def tree_nodes(budget: int | str) -> int:
    """Nodes a verify pass must hold for `budget`: 256 for auto (it enlarges the target where larger trees can pay,
    Pair.auto_budget) and any budget within llama.cpp's sequence ids; the budget and the root past that."""
    return int(budget) + 1 if budget != "auto" and int(budget) > MAX_LEAVES else MAX_LEAVES + 1


def budget_refused(name: str, budget: int, max_tree: int) -> str:
    return (f"--budget {budget}: {name} verifies at most {max_tree} nodes a pass (an onnx target, QuantSpec); use "
            f"--budget {max_tree - 1} or less, or auto")


def _newest(entries: dict[str, Any]) -> dict[str, Any]:
    """The PASS_TIMES_KEPT most recently measured entries (entries without a date count as oldest)."""
    def measured(item: tuple[str, Any]) -> float:
        value = item[1].get("measured") if isinstance(item[1], dict) else None
        return float(value) if isinstance(value, int | float) else 0.0

    return dict(sorted(entries.items(), key=measured)[-PASS_TIMES_KEPT:])


def _messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Chat messages as the template expects them: role and content strings."""
    checked = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise UserError("a chat message is a {\"role\": ..., \"content\": ...} mapping of strings "
                            f"(got {message!r:.80})")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


def open_pair(options: LoadOptions, report: Report = _quiet) -> Pair:
    """Load the pair that `options` names, where the plan puts it (edge.load)."""
    times: dict[str, float] = {}
    with _phase(times, "models.toml and plan"):
        spec, models_file = resolve_spec(options)
        planned = planned_target(spec, models_file, report)  # None until a model file is here (fetched first)
    return load_pair(spec, options, report, models_file, times, planned)


@contextmanager
def _phase(times: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's wall time to times[name]: start-up is measured by phase (benchmarks/startup.py)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + time.perf_counter() - start


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
    if spec.drafter.runtime == SELF_DRAFT and (here := model_path(spec.drafter)) is not None and here.is_file():
        spec = replace(spec, drafter=replace(spec.drafter, runtime=self_draft_runtime(here)))
    if options.ctx:
        spec = replace(spec, ctx=options.ctx)
    if options.provider is not None:  # overrides models.toml for every ONNX model of the pair
        spec = replace(spec, target=replace(spec.target, provider=options.provider),
                       drafter=replace(spec.drafter, provider=options.provider))
    if options.target_dtype is not None:
        quantize = None if options.target_dtype == "as-is" else options.target_dtype
        spec = replace(spec, target=replace(spec.target, quantize=quantize))
    if options.drafter_runtime or options.drafter_vocab is not None or options.drafter_quantize:
        spec = replace(spec, drafter=_drafter_model(spec.drafter, options.drafter_runtime, options.drafter_vocab,
                                                    options.drafter_quantize))
    if options.placement == "ssd" and spec.target.runtime == "onnx":
        raise UserError("--placement ssd streams a llama.cpp target from its file: not with an onnx target")
    return spec, models_file


def _drafter_model(model: ModelSpec, runtime_name: str | None, vocab: int | None, quantize: str | None) -> ModelSpec:
    runtime_name = runtime_name or model.runtime
    if vocab is None:
        vocab = model.vocab if runtime_name == "onnx" else None
    if vocab and runtime_name != "onnx":
        raise UserError("a trimmed drafter head (a vocabulary size) needs the onnx drafter runtime")
    return replace(model, runtime=runtime_name, vocab=vocab or None, quantize=quantize or model.quantize)


# A model named where it is used: user/repo:QUANT, with hf.co/ or huggingface.co/ before it (as ollama and
# llama.cpp's -hf take them). Without :QUANT, Q4_K_M, as theirs.
_HF_REFERENCE = re.compile(r"^(?:https?://)?(?:hf\.co/|huggingface\.co/)?([\w.-]+/[\w.-]+)(?::(\S+))?$")
SELF_DRAFT = "self"  # a drafter runtime decided at load: onnx where its graph builder knows the architecture


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
    the target drafts for itself: on ONNX Runtime (int4, a 4-bit KV cache) as the shipped pairs do, where the
    graph builder knows its architecture, else on llama.cpp."""
    target_source = model_source(target, registry)
    target_spec = ModelSpec(target_source, kv_type="bf16")
    if drafter is None:
        drafter_spec = ModelSpec(target_source, kv_type="q4_0", runtime=SELF_DRAFT)
    else:
        drafter_spec = ModelSpec(model_source(drafter, registry), kv_type="q4_0")
    name = target_source.path.name if target_source.path is not None else str(target_source.hf)
    return PairSpec(name=name, about="named on the command line", target=target_spec, drafter=drafter_spec, ctx=ctx)


def self_draft_runtime(drafter_file: Path) -> str:
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


def materialize(spec: ModelSpec, report: Report = _quiet) -> Path:
    """Fetch the model's source and prepare it if needed; returns the file to load. What killed runs left behind
    (temporary files, half-built graphs) is cleaned first."""
    for folder in ("models", "prepared"):
        clean_stale(cache_dir() / folder)
    here = source_path(spec.source)
    if spec.facts is not None and (here is None or not here.exists()):  # a download whose size models.toml gives
        name = Path(spec.source.describe()).name  # "model.gguf", or "repo-GGUF:Q4_0" for a hub quant
        ensure_space(here or download_folder(spec.source) / name, int(spec.facts.size_gb * 1e9))
    source = fetch(spec.source, report)
    if not spec.quantize:
        return source
    dest = prepared_path(spec)
    assert dest is not None
    if not dest.exists():
        report(f"preparing {dest.name} ({spec.quantize}, llama.cpp quantizer)")
        with atomic_path(dest, _quantized_size(source, spec.quantize)) as tmp:
            runtime("llama_cpp").quantize(source, tmp, spec.quantize)
    return dest


# Bits per weight of llama.cpp's file types (the k-quants' mixes on average), to size a requantized file.
BITS_PER_WEIGHT = {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5, "q5_0": 5.5, "q5_1": 6,
                   "q2_k": 2.6, "q3_k_s": 3.5, "q3_k_m": 3.9, "q3_k_l": 4.3, "q4_k_s": 4.6, "q4_k_m": 4.9,
                   "q5_k_s": 5.5, "q5_k_m": 5.7, "q6_k": 6.6}


def _quantized_size(source: Path, ftype: str) -> int:
    from runtimes.gguf_file import check_gguf

    return int(check_gguf(source).n_params * BITS_PER_WEIGHT.get(ftype, 32) / 8)


def load_pair(spec: PairSpec, options: LoadOptions, report: Report = _quiet, models_file: Path | None = None,
              times: dict[str, float] | None = None, planned: PlannedTarget | None = None) -> Pair:
    """Load `spec` (already resolved: resolve_spec) with `options`' placement, threads and budget, where `planned`
    (planned_target; made here once the files are) puts the target; `times` gathers the seconds of each phase.

    A target the plan streams is used from its file's mapping: the kernel reads it on every pass and evicts it.
    placement "ssd": the same for a target that would fit, its pages evicted after every pass (offload/ssd.py)."""
    from runtimes.gguf_file import check_gguf, lossless_guarantee

    times = {} if times is None else times
    with _phase(times, "model files"):
        target_file = materialize(spec.target, report)
        info = check_gguf(target_file)
        drafter_file = materialize(spec.drafter, report)  # here, not beside the target's load: one download at a time
    if planned is None:
        with _phase(times, "plan"):
            planned = planned_target(spec, models_file, report) or PlannedTarget(0, False)
    if options.gpu_layers is None:
        options = replace(options, gpu_layers=planned.gpu_layers)
    if spec.drafter.runtime == SELF_DRAFT:
        spec = replace(spec, drafter=replace(spec.drafter, runtime=self_draft_runtime(drafter_file)))
    draft_threads = drafter_threads(options.threads, options.placement, options.readahead)
    budget = spec.budget if options.budget is None else options.budget
    nodes = tree_nodes(budget)
    if spec.target.runtime == "onnx" and nodes > MAX_LEAVES + 1:  # refused before anything loads
        raise UserError(budget_refused(spec.name, int(budget), MAX_LEAVES + 1))
    streamed = planned.streamed and spec.target.runtime != "onnx"
    if spec.target.runtime == "onnx":
        with _phase(times, "target and drafter (QuantSpec)"):
            target, drafter = _load_quantspec(spec, target_file, options.threads, report)
        warning = None
    else:
        target, drafter = _load_side_by_side(spec, options, target_file, draft_threads, report, times, nodes,
                                             repack=not (streamed or options.placement == "ssd"))
        if options.placement == "ssd":
            try:
                with _phase(times, "ssd placement check"):
                    target = on_ssd(target, target_file, options.readahead)
            except BaseException:
                drafter.close()
                raise
        warning = lossless_guarantee(info, spec.target.kv_type)
        if target.n_ctx != spec.ctx:
            report(f"context: {target.n_ctx} tokens, not {spec.ctx} (llama.cpp sizes contexts in steps of 256)")
    with _phase(times, "chat template"):
        template = _template(info.chat_template, target)
    return Pair(spec.name, target, drafter, template, budget, warning, spec, options, models_file, draft_threads,
                sampling=chat_sampling(target_file, report), load_seconds=times, report=report, streamed=streamed)


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
    with _phase(times, "target and drafter, side by side"), \
            ThreadPoolExecutor(1, thread_name_prefix="edge-spec-drafter") as pool:
        future = pool.submit(open_drafter, spec, spec.drafter, target_file, draft_threads, options.gpu_layers or 0,
                             report, beside, max_tree)
        try:
            with _phase(beside, "target"):
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


def open_drafter(spec: PairSpec, model: ModelSpec, target_file: Path, threads: int | None, gpu_layers: int,
                 report: Report = _quiet, times: dict[str, float] | None = None,
                 max_tree: int = MAX_LEAVES + 1) -> Drafter:
    """The drafter `model` (the pair's, or another for a comparison) for the llama.cpp target in `target_file`,
    refused when it does not speak the target's token ids; it grows trees of up to `max_tree` nodes."""
    from runtimes.gguf_file import check_same_vocab

    times = {} if times is None else times
    drafter_file = materialize(model, report)
    with _phase(times, "vocabulary check"):
        check_same_vocab(target_file, drafter_file)
    with _phase(times, "drafter"):
        if model.runtime == "onnx":
            onnx = runtime("onnx")
            options = onnx.OnnxOptions(provider=model.provider, threads=threads, n_ctx=spec.ctx + 256,
                                       graph_dir=graph_folder(drafter_file))
            head = head_ids(spec, model)
            graph = onnx.graph_path(drafter_file, "drafter", head, options.graph_dir)
            if not graph.exists():  # built once from the GGUF's weights: its data takes up to twice the file
                ensure_space(graph, 2 * drafter_file.stat().st_size)
            try:
                return onnx.load_drafter(drafter_file, options, head, report)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                raise UserError(f"the drive filled up building {graph}; free some space (or set EDGE_SPEC_CACHE "
                                "to another drive) and run again") from None
        llama = runtime("llama_cpp")
        options = llama.RunOptions(n_ctx=spec.ctx, kv_type=model.kv_type, n_threads=threads, n_gpu_layers=gpu_layers)
        return llama.load_drafter(drafter_file, options, max_tree - 1)


def graph_folder(model_file: Path) -> Path | None:
    """Where a model's ONNX graphs go: beside it when edge-spec's cache holds it (None), else in the cache's
    prepared/graphs (a user's own file or a Hugging Face snapshot: folders that are not ours to write in)."""
    cache = cache_dir()
    if model_file.absolute().parent.resolve().is_relative_to(cache.resolve()):
        return None
    folder = cache / "prepared" / "graphs"
    folder.mkdir(parents=True, exist_ok=True)
    clean_stale(folder)
    return folder


def head_ids(spec: PairSpec, model: ModelSpec) -> Any:
    """The frequency-ranked token ids a trimmed drafter head keeps (None: the full head)."""
    if not model.vocab:
        return None
    from quant.vocab import RankedVocab

    path = vocab_path(spec.target, model.vocab)
    if not path.exists():
        raise UserError(f"pair {spec.name}: no {model.vocab}-token vocabulary yet; "
                        f"run `edge-spec prepare {spec.name} --vocab {model.vocab}` (one target run over the "
                        "calibration prompts)")
    return RankedVocab.load(path).ids


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
