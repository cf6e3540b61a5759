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
    target: LlamaTarget
    drafter: LlamaDrafter
    template: ChatTemplate | None
    budget: int
    lossless_warning: str | None  # why this target's output may differ from plain decoding, if it may


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
              budget: int | None = None) -> LoadedPair:
    from runtimes.gguf_file import check_gguf, lossless_guarantee
    from runtimes.llama_cpp import RunOptions, check_same_vocab, load_drafter, load_target

    target_file = materialize(spec.target, report)
    drafter_file = materialize(spec.drafter, report)
    def options(model: ModelSpec) -> RunOptions:
        return RunOptions(n_ctx=spec.ctx, kv_type=model.kv_type, n_threads=threads, n_gpu_layers=gpu_layers)

    target = load_target(target_file, options(spec.target))
    drafter = load_drafter(drafter_file, options(spec.drafter))
    check_same_vocab(target, drafter)
    info = check_gguf(target_file)
    template = _template(info.chat_template, target)
    budget = spec.budget if budget is None else budget
    return LoadedPair(spec.name, target, drafter, template, budget, lossless_guarantee(info, spec.target.kv_type))


def _template(source: str | None, target: LlamaTarget) -> ChatTemplate | None:
    if not source:
        return None
    model = target.model
    text = model.token_bytes(model.bos, special=True).decode("utf-8", "replace") if model.bos >= 0 else ""
    eos = model.token_bytes(model.eos, special=True).decode("utf-8", "replace") if model.eos >= 0 else ""
    return ChatTemplate(source, text, eos)
