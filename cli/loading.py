"""From a pair name (or two paths) to loaded, checked models. Runtimes are imported only here, lazily."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from edge.chat_template import ChatTemplate
from edge.errors import UserError
from edge.registry import ModelSpec, PairSpec, Registry, Source
from edge.sources import atomic_path, cache_dir, fetch, prepared_path, read_json, source_path, write_json

if TYPE_CHECKING:
    from runtimes.llama_cpp import LlamaDrafter, LlamaTarget


@dataclass
class LoadedPair:
    name: str
    target: LlamaTarget  # or an OnnxTarget (QuantSpec mode)
    drafter: LlamaDrafter  # or an OnnxDrafter
    template: ChatTemplate | None
    budget: int | str  # draft nodes per tree, or "auto"
    lossless_warning: str | None  # why this target's output may differ from plain decoding, if it may
    spec: PairSpec | None = None
    placement: str = "ram"  # where the target's weights stream from: "ram", or "ssd" (evicted after each pass)
    costs: object | None = None  # measured pass times for --budget auto (offload.tuning.Costs), once per load
    drafter_threads: int | None = None  # None: all cores

    def decoder(self, sampling, no_spec: bool = False, budget: int | str | None = None):
        """A Decoder for this pair: plain with no_spec, a fixed budget, or --budget auto's policy."""
        from edge.generate import Decoder
        from edge.grow import GrowConfig

        budget = self.budget if budget is None else budget
        if no_spec:
            return Decoder(self.target, None, None, sampling)
        if budget != "auto":
            return Decoder(self.target, self.drafter, GrowConfig.for_budget(int(budget)), sampling)
        return Decoder(self.target, self.drafter, None, sampling, policy=self.auto_budget())

    def auto_budget(self):
        """--budget auto's policy; its pass times are measured once per machine, placement and pair (cached)."""
        from offload.tuning import AutoBudget, Costs, measure_costs

        if self.costs is None:
            key, cache = self._costs_key(), cache_dir() / "pass-times.json"
            known = read_json(cache)
            if key is not None and key in known:
                self.costs = Costs.from_json(known[key])
            else:
                prefix = self.target.tokenizer.tokenize(CALIBRATION_TEXT, add_special=True, parse_special=False)
                self.costs = measure_costs(self.target, self.drafter, prefix, self.target.max_tree)
                if key is not None:
                    write_json(cache, {**known, key: self.costs.to_json()})
        return AutoBudget(self.costs)

    def _costs_key(self) -> str | None:
        from offload.probe import machine_key

        path = model_path(self.spec.target) if self.spec is not None else None
        if path is None or not path.is_file():
            return None
        stat = path.stat()
        drafter = f"{type(self.drafter).__name__}:{getattr(self.drafter, 'vocab', None)}"
        readahead = getattr(getattr(self.target, "streamer", None), "readahead", None)
        return (f"{machine_key(path)}|{path.name}|{stat.st_size}|{stat.st_mtime_ns}|{drafter}|{self.placement}|"
                f"readahead {readahead}|drafter threads {self.drafter_threads}|{COSTS_VERSION}")


COSTS_VERSION = "costs 3"  # bumped when what the cached pass times measure changes (tree shapes, eviction)
# Timing passes for --budget auto needs some context; what it says does not matter.
CALIBRATION_TEXT = "The committee met on Tuesday to review the budget, and after a long discussion it agreed to"
TARGET_DTYPES = ("f16", "f32", "bf16", "q8_0", "q4_0", "as-is")


def spec_for_paths(target: Path, drafter: Path | None, ctx: int) -> PairSpec:
    """A pair made from --target/--drafter paths; without a drafter, the target drafts for itself."""
    target_spec = ModelSpec(Source(path=target.expanduser()), kv_type="bf16")
    drafter_spec = ModelSpec(Source(path=(drafter or target).expanduser()), kv_type="q4_0")
    return PairSpec(name=target.name, about="from the command line", target=target_spec, drafter=drafter_spec,
                    ctx=ctx)


def resolve_pair(registry: Registry, pair: str | None, target: Path | None, drafter: Path | None,
                 ctx: int | None) -> PairSpec:
    if target is not None:
        return spec_for_paths(target, drafter, ctx or 4096)
    if drafter is not None:
        raise UserError("--drafter needs --target too (or pick a pair with --pair)")
    spec = registry.pair(pair)
    return replace(spec, ctx=ctx) if ctx else spec


