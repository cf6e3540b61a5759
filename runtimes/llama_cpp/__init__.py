"""llama.cpp runtime: GGUF targets and drafters through llama-cpp-python's low-level API."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from edge.offload.pass_pages import PassPages
from edge.runtimes import ModelOptions, Report
from edge.runtimes.gguf_file import check_gguf
from edge.runtimes.llama_cpp._native import (
    KV_TYPES,
    MAX_SEQ,
    USE_EXTRA_BUFFERS,
    Context,
    Model,
    default_threads,
    quantize,
)
from edge.runtimes.llama_cpp.devices import backend_line, devices, gpu_devices
from edge.runtimes.llama_cpp.kernels import (
    TILED_MIN_ROWS,
    chains_only,
    gpu_guarantee,
    keeps_repacking,
    lossless_guarantee,
    min_rows,
    prefer_stock,
    prefer_tiled,
    repack_rows,
)
from edge.runtimes.llama_cpp.models import PENDING_ROOM, LayerListener, LlamaDrafter, LlamaTarget, PlainTarget

STOCK_BATCH = 512  # llama.cpp's default n_ubatch: the batches a stock target runs a prompt in
# ... and a streamed one's: a pass commits compute memory by its batch, and what a prompt's passes commit stays with the
# process, out of the stream's room (Qwen2.5-Coder-1.5B, 1024 tokens: 71 MiB in batches of 512, 21 of 128, 12 of
# 64). A streamed pass reads its weights whatever its batch; a prompt's arithmetic takes far longer than its few
# more passes' reading.
STREAMED_BATCH = 64

__all__ = ["KV_TYPES", "LlamaDrafter", "LlamaTarget", "Model", "RunOptions", "backend_line", "default_threads",
           "devices", "gpu_devices", "gpu_guarantee", "keeps_repacking",
           "load_drafter", "load_target", "lossless_guarantee", "open_drafter", "open_shared", "open_target",
           "prefer_tiled", "quantize", "tokenizer"]


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
    # a target's passes say as each layer is computed (LlamaTarget.follow_layers): a streamed target's read-ahead
    # follows them; it costs one synchronization a layer, so only a streamed target has it
    layer_progress: bool = False
    flash_attn: bool | None = True  # None: llama.cpp's default (on where the backend has it)
    min_rows: int = 1  # a tree target's passes carry at least this many rows (kernels.MIN_ROWS)
    chains_only: bool = False  # a tree target verifies each tree's likeliest path alone (kernels.CHAIN_BACKENDS)
    row_multiple: int = 1  # lanes over it pad their passes' rows and outputs to multiples of this (kernels.REPACK_ROWS)
    # plain lanes over it run the rows that output in a call of fewer rows than this, the others in one of this many
    # or more (kernels.TILED_MIN_ROWS; 1: one call a pass)
    split_rows: int = 1


def _load_model(path: Path, options: RunOptions) -> Model:
    check_gguf(path)  # a clear error for missing, foreign or truncated files before llama.cpp sees them
    return Model(path, n_gpu_layers=options.n_gpu_layers, use_mmap=options.use_mmap, use_mlock=options.use_mlock,
                 repack=options.repack)


def load_target(path: Path, options: RunOptions, max_tree: int = MAX_SEQ, sequences: int = MAX_SEQ) -> LlamaTarget:
    """A target verifying trees of up to `max_tree` nodes a pass, with `sequences` seq ids (a tree's leaves). Its
    logits take max_tree rows of the vocabulary (2049 x 262144 float32 are 2 GB), and never fewer than `sequences`,
    so size it for the budget the run uses (LlamaTarget.resize grows it)."""
    model = _load_model(path, options)
    layers = LayerListener() if options.layer_progress else None
    # The batch also carries the previous round's accepted tokens (see LlamaTarget); only tree nodes output.
    # op_offload off: a GPU build computes the layers left on the CPU on the GPU from 32-token batches (uploading
    # them), on other kernels than a one-token pass's (SmolLM2 with no layer on the GPU, Vulkan: 1.03 logits at 32
    # tokens with it, 0.0 without). A tree's CPU layers stay on the CPU's kernels.
    ctx = Context(model, options.n_ctx + options.min_rows - 1, n_batch=max(max_tree + PENDING_ROOM, options.min_rows),
                  kv_type=options.kv_type, n_threads=options.n_threads, flash_attn=options.flash_attn,
                  n_outputs=max(max_tree, options.min_rows), on_layer=layers, sequences=sequences,
                  op_offload=False)
    target = LlamaTarget(model, ctx, max_tree, layers, options.min_rows, options.row_multiple, options.chains_only)
    target.split_rows = options.split_rows
    return target


def load_drafter(path: Path, options: RunOptions, expand_capacity: int = MAX_SEQ - 1) -> LlamaDrafter:
    """A drafter that runs up to `expand_capacity` nodes a round (the root included)."""
    model = _load_model(path, options)
    # Room past the target's context for the round's expanded nodes, which the drafter caches until commit.
    ctx = Context(model, options.n_ctx + expand_capacity + 1, n_batch=MAX_SEQ, kv_type=options.kv_type,
                  n_threads=options.n_threads)
    return LlamaDrafter(model, ctx, options.kv_type, expand_capacity)


def _run_options(options: ModelOptions) -> RunOptions:
    # mlock locks the whole mapping: never for a streamed target, whose resident part offload/window.py locks
    return RunOptions(n_ctx=options.n_ctx, kv_type=options.kv_type, n_threads=options.threads,
                      n_gpu_layers=options.gpu_layers, use_mlock=options.mlock and not options.streamed,
                      repack=not options.streamed,
                      layer_progress=options.streamed)


def open_target(path: Path, options: ModelOptions, max_tree: int) -> LlamaTarget:
    """The Runtime interface's target, on the batch-invariant kernel that is the faster where it runs, and with
    repacked buffers only where they stay batch-invariant (kernels.py). A `stock` target (plain decoding alone) loads
    as llama.cpp loads it by default: its kernels by batch size, repacked buffers wherever it fits in RAM."""
    if options.stock:
        prefer_stock()
        run = replace(_run_options(options), flash_attn=None)
        model = _load_model(path, run)
        layers = LayerListener() if run.layer_progress else None  # streamed: its layers are followed
        # llama.cpp's default micro-batch (a prompt runs in such batches); one row of logits a pass
        batch = STREAMED_BATCH if options.streamed else STOCK_BATCH
        ctx = Context(model, run.n_ctx, n_batch=batch, kv_type=run.kv_type, n_threads=run.n_threads,
                      flash_attn=run.flash_attn, n_outputs=1, on_layer=layers, sequences=1, threadpool=True)
        target = PlainTarget(model, ctx, 1, layers)
        if options.lock_pass_pages:
            target.pass_pages = PassPages(path, reserve=ctx.released_bytes)  # its KV cache's pages, given back
        return target
    # lanes' passes carry a few tokens each, where the dot-product kernels are the faster, streamed or not
    prefer_tiled(options.streamed and not options.lanes)
    weight_types = check_gguf(path).weight_types
    repack = not options.streamed and keeps_repacking(weight_types)
    if options.lanes:  # its passes run in a server's lanes (Pair.lanes): one token, one sequence of its own
        # In RAM on the CPU, with llama.cpp's repacked buffers where it has them, its GEMM taking every row: the
        # lanes pad each pass to its rows (kernels.REPACK_ROWS); the other K-quants on the dot-product kernels. Where
        # no pass is padded and the lanes decode plainly, on llama.cpp's kernels by rows: the prompts' rows on the
        # tiled one, in calls of their own (split_rows).
        repack = not options.streamed and not options.gpu_layers
        multiple = repack_rows(weight_types) if repack and USE_EXTRA_BUFFERS else 1
        split = TILED_MIN_ROWS if repack and multiple == 1 and options.plain and options.lanes < TILED_MIN_ROWS else 1
        if split > 1:
            prefer_stock()
        return load_target(path, replace(_run_options(options), repack=repack, row_multiple=multiple,
                                         split_rows=split), 1, sequences=1)
    backend = gpu_devices()[0].backend if options.gpu_layers and gpu_devices() else None
    return load_target(path, replace(_run_options(options), repack=repack,
                                     min_rows=min_rows(options.gpu_layers, backend),
                                     chains_only=chains_only(options.gpu_layers, backend)), max_tree)


def open_drafter(path: Path, options: ModelOptions, max_tree: int, head_ids=None,
                 report: Report | None = None) -> LlamaDrafter:
    if head_ids is not None:
        from edge.errors import UserError

        raise UserError("llama.cpp computes a drafter's whole head: a trimmed vocabulary needs another runtime")
    return load_drafter(path, _run_options(options), max_tree - 1)


def open_shared(target: Path, drafter: Path, options: ModelOptions, head_ids=None, report: Report | None = None):
    raise NotImplementedError("llama.cpp models keep their own KV caches (traits: shared_cache is False)")


def tokenizer(path: Path) -> Model:
    """A model file's vocabulary alone: tokenizing and its special tokens, no weights read."""
    check_gguf(path)
    return Model(path, vocab_only=True)
