"""onnxruntime's MatMulNBits on a drafter-sized matrix, by rows, bits, block and accuracy level (docs/drafter.md).

    python benchmarks/matmulnbits.py [K N]      default 576 3072: SmolLM2-135M's fused gate+up projection

    python benchmarks/matmulnbits.py 640 32768    Gemma-3-270M's head trimmed to 32k, the case DESIGN.md quotes

Prints microseconds per call (median of 200, after 20 warm-up calls) for 1, 2, 4, 8 and 16 rows, and the rate in
multiply-adds per second at 16 rows. The session runs on the machine's cores with spinning workers, as the drafter's.
The last row is not MatMulNBits: DynamicQuantizeMatMul (onnxruntime's u8 x s8 GEMM, the kernel of its dynamically
quantized models) with one scale per column, for comparison. Its weights use 7 bits (-63..63): on AVX2 the kernel adds
pairs of u8 x s8 products in int16, which saturates with full-range int8 weights; the last lines print both errors.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from edge.quant.int4 import quantize_weight
from edge.runtimes.onnx.proto import IR_VERSION, OPSET

ROWS = (1, 2, 4, 8, 16)
VARIANTS = [  # bits, block, accuracy level, symmetric
    (4, 32, 4, True),  # the drafter's layers: Q4_0 blocks as they are, int8 compute
    (4, 32, 4, False),
    (4, 64, 4, True),
    (4, 128, 4, True),
    (8, 32, 4, True),  # the drafter's head and embeddings
    (4, 32, 1, True),  # float32 compute
]


def session(weight: np.ndarray, bits: int, block: int, level: int, symmetric: bool):
    from onnx import helper

    packed = quantize_weight(weight, bits=bits, block=block, symmetric=symmetric)
    initializers = packed.initializers("w")
    node = helper.make_node("MatMulNBits", ["a", *(t.name for t in initializers)], ["y"], domain="com.microsoft",
                            **packed.attrs(), accuracy_level=level)
    return _session(node, initializers, *weight.shape)


def dynamic_quantize_session(weight: np.ndarray, bits: int = 7):
    """y = a @ weight.T through DynamicQuantizeMatMul: `bits`-bit weights with one scale per output column."""
    from onnx import helper, numpy_helper

    scale = np.abs(weight).max(axis=1) / (2 ** (bits - 1) - 1)
    quantized = np.round(weight / scale[:, None]).astype(np.int8).T  # [K, N]
    initializers = [numpy_helper.from_array(np.ascontiguousarray(quantized), "w"),
                    numpy_helper.from_array(scale.astype(np.float32), "w_scale"),
                    numpy_helper.from_array(np.zeros(len(scale), np.int8), "w_zero")]
    node = helper.make_node("DynamicQuantizeMatMul", ["a", "w", "w_scale", "w_zero"], ["y"], domain="com.microsoft")
    return _session(node, initializers, *weight.shape)


def _session(node, initializers, n: int, k: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([node], "matmul", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = IR_VERSION
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main(k: int, n: int) -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    print(f"MatMulNBits [M, {k}] x [{k}, {n}], {os.cpu_count()} threads; microseconds per call")
    print(f"{'bits/block/level/symmetric':30s}" + "".join(f"{f'{m} rows':>10s}" for m in ROWS) + "  GMAC/s @16")
    runs = [(f"{bits} / {block} / {level} / {'yes' if sym else 'no'}", session(weight, bits, block, level, sym))
            for bits, block, level, sym in VARIANTS]
    runs.append(("DynamicQuantizeMatMul, 7-bit", dynamic_quantize_session(weight)))
    for label, run in runs:
        micros = []
        for m in ROWS:
            a = rng.standard_normal((m, k)).astype(np.float32)
            for _ in range(20):
                run.run(None, {"a": a})
            times = []
            for _ in range(200):
                start = time.perf_counter()
                run.run(None, {"a": a})
                times.append(time.perf_counter() - start)
            micros.append(1e6 * float(np.median(times)))
        rate = ROWS[-1] * k * n / micros[-1] / 1e3
        print(f"{label:30s}" + "".join(f"{us:10.1f}" for us in micros) + f"  {rate:10.1f}")
    square = rng.standard_normal((2048, 2048)).astype(np.float32)
    square @ square
    start = time.perf_counter()
    for _ in range(10):
        square @ square
    print(f"for reference, numpy's float32 GEMM on 2048 x 2048: "
          f"{10 * 2 * 2048**3 / (time.perf_counter() - start) / 1e9:.0f} GFLOP/s")
    a = rng.standard_normal((ROWS[-1], k)).astype(np.float32)
    exact = a @ weight.T
    for bits in (7, 8):
        error = np.abs(dynamic_quantize_session(weight, bits).run(None, {"a": a})[0] - exact).max()
        print(f"DynamicQuantizeMatMul, {bits}-bit weights: largest error {100 * error / np.abs(exact).max():.1f}% "
              "of the largest output")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("k", type=int, nargs="?", default=576, help="input width (default 576)")
    parser.add_argument("n", type=int, nargs="?", default=3072, help="output width (default 3072)")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    main(args.k, args.n)
