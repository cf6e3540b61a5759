"""Which of llama.cpp's CPU kernels give a token the same logits alone and inside a tree pass, and the settings that
make K-quant weights do so. Speculation is exactly lossless only on such kernels (docs/lossless.md).

A matmul over K-quant weights (Q2_K..Q6_K and the IQ types) takes one of two kernels in ggml-cpu, by the number of
tokens in the batch: the dot-product kernels (ggml_vec_dot_*_q8_K) below 8 tokens, the tiled kernel
(ggml-cpu/tiled) from 8 (`ggml_tiled_min_batch`). They sum a row's super-blocks in different orders, so a token's
logits depend on how many tokens shared its pass: 0.5-0.6 logits on Qwen2.5-Coder-1.5B Q4_K_M, with argmax flips.
Either kernel alone is batch-invariant, so edge-spec runs one at every batch size:

- in RAM, the dot-product kernels (GGML_CPU_TILED_MM=0): a one-token pass as fast as stock llama.cpp's, a 64-token
  pass about twice the tiled kernel's;
- for a target streamed from the drive, the tiled kernel (GGML_CPU_TILED_MM_FORCE=1): it unpacks every weight on
  every call (+0.2 s a one-token pass of the 1.5B in RAM, +0.1 s from the drive) and is the fastest from 16 tokens,
  where trees pay.

Repacked weights (use_extra_bufts) have the same problem on x86 for Q4_K: a GEMV kernel below 4 tokens, a 4-row GEMM
from 4. A target with such weights loads without repacking, but for a server's lanes in RAM: they keep the repacked
buffers and pad each pass to multiples of 4 rows and outputs (REPACK_ROWS), in one KV cache (a pass one micro-batch),
so that every row takes the GEMM. Q4_0's repacked kernels gave equal logits at every
batch size (measured), so Q4_0 targets keep them.

Both switches are process-wide, and ggml reads them once, at its first matmul. This runtime sets the dot-product
kernels when it is imported (unless the environment chose), and a pair about to load a streamed target may switch
to the tiled one until a pass has run (prefer_tiled). What it sets it also writes in CHOSEN: a process it starts
inherits the switches, and while they are as CHOSEN says they are edge-spec's choice, not the user's, so that
process chooses again. (Without it, a stock target loaded in a child of a process that had imported this runtime
ran the dot-product kernels, and lost llama.cpp's text.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

FORCE_TILED = "GGML_CPU_TILED_MM_FORCE"
TILED = "GGML_CPU_TILED_MM"
CHOSEN = "EDGE_SPEC_KERNELS_CHOSEN"  # the switches as edge-spec set them: while so, not the environment's choice

# Types the tiled kernel computes (ggml_tiled_matmul_type_dispatch).
TILED_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                         "IQ3_S", "IQ1_S", "IQ1_M"})
# Weight types whose kernels gave bit-identical logits whatever the batch (llama-cpp-python 0.3.36, AMD EPYC
# AVX-512; `edge-spec check`, docs/lossless.md). Extend it only with a measurement.
BATCH_INVARIANT_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q8_0"})
# ... and these once every batch takes the tiled kernel (Q4_K, Q6_K shipped; Q2_K, Q3_K, Q5_K requantized).
TILED_INVARIANT_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
# Types whose repacked x86 kernels switch kernels with the batch size: a target holding any loads unrepacked.
REPACK_VARIANT_TYPES = frozenset({"Q4_K", "Q2_K", "IQ4_NL", "MXFP4"})
# x86 repacked kernels run a pass's rows in fours on a GEMM and the rest, one by one, on a GEMV (ggml-cpu repack.cpp,
# forward_mul_mat_one_chunk), which sum a row differently. A pass whose rows are a multiple of 4, and whose outputs
# too (its last layer runs on the output rows alone), runs every row on the GEMM: lanes pad theirs so (lane_padding).
REPACK_ROWS = 4
# The rows from which ggml-cpu takes the tiled kernel for a K-quant matmul unless a switch says otherwise
# (ggml-cpu/tiled: ggml_tiled_min_batch). Plain lanes in RAM keep that choice and run a pass's rows that only fill
# the KV cache (prompts) in a call of their own, of at least this many rows, and the rows that output in another, of
# fewer: each row then takes one kernel whatever rode beside it (runtimes/llama_cpp/lanes.py, Lanes.split_rows).
TILED_MIN_ROWS = 8
# KV cache types whose flash-attention path gave bit-identical logits for a token alone and inside a 256-node tree
# (f16 and f32 KV switch kernels at 64-token batches and differ by ~1 logit).
BATCH_INVARIANT_KV = frozenset({"bf16", "q8_0"})


@dataclass
class _Switches:
    chosen_here: bool = False  # edge-spec set the switches (not the environment), and may still change them
    read: bool = False  # ggml has run a pass in this process: it has read them


SWITCHES = _Switches()


def _switches() -> str:
    return f"{TILED}={os.environ.get(TILED, '')};{FORCE_TILED}={os.environ.get(FORCE_TILED, '')}"


def _set(tiled: str | None, force_tiled: str | None) -> None:
    """Set the switches (None: unset), marked as edge-spec's choice (CHOSEN holds what it set)."""
    for name, value in ((TILED, tiled), (FORCE_TILED, force_tiled)):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.environ[CHOSEN] = _switches()


