"""From a pair name (or two paths) to loaded, checked models. Runtimes are imported only here, lazily."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from edge.chat_template import ChatTemplate
from edge.errors import UserError
from edge.registry import ModelSpec, PairSpec, Registry, Source
from edge.sources import atomic_path, fetch, prepared_path, source_path

if TYPE_CHECKING:
    from runtimes.llama_cpp import LlamaDrafter, LlamaTarget


@dataclass
class LoadedPair:
    name: str
    target: LlamaTarget  # or an OnnxTarget (QuantSpec mode)
    drafter: LlamaDrafter  # or an OnnxDrafter
    template: ChatTemplate | None
    budget: int
    lossless_warning: str | None  # why this target's output may differ from plain decoding, if it may
    spec: PairSpec | None = None


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
              budget: int | None = None, provider: str | None = None) -> LoadedPair:
    from runtimes.gguf_file import check_gguf, lossless_guarantee
    from runtimes.llama_cpp import RunOptions, load_target

    if provider is not None:  # --provider overrides models.toml for every ONNX model of the pair
        spec = replace(spec, target=replace(spec.target, provider=provider),
                       drafter=replace(spec.drafter, provider=provider))
    target_file = materialize(spec.target, report)
    info = check_gguf(target_file)
    if spec.target.runtime == "onnx":
        target, drafter = _load_quantspec(spec, target_file, threads, report)
        warning = None
    else:
        options = RunOptions(n_ctx=spec.ctx, kv_type=spec.target.kv_type, n_threads=threads, n_gpu_layers=gpu_layers)
        target = load_target(target_file, options)
        drafter = open_drafter(spec, spec.drafter, target, threads, gpu_layers, report)
        warning = lossless_guarantee(info, spec.target.kv_type)
    template = _template(info.chat_template, target)
    budget = spec.budget if budget is None else budget
    return LoadedPair(spec.name, target, drafter, template, budget, warning, spec)


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
