"""A GGUF tensor's own quantization grid, read from its blocks, so a drafter keeps exactly the weights its file holds.

Each block type here stores, per block of `block` weights along a row, a scale s and an offset o, and integer codes
q in 0..levels-1:  w = s * q + o.  Requantizing such a tensor to another grid (Q4_K_M -> Q4_0, or Q4_1 to an
asymmetric 4-bit grid with a rounded zero point) adds an error of up to half a step to every weight, and a drafter
built that way agrees with its own target far less often (docs/drafter.md). Reading s and o from the blocks and
the codes back from the dequantized values loses nothing.

    type   block  levels  s          o
    Q4_0   32     16      d          -8 d
    Q4_1   32     16      d          m
    Q5_0   32     32      d          -16 d
    Q5_1   32     32      d          m
    Q8_0   32     256     d          -128 d      (codes shifted by 128)
    Q4_K   32     16      d sc_j     -dmin m_j   (8 sub-blocks of a 256-weight super-block, 6-bit sc_j and m_j)
    Q5_K   32     32      d sc_j     -dmin m_j
    Q6_K   16     64      d sc_j     -32 d sc_j  (16 sub-blocks, 8-bit signed sc_j)

Numpy only: the raw blocks are the [rows, bytes per row] uint8 arrays the `gguf` package reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHUNK = 1 << 18  # weights whose codes are found at a time: a 136M-weight table's took half the time of all at once
# type: bytes per block (32 weights; 256 for the K types); the layouts are ggml's (ggml-common.h)
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


@dataclass(frozen=True, eq=False)
class BlockGrid:
    scales: np.ndarray  # float32 [N, K // block]
    offsets: np.ndarray  # float32 [N, K // block]
    block: int
    levels: int  # codes are 0..levels-1

    def take(self, rows: np.ndarray) -> BlockGrid:
        """The grid of some rows (a trimmed head)."""
        return BlockGrid(self.scales[rows], self.offsets[rows], self.block, self.levels)

    @property
    def bits(self) -> int:
        """The width MatMulNBits stores the codes in."""
        return 4 if self.levels <= 16 else 8

    @staticmethod
    def concat(grids: list[BlockGrid | None]) -> BlockGrid | None:
        """Rows of several tensors stacked (fused projections); None unless they share the block and the width
        (Q5_0 and Q8_0 rows stack as 8-bit codes, Q4_1 and Q8_0 rows do not)."""
        if not grids or any(g is None for g in grids) or len({(g.block, g.bits) for g in grids}) > 1:
            return None
        return BlockGrid(np.concatenate([g.scales for g in grids]), np.concatenate([g.offsets for g in grids]),
                         grids[0].block, max(g.levels for g in grids))

    def codes(self, w: np.ndarray) -> np.ndarray | None:
        """uint8 [N, K]: the codes of the dequantized weights w [N, K] on this grid, or None when w is not on it."""
        n, k = w.shape
        if k % self.block or self.scales.shape != (n, k // self.block):
            return None
        tolerance = 1e-4 * max(float(np.abs(w).max()), 1e-30)
        codes = np.empty((n, k), np.uint8)
        step = max(1, CHUNK // k)
        for start in range(0, n, step):
            rows = slice(start, start + step)
            chunk = self._chunk_codes(w[rows], self.scales[rows], self.offsets[rows], tolerance)
            if chunk is None:
                return None
            codes[rows] = chunk
        return codes

    def _chunk_codes(self, w: np.ndarray, scales: np.ndarray, offsets: np.ndarray,
                     tolerance: float) -> np.ndarray | None:
        """codes() of some rows: w [n, K] with their scales and offsets [n, K/block]."""
        blocks = w.reshape(len(w), -1, self.block)
        s, o = scales[..., None], offsets[..., None]
        safe = np.where(s == 0, np.float32(1), s)
        codes = np.where(s == 0, 0, np.rint((blocks - o) / safe))
        if codes.min() < 0 or codes.max() >= self.levels:
            return None
        if np.abs(s * codes + o - blocks).max() > tolerance:
            return None
        return codes.astype(np.uint8).reshape(w.shape)


def block_grid(raw: np.ndarray, type_name: str) -> BlockGrid | None:
    """The grid of a GGUF tensor's raw blocks [rows, bytes per row]; None for a type without one here."""
    if type_name not in _BLOCK_BYTES:
        return None
    size = _BLOCK_BYTES[type_name]
    raw = np.ascontiguousarray(raw, np.uint8)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, size)  # [N, blocks, bytes]

    def f16(offset: int) -> np.ndarray:  # [N, blocks] float32
        return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    if type_name in ("Q4_0", "Q5_0", "Q8_0"):
        d = f16(0)
        middle = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}[type_name]
        levels = {"Q4_0": 16, "Q5_0": 32, "Q8_0": 256}[type_name]
        return BlockGrid(d, -middle * d, 32, levels)
    if type_name in ("Q4_1", "Q5_1"):
        return BlockGrid(f16(0), f16(2), 32, 16 if type_name == "Q4_1" else 32)
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = f16(0)[..., None], f16(2)[..., None]
        sc, m = _k_scales(blocks[..., 4:16])  # [N, blocks, 8] each
        scales, offsets = d * sc, -(dmin * m)
        return BlockGrid(scales.reshape(rows, -1), offsets.reshape(rows, -1), 32, 16 if type_name == "Q4_K" else 32)
    # Q6_K: ql[128] qh[64] scales[16] (int8) d (f16)
    d = f16(208)[..., None]
    scales = d * blocks[..., 192:208].view(np.int8).astype(np.float32)  # [N, blocks, 16]
    return BlockGrid(scales.reshape(rows, -1), (-32 * scales).reshape(rows, -1), 16, 64)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K super-block from its 12 bytes: [..., 12] -> 2 x [..., 8]."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)
