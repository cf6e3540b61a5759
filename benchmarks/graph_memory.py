"""The memory a drafter's ONNX graph takes to build: the build of a pair's drafter graph into a temporary folder,
in a fresh process under each memory limit (benchmarks/memcap.py), with its peak anonymous memory (what the kernel
cannot reclaim), its peak charge (page cache of the GGUF file included) and build_bytes()'s estimate of it.

    python benchmarks/graph_memory.py -m qwen2.5-coder-1.5b --limits none,1300,700,500

Prints one JSON object. The graph built is the pair's own (role, trimmed head and int4 blocks as the pair loads it
when the vocabulary is not trimmed); the one in the cache is left alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.memcap import call_capped  # noqa: E402


def build(gguf: str, int4_block: int, folder: str) -> dict:
    from edge.runtimes.onnx import prepare_graph

    start = time.perf_counter()
    path = prepare_graph(Path(gguf), "drafter", None, None, Path(folder), int4_block=int4_block)
    return {"seconds": round(time.perf_counter() - start, 2), "graph_bytes": Path(str(path) + ".data").stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--pair", default="qwen2.5-coder-1.5b")
    parser.add_argument("--limits", default="none,1300,700,500", help="MiB, comma-separated; none: no limit")
    args = parser.parse_args()

    from edge.models.opening import materialize
    from edge.models.registry import load_registry
    from edge.runtimes.onnx.arch import GGUFWeights
    from edge.runtimes.onnx.graph import build_bytes

    drafter = load_registry().pair(args.pair).drafter
    gguf = materialize(drafter, lambda line: print(line, file=sys.stderr))
    rows = []
    for limit in args.limits.split(","):
        cap = None if limit == "none" else int(limit) << 20
        with tempfile.TemporaryDirectory() as folder:
            try:
                run = call_capped(build, str(gguf), drafter.int4_block or 0, folder, limit_bytes=cap)
                row = {**run.value, "peak_anon_mib": run.peak_anon_bytes >> 20, "peak_mib": run.peak_bytes >> 20}
            except (MemoryError, RuntimeError) as error:
                row = {"error": str(error).strip().splitlines()[-1]}
        rows.append({"limit_mib": None if cap is None else int(limit), **row})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"pair": args.pair, "drafter": gguf.name, "estimate_mib": build_bytes(GGUFWeights(gguf)) >> 20,
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