def prefer_invariant_kernels() -> None:
    """One kernel for every K-quant batch: the dot-product ones, unless the environment set either switch (switches
    inherited from an edge-spec process as it set them, CHOSEN says so, are not the environment's choice)."""
    inherited = os.environ.get(CHOSEN) == _switches()
    if inherited or (TILED not in os.environ and FORCE_TILED not in os.environ):
        _set("0", None)
        SWITCHES.chosen_here = True


def prefer_tiled(tiled: bool) -> None:
    """Before a pair loads: the tiled kernel at every batch size (`tiled`: its target streams from the drive, where
    trees pay and the tiled kernel is the faster for them) or the dot-product kernels (in RAM). Nothing changes once
    a pass has run or where the environment chose."""
    if SWITCHES.read or not SWITCHES.chosen_here:
        return
    if tiled:
        _set(None, "1")
    else:
        _set("0", None)


def prefer_stock() -> None:
    """Before a target that decodes plainly loads (no tree is ever verified): llama.cpp's own choice of kernel by
    batch size, as it runs by default; for plain lanes in RAM too, which split their passes by rows to keep each row on
    one kernel (Lanes.split_rows) and so run prompts on the tiled kernel, several times faster than the dot-product
    ones. Nothing changes once a pass has run or where the environment chose."""
    if SWITCHES.read or not SWITCHES.chosen_here:
        return
    _set(None, None)


def mark_ran() -> None:
    SWITCHES.read = True


def tiled_everywhere() -> bool:
    """Whether K-quant matmuls take one kernel at every batch size here: the tiled one turned off (the dot-product
    kernels run every batch) or forced."""
    return os.environ.get(TILED) == "0" or os.environ.get(FORCE_TILED) == "1"


def invariant_types() -> frozenset[str]:
    return BATCH_INVARIANT_TYPES | (TILED_INVARIANT_TYPES if tiled_everywhere() else frozenset())


def keeps_repacking(weight_types: frozenset[str]) -> bool:
    """Whether a target with these weight types may use llama.cpp's repacked buffers and stay batch-invariant."""
    return not weight_types & REPACK_VARIANT_TYPES


def repack_rows(weight_types: frozenset[str]) -> int:
    """The multiple of rows (and of outputs) every pass of a target with these weight types, repacked, pads to so
    that each row takes one kernel whatever the batch (1: none needed)."""
    return REPACK_ROWS if weight_types & REPACK_VARIANT_TYPES else 1


def lane_padding(rows: int, outputs: int, min_rows: int, multiple: int) -> tuple[int, int]:
    """A pass of `rows` rows, `outputs` of them outputs, padded: (its rows, the padding rows that output). At least
    `min_rows` rows (a GPU backend's, every padding row an output, so that the head too multiplies that many), or
    rows and outputs each a multiple of `multiple` (repacked x86 kernels)."""
    if multiple > 1:
        padding, missing = -rows % multiple, -outputs % multiple
        while padding < missing:
            padding += multiple
        return rows + padding, missing
    return max(rows, min_rows), max(min_rows - rows, 0)


def padding_room(min_rows: int, multiple: int) -> int:
    """The most rows lane_padding adds to a pass (a context keeps that many rows and cells free for them)."""
    return max(min_rows - 1, 2 * multiple if multiple > 1 else 0)


