"""onnxruntime's MatMulNBits on a drafter-sized matrix, by rows, bits, block and accuracy level (docs/drafter.md).

    python benchmarks/matmulnbits.py [K N]      default 576 3072: SmolLM2-135M's fused gate+up projection

Prints microseconds per call (median of 200, after 20 warm-up calls) for 1, 2, 4, 8 and 16 rows, and the rate in
multiply-adds per second at 16 rows. The session runs on the machine's cores with spinning workers, as the drafter's.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quant.int4 import quantize_weight
from runtimes.onnx.graph import IR_VERSION, OPSET

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
    import onnxruntime as ort
    from onnx import TensorProto, helper

    n, k = weight.shape
    packed = quantize_weight(weight, bits=bits, block=block, symmetric=symmetric)
    initializers = packed.initializers("w")
    node = helper.make_node("MatMulNBits", ["a", *(t.name for t in initializers)], ["y"], domain="com.microsoft",
                            **packed.attrs(), accuracy_level=level)
    graph = helper.make_graph([node], "matmulnbits", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["M", k])],
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
    print(f"{'bits/block/level/symmetric':28s}" + "".join(f"{f'{m} rows':>10s}" for m in ROWS) + "  GMAC/s @16")
    for bits, block, level, symmetric in VARIANTS:
        run = session(weight, bits, block, level, symmetric)
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
        label = f"{bits} / {block} / {level} / {'yes' if symmetric else 'no'}"
        print(f"{label:28s}" + "".join(f"{us:10.1f}" for us in micros) + f"  {rate:10.1f}")


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:3])) if len(sys.argv) > 2 else main(576, 3072)
