"""Group-wise 4-bit (and 8-bit) weights, packed exactly as onnxruntime's MatMulNBits (com.microsoft) reads them.

The packing is done by onnxruntime's own packers (the ones `MatMulNBitsQuantizer` calls), so the layout is the
kernel's by construction; this module only pads, unpacks and describes the result. onnxruntime and onnx are imported
inside the functions that need them, so importing `quant` stays numpy-only.

Layout, for a weight w: [N, K] = [out_features, in_features] (MatMulNBits computes y = x @ w.T):
    packed       uint8   [N, K_blocks, block * bits // 8]   two 4-bit codes per byte, low nibble = even k
    scales       float32 [N * K_blocks]
    zero_points  uint8   [N * ceil(K_blocks * bits / 8)]    asymmetric only; 4-bit: low nibble = even block
    w[n, k] = scales[n, b] * (q[n, k] - zp[n, b]),  b = k // block,  zp = 2**(bits-1) when zero_points is None
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx

BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True, eq=False)
class PackedWeight:
    packed: np.ndarray  # uint8 [N, K_blocks, block * bits // 8]  (MatMulNBits input B)
    scales: np.ndarray  # float32 [N * K_blocks]
    zero_points: np.ndarray | None  # uint8 [N * ceil(K_blocks * bits / 8)], or None when symmetric
    n: int
    k: int
    bits: int
    block: int

    @property
    def k_blocks(self) -> int:
        return -(-self.k // self.block)

    def codes(self) -> np.ndarray:
        """The unsigned codes q: uint8 [N, K_blocks * block] (K padded up to a whole block)."""
        if self.bits == 8:
            return self.packed.reshape(self.n, -1)
        low, high = self.packed & 0x0F, self.packed >> 4
        return np.stack([low, high], axis=-1).reshape(self.n, -1)

    def zero_point_per_block(self) -> np.ndarray:
        """uint8 [N, K_blocks]: the zero point the kernel subtracts in each block."""
        if self.zero_points is None:
            return np.full((self.n, self.k_blocks), 1 << (self.bits - 1), np.uint8)
        zp = self.zero_points.reshape(self.n, -1)
        if self.bits == 4:
            zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(self.n, -1)
        return zp[:, : self.k_blocks]

    def zero_point_bytes(self) -> np.ndarray:
        """uint8 [N, bytes a row]: the zero points as MatMulNBits stores them, the implicit ones written out."""
        if self.zero_points is not None:
            return self.zero_points.reshape(self.n, -1)
        zero = self.zero_point_per_block()
        return zero if self.bits == 8 else _nibbles(zero)

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: the matrix MatMulNBits multiplies by, scale * (q - zp) computed in float32."""
        q = self.codes().reshape(self.n, self.k_blocks, self.block).astype(np.float32)
        zp = self.zero_point_per_block().astype(np.float32)[:, :, None]
        scale = self.scales.reshape(self.n, self.k_blocks, 1)
        return (scale * (q - zp)).reshape(self.n, -1)[:, : self.k]

    def nbytes(self) -> int:
        zp = 0 if self.zero_points is None else self.zero_points.nbytes
        return self.packed.nbytes + self.scales.nbytes + zp

    def initializers(self, name_prefix: str) -> list[onnx.TensorProto]:
        """MatMulNBits inputs 1.. in order: B, scales, and zero_points when asymmetric (input 0 is x)."""
        from onnx import numpy_helper

        tensors = [
            numpy_helper.from_array(self.packed, f"{name_prefix}_B"),
            numpy_helper.from_array(self.scales, f"{name_prefix}_scales"),
        ]
        if self.zero_points is not None:
            tensors.append(numpy_helper.from_array(self.zero_points, f"{name_prefix}_zero_points"))
        return tensors

    def attrs(self) -> dict[str, int]:
        return {"K": self.k, "N": self.n, "bits": self.bits, "block_size": self.block}