def lossless_guarantee(weight_types: frozenset[str], kv_type: str, fix: str) -> str | None:
    """None when a target with these matmul weight types and KV cache type is batch-invariant here, else one line
    saying why not; `fix` says how to rewrite the target where the user named it (a models.toml key or a flag)."""
    if kv_type not in BATCH_INVARIANT_KV:
        return (f"a {kv_type} KV cache is not batch-invariant in llama.cpp's attention: speculative output can "
                f"differ from plain decoding where logits nearly tie (use a bf16 or q8_0 KV cache)")
    unsafe = sorted(weight_types - invariant_types())
    if not unsafe:
        return None
    why = (f"{TILED}=0 or {FORCE_TILED}=1 keeps K-quants invariant" if set(unsafe) <= TILED_INVARIANT_TYPES
           else f"rewrite the target as q8_0: {fix}")
    return (f"weights of type {', '.join(unsafe)} are not batch-invariant in llama.cpp on this CPU: speculative "
            f"output can differ from plain decoding where logits nearly tie ({why})")


# GPU backends whose kernels gave a token the same logits alone and inside a tree (`edge-spec check --gpu-layers N`):
# none yet. CUDA switches kernels by batch size (MMVQ, MMQ, cuBLAS), unmeasured here.
INVARIANT_GPU_BACKENDS: frozenset[str] = frozenset()
# The rows below which a backend's kernels differ from its larger batches', by backend: every pass of a target with
# layers there is padded to as many. Vulkan (llama-cpp-python 0.3.36) runs MUL_MAT on matrix-vector shaders up to 8
# rows (mul_mat_vec_max_cols) and on its tiled shaders from 9: a token's logits moved 0.40 between 1 and 9 rows on
# Mesa's lavapipe (SmolLM2, every layer there), and were bit-identical at every size from 9 to 128. A Vulkan GPU that
# reports its core count also splits large matmuls by the batch's tiles (ggml_vk_guess_split_k): measure it there.
MIN_ROWS = {"Vulkan": 9}
# Backends whose attention sums a row's cells grouped by where they lie in the KV cache: a target with layers there
# verifies a tree's likeliest path alone (TokenTree.spine), whose nodes lie in the cells plain decoding gives them.
# Vulkan (0.3.36): ggml-vulkan's flash attention reads the cache in 32-cell blocks (64 for head sizes with bit 3 set),
# and a node's softmax and its weighted sum of V round by its cells' indices. A node off that path sits past the cells
# of the nodes before it in the pass, not where plain decoding puts it: a sibling leaf 25 cells past plain decoding's
# cell ended 0.48 logits off on lavapipe, the first tensor to differ being layer 0's FLASH_ATTN_EXT
# (benchmarks/first_difference.py, docs/runtimes.md); the path's nodes were exact in every tree measured.
CHAIN_BACKENDS = frozenset({"Vulkan"})


def min_rows(gpu_layers: int, backend: str | None) -> int:
    """The rows every pass of a target with `gpu_layers` layers on `backend` carries (1: no padding)."""
    return MIN_ROWS.get(backend, 1) if gpu_layers and backend else 1


def chains_only(gpu_layers: int, backend: str | None) -> bool:
    """Whether a target with `gpu_layers` layers on `backend` verifies each tree's likeliest path alone."""
    return bool(gpu_layers) and backend in CHAIN_BACKENDS


def gpu_guarantee(gpu_layers: int, backend: str) -> str | None:
    """None when `gpu_layers` target layers on `backend` ("CUDA", "Vulkan", ...) leave trees bit-exact, else the
    warning: the layers on the CPU stay invariant (no op offload), those on the GPU are as exact as its kernels."""
    if not gpu_layers or backend in INVARIANT_GPU_BACKENDS:
        return None
    check = f"gpu_layers 0 keeps it exact; `edge-spec check MODEL --gpu-layers {gpu_layers}` measures it"
    if backend in MIN_ROWS:
        return (f"{gpu_layers} target layers run on {backend}, its passes padded to {MIN_ROWS[backend]} rows and each "
                f"tree cut to its likeliest path (exact on Mesa's software device; a GPU's own core count changes how "
                f"its kernels split the work): speculative output can differ from plain decoding where logits nearly "
                f"tie ({check})")
    return (f"{gpu_layers} target layers run on {backend}, whose kernels change with the batch size: speculative "
            f"output can differ from plain decoding where logits nearly tie ({check})")