def model_path(spec: ModelSpec) -> Path | None:
    """The file the runtime loads (the prepared one when the spec requantizes), without fetching."""
    return prepared_path(spec) if spec.quantize else source_path(spec.source)


def materialize(spec: ModelSpec, report) -> Path:
    """Fetch the model's source and prepare it if needed; returns the file to load."""
    source = fetch(spec.source, report)
    if not spec.quantize:
        return source
    dest = prepared_path(spec)
    assert dest is not None
    if not dest.exists():
        from runtimes.llama_cpp import quantize

        report(f"preparing {dest.name} ({spec.quantize}, llama.cpp quantizer)")
        with atomic_path(dest) as tmp:
            quantize(source, tmp, spec.quantize)
    return dest


def load_pair(spec: PairSpec, report, threads: int | None = None, gpu_layers: int = 0,
              budget: int | str | None = None, provider: str | None = None, placement: str = "ram",
              target_dtype: str | None = None, mlock: bool = False, readahead: bool = True) -> LoadedPair:
    """placement "ssd": the target is mmap'd and its pages evicted after every pass (offload/ssd.py);
    target_dtype rewrites the target with llama.cpp's quantizer first (cached), "as-is" loads the source."""
    from runtimes.gguf_file import check_gguf, lossless_guarantee
    from runtimes.llama_cpp import RunOptions, load_target

    if provider is not None:  # --provider overrides models.toml for every ONNX model of the pair
        spec = replace(spec, target=replace(spec.target, provider=provider),
                       drafter=replace(spec.drafter, provider=provider))
    if target_dtype is not None:
        if target_dtype not in TARGET_DTYPES:
            raise UserError(f"--target-dtype must be one of {', '.join(TARGET_DTYPES)} (got {target_dtype!r})")
        spec = replace(spec, target=replace(spec.target, quantize=None if target_dtype == "as-is" else target_dtype))
    if placement not in ("ram", "ssd"):
        raise UserError(f"--placement must be ram or ssd (got {placement!r})")
    if placement == "ssd" and (spec.target.runtime == "onnx" or mlock):
        raise UserError("--placement ssd streams a llama.cpp target from its file: not with an onnx target or --mlock")
    target_file = materialize(spec.target, report)
    info = check_gguf(target_file)
    draft_threads = drafter_threads(threads, placement, readahead)
    if spec.target.runtime == "onnx":
        target, drafter = _load_quantspec(spec, target_file, threads, report)
        warning = None
    else:
        options = RunOptions(n_ctx=spec.ctx, kv_type=spec.target.kv_type, n_threads=threads, n_gpu_layers=gpu_layers,
                             use_mlock=mlock)
        target = load_target(target_file, options)
        drafter = open_drafter(spec, spec.drafter, target, draft_threads, gpu_layers, report)
        warning = lossless_guarantee(info, spec.target.kv_type)
        if placement == "ssd":
            target = _on_ssd(target, target_file, readahead)
    template = _template(info.chat_template, target)
    budget = spec.budget if budget is None else budget
    return LoadedPair(spec.name, target, drafter, template, budget, warning, spec, placement,
                      drafter_threads=draft_threads)


def drafter_threads(threads: int | None, placement: str, readahead: bool) -> int | None:
    """The drafter's CPU threads: with the target streamed from the SSD and read ahead while the tree grows, one
    core is left to the readahead (on 2 cores, a drafter on both grew its trees no faster and delayed the reading
    into the target's pass; docs/performance.md)."""
    if threads is not None or placement != "ssd" or not readahead:
        return threads
    from runtimes.llama_cpp._native import default_threads

    return max(1, default_threads() - 1)


def _on_ssd(target, path: Path, readahead: bool):
    """The target streamed from its file; refused when a pass does not read its weights from the mapping
    (llama.cpp copies weights it repacks for faster kernels, e.g. Q4_0 on x86, and leaves the file mapped)."""
    from edge.tree import TokenTree
    from offload.ssd import SsdStreamer, SsdTarget, resident_fraction

    probe = SsdStreamer(path, readahead=False)
    probe.evict()
    target.verify(TokenTree.root(max(target.model.bos, 0)))  # a pass with logits: the head is read too
    touched = resident_fraction(path)
    target.truncate(0)
    probe.close()
    if touched < 0.5:
        target.close()
        raise UserError(f"--placement ssd: a pass of {path.name} read only {touched:.0%} of the file (llama.cpp "
                        "copied its weights into repacked buffers); use --target-dtype f16 or q8_0")
    return SsdTarget(target, path, readahead)