class StackedRows:
    """Packed chunks of consecutive rows stacked into one PackedWeight (and its residual), filled in place."""

    def __init__(self, rows: int):
        self.rows, self.filled = rows, 0
        self.implicit = True  # every chunk leaves its zero points to the kernel
        self.residual: np.ndarray | None = None

    def add(self, part: PackedWeight, residual: np.ndarray | None) -> None:
        if self.filled == 0:
            self.shape = part
            self.packed = np.empty((self.rows, *part.packed.shape[1:]), np.uint8)
            self.scales = np.empty((self.rows, part.k_blocks), np.float32)
            self.zero = np.empty((self.rows, part.zero_point_bytes().shape[1]), np.uint8)
        rows = slice(self.filled, self.filled + part.n)
        self.packed[rows], self.scales[rows] = part.packed, part.scales.reshape(part.n, -1)
        self.zero[rows] = part.zero_point_bytes()
        self.implicit &= part.zero_points is None
        if residual is not None:
            if self.residual is None:
                self.residual = np.zeros((self.rows, part.k_blocks), np.float32)
            self.residual[rows] = residual
        self.filled += part.n

    def result(self) -> tuple[PackedWeight, np.ndarray | None]:
        first = self.shape
        packed = PackedWeight(packed=self.packed, scales=self.scales.reshape(-1),
                              zero_points=None if self.implicit else self.zero.reshape(-1), n=self.rows, k=first.k,
                              bits=first.bits, block=first.block)
        return packed, self.residual


def quantize_weight(w: np.ndarray, bits: int = 4, block: int = 32, symmetric: bool = False) -> PackedWeight:
    """Quantize w: [N, K] float (out_features, in_features) block-wise along K.

    Asymmetric blocks span [min(w, 0), max(w, 0)] with a rounded zero point. Symmetric blocks use
    scale = m / -8 (m the block's value of largest magnitude, so the scale can be negative) and the
    kernel's implicit zero point 8 (128 for 8 bits). K is zero-padded up to a whole block.
    """
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if block not in BLOCK_SIZES:
        raise ValueError(f"block must be one of {BLOCK_SIZES}, not {block}")
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {w.shape}")
    n, k = w.shape
    k_blocks = -(-k // block)
    # the packers read the transposed [K, N] matrix, row-major
    w_kn = np.zeros((k_blocks * block, n), np.float32)
    w_kn[:k] = w.T
    per_byte = 8 // bits
    packed = np.zeros((n, k_blocks, block // per_byte), np.uint8)
    scales = np.zeros((n, k_blocks), np.float32)
    zero_points = np.zeros((n, -(-k_blocks // per_byte)), np.uint8)
    pack = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    pack(packed, w_kn, scales, zero_points, block, n, k_blocks * block, symmetric)
    return PackedWeight(
        packed=packed,
        scales=scales.reshape(-1),
        zero_points=None if symmetric else zero_points.reshape(-1),
        n=n,
        k=k,
        bits=bits,
        block=block,
    )


def pack_exact(w: np.ndarray, grid) -> tuple[PackedWeight, np.ndarray | None] | None:
    """w: [N, K] dequantized weights that lie on `grid` (quant.grid.BlockGrid): packed for MatMulNBits without
    moving a weight. Codes of up to 16 levels take 4 bits, up to 256 take 8; each block's zero point is its offset
    over its scale, rounded. Where that is not a whole code (Q4_1, Q4_K: an offset of its own), the rest comes back
    as `residual` float32 [N, K_blocks]: w = scale * (code - zero_point) + residual, to be added to the product as
    (the input's block sums) @ residual.T. Returns None when w is not on the grid."""
    codes = grid.codes(w)
    if codes is None or grid.block not in BLOCK_SIZES:
        return None
    n, k = w.shape
    bits = grid.bits
    scales, offsets = grid.scales, grid.offsets
    safe = np.where(scales == 0, np.float32(1), scales)
    zero = np.where(scales == 0, 0, np.clip(np.rint(-offsets / safe), 0, (1 << bits) - 1)).astype(np.uint8)
    residual = (offsets + scales * zero.astype(np.float32)).astype(np.float32)
    k_blocks = k // grid.block
    codes = codes.reshape(n, k_blocks, grid.block)
    if bits == 4:
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
        zero_points = _nibbles(zero)
    else:
        packed, zero_points = codes, zero
    implicit = bool((zero == 1 << (bits - 1)).all())  # the kernel's own zero point: leave it out
    packed_weight = PackedWeight(packed=np.ascontiguousarray(packed), scales=scales.astype(np.float32).reshape(-1),
                                 zero_points=None if implicit else zero_points.reshape(-1), n=n, k=k, bits=bits,
                                 block=grid.block)
    return packed_weight, (residual if np.any(residual) else None)


def _nibbles(zero: np.ndarray) -> np.ndarray:
    """uint8 [N, B] zero points (one a block) two to a byte, low nibble first, an odd last one padded with 0."""
    padded = np.zeros((zero.shape[0], zero.shape[1] + zero.shape[1] % 2), np.uint8)
    padded[:, : zero.shape[1]] = zero
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8)
