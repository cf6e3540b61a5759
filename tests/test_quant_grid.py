"""A GGUF tensor's own grid (quant/grid.py) packed for MatMulNBits without moving a weight (quant.int4.pack_exact)."""

from __future__ import annotations

import numpy as np
import pytest
from edge.quant.grid import BlockGrid, block_grid
from edge.quant.int4 import pack_exact

gguf = pytest.importorskip("gguf")
ort = pytest.importorskip("onnxruntime")

# type: (bytes per block, weights per block, offsets of its float16 fields)
LAYOUTS = {"Q4_0": (18, 32, [0]), "Q4_1": (20, 32, [0, 2]), "Q5_0": (22, 32, [0]), "Q5_1": (24, 32, [0, 2]),
           "Q8_0": (34, 32, [0]), "Q4_K": (144, 256, [0, 2]), "Q5_K": (176, 256, [0, 2]), "Q6_K": (210, 256, [208])}
# type: (MatMulNBits bits, block, whether an offset is left for the block-sum correction)
PACKED = {"Q4_0": (4, 32, False), "Q4_1": (4, 32, True), "Q5_0": (8, 32, False), "Q5_1": (8, 32, True),
          "Q8_0": (8, 32, False), "Q4_K": (4, 32, True), "Q5_K": (8, 32, True), "Q6_K": (8, 16, False)}


def raw_blocks(type_name: str, rows: int = 24, k: int = 512, seed: int = 0) -> np.ndarray:
    """Random blocks of a GGUF type [rows, bytes per row], with sane float16 scales (any code bytes are valid)."""
    size, per_block, fields = LAYOUTS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // per_block, size), dtype=np.uint8)
    for offset in fields:
        sign = -1 if offset == 2 else 1  # Q4_1/Q5_1 minimums are mostly negative; K-quant dmin is subtracted
        values = (sign * rng.uniform(0.001, 0.02, raw.shape[:2])).astype(np.float16)
        raw[..., offset : offset + 2] = values[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def dequantized(raw: np.ndarray, type_name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)


def rebuilt(packed, residual) -> np.ndarray:
    w = packed.dequantize().reshape(packed.n, packed.k_blocks, packed.block)
    if residual is not None:
        w = w + residual[..., None]
    return w.reshape(packed.n, -1)


@pytest.mark.parametrize("type_name", list(LAYOUTS))
def test_packing_a_gguf_grid_moves_no_weight(type_name: str) -> None:
    raw = raw_blocks(type_name)
    w = dequantized(raw, type_name)
    grid = block_grid(raw, type_name)
    packed, residual = pack_exact(w, grid)
    bits, block, offset = PACKED[type_name]
    assert (packed.bits, packed.block, residual is not None) == (bits, block, offset)
    assert np.abs(rebuilt(packed, residual) - w).max() <= 1e-6 * np.abs(w).max()
    if type_name == "Q4_0":  # Q4_0's zero point is the kernel's own: the graph stays what it was
        assert packed.zero_points is None


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q6_K", "Q8_0"])
def test_matmulnbits_with_the_block_sum_correction_multiplies_by_the_file_weights(type_name: str) -> None:
    """The kernel reads the packing as written: its product plus (block sums of x) @ residual.T is x @ w.T."""
    from test_quant_int4 import session

    raw = raw_blocks(type_name, rows=40, k=256, seed=1)
    w = dequantized(raw, type_name)
    packed, residual = pack_exact(w, block_grid(raw, type_name))
    x = np.random.default_rng(2).standard_normal((5, 256)).astype(np.float32)
    y = session(packed).run(None, {"x": x})[0]
    if residual is not None:
        y = y + x.reshape(5, -1, packed.block).sum(-1) @ residual.T
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-4, atol=1e-4 * np.abs(x @ w.T).max())


def test_weights_off_the_grid_are_not_packed_as_if_on_it() -> None:
    raw = raw_blocks("Q4_1", rows=8, k=64)
    w = dequantized(raw, "Q4_1")
    grid = block_grid(raw, "Q4_1")
    assert pack_exact(w + 0.3 * grid.scales.repeat(32, axis=1), grid) is None  # between two codes
    assert pack_exact(w[:, :32], grid) is None  # not the grid's shape
    assert block_grid(np.zeros((4, 8), np.uint8), "F16") is None and block_grid(raw, "IQ4_XS") is None


def test_grids_of_one_width_stack_for_fused_projections() -> None:
    q5, q8, q4 = (block_grid(raw_blocks(t, rows=4, k=256), t) for t in ("Q5_0", "Q8_0", "Q4_1"))
    both = BlockGrid.concat([q5, q8])
    assert both is not None and both.scales.shape == (8, 8) and (both.bits, both.levels) == (8, 256)
    assert BlockGrid.concat([q5, q4]) is None and BlockGrid.concat([q5, None]) is None
    assert q4.take(np.array([3, 1])).scales.shape == (2, 8)


class _OneTable:
    """What DecoderBuilder.gather_rows reads of a GGUF file, for one table of raw blocks."""

    arch = None

    def __init__(self, raw: np.ndarray, type_name: str):
        self.raw, self.type_name = raw, type_name

    def grid(self, name: str, rows=slice(None)) -> BlockGrid | None:
        return block_grid(self.raw[rows], self.type_name)

    def rows(self, name: str, rows) -> np.ndarray:
        return dequantized(self.raw[rows], self.type_name)

    def n_rows(self, name: str) -> int:
        return len(self.raw)

    def row_floats(self, name: str) -> int:
        return dequantized(self.raw[:1], self.type_name).shape[1]


@pytest.mark.parametrize("type_name", list(LAYOUTS))
def test_gathered_rows_are_the_file_rows(type_name: str) -> None:
    """The int4 graph's embedding (GatherBlockQuantized, plus the offsets its zero points cannot hold) returns a
    table's rows as the file stores them."""
    from edge.runtimes.onnx.graph import DecoderBuilder, GraphOptions
    from onnx import TensorProto

    raw = raw_blocks(type_name, rows=40, k=512, seed=3)
    w = dequantized(raw, type_name)
    builder = DecoderBuilder(_OneTable(raw, type_name), GraphOptions(weights="int4"))
    g = builder.g
    ids = g.input("ids", TensorProto.INT64, [1, "n"])
    g.output(builder.gather_rows("table", "table", ids), "rows", TensorProto.FLOAT, [1, "n", 512])
    session = ort.InferenceSession(g.model().SerializeToString(), providers=["CPUExecutionProvider"])
    picked = np.array([[7, 0, 39, 7]])
    rows = session.run(None, {"ids": picked})[0]
    np.testing.assert_allclose(rows, w[picked], rtol=0, atol=1e-6 * np.abs(w).max())
