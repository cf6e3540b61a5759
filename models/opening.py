"""Opening a pair's models, below the Pair that holds them: a model's file fetched and prepared (materialize), a
drafter opened over its file and checked against the target's vocabulary (open_drafter: for loading, and for
Pair.swap_drafter), the token ids of a trimmed head, and the seconds each phase of loading takes.

Runtimes are looked up by name (runtimes.runtime) and imported only when a model of theirs loads.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from edge.models.cache import atomic_path, cache_dir, clean_stale, ensure_space, one_at_a_time
from edge.models.registry import ModelSpec, PairSpec
from edge.models.sources import download_folder, fetch, prepared_path, source_path, vocab_path
from edge.runtimes import ModelOptions, names, runtime, tools, traits

from edge.errors import Remedy, UserError
from edge.grow import MAX_LEAVES
from edge.protocols import Drafter

Report = Callable[[str], None]


def _quiet(_message: str) -> None:
    pass


@contextmanager
def phase(times: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's wall time to times[name]: start-up is measured by phase (benchmarks/startup.py)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + time.perf_counter() - start


def drafter_model(model: ModelSpec, runtime_name: str | None, vocab: int | None, quantize: str | None) -> ModelSpec:
    runtime_name = runtime_name or model.runtime
    trims = runtime_name in names() and traits(runtime_name).trims_head  # decided at load: BY_ARCHITECTURE
    if vocab is None:
        vocab = model.vocab if trims else None
    if vocab and not trims:
        raise UserError(f"a trimmed drafter head (a vocabulary size) needs a drafter runtime that trims its head "
                        f"({', '.join(name for name in names() if traits(name).trims_head)})")
    return replace(model, runtime=runtime_name, vocab=vocab or None, quantize=quantize or model.quantize)


def materialize(spec: ModelSpec, report: Report = _quiet) -> Path:
    """Fetch the model's source and prepare it if needed; returns the file to load. What killed runs left behind
    (temporary files, half-built graphs) is cleaned first."""
    for folder in ("models", "prepared"):
        clean_stale(cache_dir() / folder)
    with one_at_a_time(spec.source.describe(), report):
        return _materialize(spec, report)


def _materialize(spec: ModelSpec, report: Report) -> Path:
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
        started = time.perf_counter()
        with atomic_path(dest, _quantized_size(source, spec.quantize)) as tmp:
            tools().quantize(source, tmp, spec.quantize)
        report(f"prepared {dest.name} in {time.perf_counter() - started:.1f} s (once: kept in the cache)")
    return dest


# Bits per weight of llama.cpp's file types (the k-quants' mixes on average), to size a requantized file.
BITS_PER_WEIGHT = {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5, "q5_0": 5.5, "q5_1": 6,
                   "q2_k": 2.6, "q3_k_s": 3.5, "q3_k_m": 3.9, "q3_k_l": 4.3, "q4_k_s": 4.6, "q4_k_m": 4.9,
                   "q5_k_s": 5.5, "q5_k_m": 5.7, "q6_k": 6.6}


def _quantized_size(source: Path, ftype: str) -> int:
    from edge.runtimes.gguf_file import check_gguf

    return int(check_gguf(source).n_params * BITS_PER_WEIGHT.get(ftype, 32) / 8)


def open_drafter(spec: PairSpec, model: ModelSpec, target_file: Path, threads: int | None, gpu_layers: int,
                 report: Report = _quiet, times: dict[str, float] | None = None,
                 max_tree: int = MAX_LEAVES + 1) -> Drafter:
    """The drafter `model` (the pair's, or another for a comparison) for the llama.cpp target in `target_file`,
    refused when it does not speak the target's token ids; it grows trees of up to `max_tree` nodes."""
    from edge.runtimes.gguf_file import check_same_vocab

    times = {} if times is None else times
    drafter_file = materialize(model, report)
    with phase(times, "vocabulary check"):
        check_same_vocab(target_file, drafter_file)
    with phase(times, "drafter"):
        derived = graph_folder(drafter_file) if traits(model.runtime).derives_files else None
        options = ModelOptions(n_ctx=spec.ctx, kv_type=model.kv_type, threads=threads, gpu_layers=gpu_layers,
                               provider=model.provider, derived_dir=derived, reserve=ensure_space,
                               int4_block=model.int4_block or 0)
        try:
            return runtime(model.runtime).open_drafter(drafter_file, options, max_tree, head_ids(spec, model), report)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            raise UserError(f"the drive filled up preparing the drafter from {drafter_file}; free some space (or set "
                            "EDGE_SPEC_CACHE to another drive) and run again") from None


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
    from edge.quant.vocab import RankedVocab

    path = vocab_path(spec.target, model.vocab)
    if not path.exists():
        raise UserError(f"pair {spec.name}: no {model.vocab}-token vocabulary yet; prepare it first (one target run "
                        "over the calibration prompts)", remedy=Remedy("prepare", spec.name, (("vocab", model.vocab),)))
    return RankedVocab.load(path).ids