def open_drafter(spec: PairSpec, model: ModelSpec, target, threads: int | None, gpu_layers: int, report):
    """The pair's drafter (or another one, for bench --drafters) beside an already loaded llama.cpp target."""
    from runtimes.llama_cpp import RunOptions, check_same_vocab, load_drafter

    drafter_file = materialize(model, report)
    if model.runtime == "onnx":
        from runtimes.onnx import OnnxOptions
        from runtimes.onnx import load_drafter as load_onnx_drafter

        check_same_vocab(target, _VocabOnly(drafter_file))
        head = head_ids(spec, model)
        options = OnnxOptions(provider=model.provider, threads=threads, n_ctx=spec.ctx + 256)
        return load_onnx_drafter(drafter_file, options, head, report)
    options = RunOptions(n_ctx=spec.ctx, kv_type=model.kv_type, n_threads=threads, n_gpu_layers=gpu_layers)
    drafter = load_drafter(drafter_file, options)
    check_same_vocab(target, drafter)
    return drafter


def head_drafter(loaded, vocab: int | None):
    """The loaded pair's drafter, or, with `vocab`, its ONNX drafter with a `vocab`-token head in its place (the
    pair's own is closed first: one drafter at a time). For the benchmark scripts' --drafter-vocab."""
    if not vocab:
        return loaded.drafter
    getattr(loaded.drafter, "close", lambda: None)()
    from dataclasses import replace

    model = replace(loaded.spec.drafter, runtime="onnx", vocab=vocab)
    return open_drafter(loaded.spec, model, loaded.target, loaded.drafter_threads, 0, print)


class _VocabOnly:
    """A drafter file's vocabulary, for check_same_vocab, without a llama.cpp context."""

    def __init__(self, path: Path):
        from runtimes.llama_cpp._native import Model

        self.model = Model(path)


def head_ids(spec: PairSpec, model: ModelSpec):
    """The frequency-ranked token ids a trimmed drafter head keeps (None: the full head)."""
    if not model.vocab:
        return None
    from edge.sources import vocab_path
    from quant.vocab import RankedVocab

    path = vocab_path(spec.target, model.vocab)
    if not path.exists():
        raise UserError(f"pair {spec.name}: no {model.vocab}-token vocabulary yet; "
                        f"run `edge-spec prepare {spec.name} --vocab {model.vocab}` (one target run over the "
                        "calibration prompts)")
    return RankedVocab.load(path).ids


def _load_quantspec(spec: PairSpec, target_file: Path, threads: int | None, report):
    """QuantSpec mode: ONNX target and drafter sharing one hierarchical KV cache."""
    from runtimes.llama_cpp._native import Model
    from runtimes.onnx import OnnxOptions, load_quantspec

    if spec.drafter.runtime != "onnx":
        raise UserError(f"pair {spec.name}: an onnx target (QuantSpec mode) needs an onnx drafter "
                        "(drafter.runtime = \"onnx\")")
    drafter_file = materialize(spec.drafter, report)
    tokenizer = Model(target_file)  # tokenizer and chat-template tokens; the weights stay mapped, unused
    options = OnnxOptions(provider=spec.target.provider, threads=threads, n_ctx=spec.ctx)
    target, drafter = load_quantspec(target_file, drafter_file, options, tokenizer, tokenizer.eog_tokens(),
                                     head_ids(spec, spec.drafter), report)
    target.model = tokenizer
    return target, drafter


def _template(source: str | None, target: LlamaTarget) -> ChatTemplate | None:
    if not source:
        return None
    model = target.model
    text = model.token_bytes(model.bos, special=True).decode("utf-8", "replace") if model.bos >= 0 else ""
    eos = model.token_bytes(model.eos, special=True).decode("utf-8", "replace") if model.eos >= 0 else ""
    return ChatTemplate(source, text, eos)
