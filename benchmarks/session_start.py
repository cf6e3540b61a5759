"""The ONNX drafter's start with onnxruntime's buffer-reuse planning on and off: session load time, pass times,
the outputs' bits and peak RSS, each setting in fresh processes (runtimes/onnx/session.py turns it off).

    python benchmarks/session_start.py --pair smollm2-135m --repeat 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import time

import numpy as np


def measure(pair: str, mem_reuse: bool) -> dict:
    """In this process: load the pair's drafter file as an ONNX drafter, time its passes, hash what it drafts."""
    from edge.models.opening import materialize
    from edge.models.pair import CALIBRATION_TEXT
    from edge.models.registry import load_registry
    from edge.offload.tuning import expand_ms
    from edge.runtimes import runtime

    from edge.tree import TokenTree

    spec = load_registry().pair(pair)
    path = materialize(spec.drafter)
    onnx, llama = runtime("onnx"), runtime("llama_cpp")
    onnx.prepare_graph(path, "drafter")  # built once, outside the timing
    start = time.perf_counter()
    drafter = onnx.load_drafter(path, onnx.OnnxOptions(n_ctx=spec.ctx + 256, mem_reuse=mem_reuse))
    load_s = time.perf_counter() - start
    tokens = llama.Model(path).tokenize(CALIBRATION_TEXT * 60, True, False)[:1100]
    drafter.prefill(tokens[:-1])  # a prompt of 1,100 tokens, in 256-token passes
    ids, log_probs = drafter.expand(TokenTree.root(tokens[-1]), np.array([0]), 8)
    digest = hashlib.sha256(ids.tobytes() + log_probs.tobytes()).hexdigest()[:16]
    passes = expand_ms(drafter, tokens[:150], repeats=9)
    return {"load_s": round(load_s, 3), "expand_ms": {str(k): v for k, v in passes.items()}, "bits": digest,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2-135m")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per setting (the best load counts)")
    parser.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.pair, args.child == "on")))
        return
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.repeat):  # alternated, so a slow spell of a shared machine falls on both alike
        for setting in runs:
            child = [sys.executable, __file__, "--pair", args.pair, "--child", setting]
            runs[setting].append(json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout))
    print(f"{args.pair}'s ONNX drafter, {args.repeat} fresh processes per setting")
    for setting, results in runs.items():
        best = min(results, key=lambda r: r["load_s"])
        print(f"  buffer reuse {setting:3s}: drafter load {best['load_s']:.3f} s (best; "
              f"{[r['load_s'] for r in results]}), expand ms {best['expand_ms']}, bits {best['bits']}, "
              f"peak RSS {max(r['max_rss_mb'] for r in results)} MB")
    same = len({r["bits"] for results in runs.values() for r in results}) == 1
    print(f"  same bits in every run: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
