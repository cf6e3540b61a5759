"""Block-wise weights packed for MatMulNBits: error bounds, and the kernel multiplies by exactly `dequantize()`."""

from __future__ import annotations

import numpy as np
import pytest
from edge.quant.int4 import PackedWeight, quantize_weight

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

SHAPES = [(96, 64, 32), (40, 80, 32), (33, 256, 128), (8, 17, 16)]  # (N, K, block); 80 and 17 need padding
KINDS = [(bits, symmetric) for bits in (4, 8) for symmetric in (False, True)]


def weight(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[:, ::7] *= 4  # a few larger input channels, as real layers have
    return w


def block_scales(pw: PackedWeight) -> np.ndarray:
    """|scale| of each element's block: [N, K]."""
    scales = np.abs(pw.scales.reshape(pw.n, pw.k_blocks))
    return np.repeat(scales, pw.block, axis=1)[:, : pw.k]


def session(pw: PackedWeight) -> ort.InferenceSession:
    from onnx import TensorProto, helper

    inits = pw.initializers("w")
    node = helper.make_node(
        "MatMulNBits", ["x", *(t.name for t in inits)], ["y"], domain="com.microsoft", accuracy_level=0, **pw.attrs()
    )
    graph = helper.make_graph(
        [node],
        "matmul_nbits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, pw.k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, pw.n])],
        initializer=inits,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bits, symmetric", KINDS)
@pytest.mark.parametrize("n, k, block", SHAPES)
def test_dequantize_error_is_bounded_by_the_block_scale(n: int, k: int, block: int, bits: int, symmetric: bool) -> None:
    w = weight(n, k)
    pw = quantize_weight(w, bits, block, symmetric)
    assert pw.packed.shape == (n, -(-k // block), block * bits // 8) and pw.packed.dtype == np.uint8
    assert pw.scales.shape == (n * pw.k_blocks,) and pw.scales.dtype == np.float32
    assert (pw.zero_points is None) == symmetric
    error = np.abs(pw.dequantize() - w)
    scale = block_scales(pw)
    slack = 1e-5 * scale
    if not symmetric:
        assert np.all(error <= scale / 2 + slack)
        return
    # symmetric: scale = m / -8 with m the block's largest-magnitude value, so m itself lands on code 0 and
    # only values of the other sign beyond 7.5 steps clip (to code 2**bits - 1), by at most one step
    inside = np.abs(w) <= (2 ** (bits - 1) - 0.5) * scale
    assert np.all(error[inside] <= scale[inside] / 2 + slack[inside])
    assert np.all(error <= scale + slack)


@pytest.mark.parametrize("bits, symmetric", KINDS)
@pytest.mark.parametrize("n, k, block", SHAPES)
def test_matmul_nbits_multiplies_by_exactly_dequantize(n: int, k: int, block: int, bits: int, symmetric: bool) -> None:
    pw = quantize_weight(weight(n, k, seed=1), bits, block, symmetric)
    run = session(pw)
    # x = I reads the kernel's weight matrix back element by element
    np.testing.assert_array_equal(run.run(None, {"x": np.eye(k, dtype=np.float32)})[0], pw.dequantize().T)
    x = np.random.default_rng(2).standard_normal((5, k)).astype(np.float32)
    expected = x @ pw.dequantize().T
    got = run.run(None, {"x": x})[0]
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()


def test_node_description() -> None:
    pw = quantize_weight(weight(24, 64), bits=4, block=32)
    assert pw.attrs() == {"K": 64, "N": 24, "bits": 4, "block_size": 32}
    names = [t.name for t in pw.initializers("layers.0.q_proj")]
    assert names == ["layers.0.q_proj_B", "layers.0.q_proj_scales", "layers.0.q_proj_zero_points"]
    assert pw.zero_points is not None and pw.zero_points.shape == (24,)  # 2 blocks per row, one byte
    assert len(quantize_weight(weight(24, 64), symmetric=True).initializers("w")) == 2
    assert pw.nbytes() == 24 * 64 // 2 + 24 * 2 * 4 + 24


@pytest.mark.parametrize(
    "w, kwargs",
    [(np.zeros((4, 32)), {"bits": 3}), (np.zeros((4, 32)), {"block": 48}), (np.zeros(32), {})],
)
def test_bad_arguments_raise(w: np.ndarray, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        quantize_weight(w, **kwargs)
