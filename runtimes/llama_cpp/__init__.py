"""llama.cpp runtime: GGUF targets and drafters through llama-cpp-python's low-level API."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtimes.gguf_file import check_gguf
from runtimes.llama_cpp._native import (
    KV_TYPES,
    MAX_SEQ,
    Context,
    Model,
    default_threads,
    quantize,
    supports_gpu_offload,
)
from runtimes.llama_cpp.kernels import keeps_repacking, lossless_guarantee, prefer_tiled
from runtimes.llama_cpp.models import PENDING_ROOM, LlamaDrafter, LlamaTarget

__all__ = ["KV_TYPES", "LlamaDrafter", "LlamaTarget", "Model", "RunOptions", "default_threads", "keeps_repacking",
           "load_drafter", "load_target", "lossless_guarantee", "prefer_tiled", "quantize", "supports_gpu_offload"]


@dataclass(frozen=True)
class RunOptions:
    n_ctx: int = 4096
    kv_type: str = "f16"
    n_threads: int | None = None
    n_gpu_layers: int = 0
    use_mmap: bool = True
    use_mlock: bool = False
    # False: every weight is used from the file's mapping, never copied into llama.cpp's repacked buffers (its
    # faster Q4_0 kernels on x86 need such a RAM copy): a target streamed from the drive, which cannot fit in RAM.
    repack: bool = True


def _load_model(path: Path, options: RunOptions) -> Model:
    check_gguf(path)  # a clear error for missing, foreign or truncated files before llama.cpp sees them
    return Model(path, n_gpu_layers=options.n_gpu_layers, use_mmap=options.use_mmap, use_mlock=options.use_mlock,
                 repack=options.repack)


def load_target(path: Path, options: RunOptions, max_tree: int = MAX_SEQ) -> LlamaTarget:
    """A target verifying trees of up to `max_tree` nodes a pass. Its logits take max_tree rows of the vocabulary
    (2049 x 262144 float32 are 2 GB), so size it for the budget the run uses (LlamaTarget.enlarge grows it)."""
    model = _load_model(path, options)
    # The batch also carries the previous round's accepted tokens (see LlamaTarget); only tree nodes output.
    ctx = Context(model, options.n_ctx, n_batch=max_tree + PENDING_ROOM, kv_type=options.kv_type,
                  n_threads=options.n_threads, flash_attn=True, n_outputs=max_tree)
    return LlamaTarget(model, ctx, max_tree)


def load_drafter(path: Path, options: RunOptions, expand_capacity: int = MAX_SEQ - 1) -> LlamaDrafter:
    """A drafter that runs up to `expand_capacity` nodes a round (the root included)."""
    model = _load_model(path, options)
    # Room past the target's context for the round's expanded nodes, which the drafter caches until commit.
    ctx = Context(model, options.n_ctx + expand_capacity + 1, n_batch=MAX_SEQ, kv_type=options.kv_type,
                  n_threads=options.n_threads)
    return LlamaDrafter(model, ctx, options.kv_type, expand_capacity)
