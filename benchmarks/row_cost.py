"""What a pass of 1, 2, 3 and 4 rows (one new token for each of that many lanes) costs the target in RAM on this
machine's cores, on the two kernels a server's lanes can run: llama.cpp's dot-product kernels over the file's mapping,
and its repacked buffers (a GEMV below 4 rows, a 4-row GEMM from 4; lanes over them pad every pass to 4 rows,
runtimes/llama_cpp/kernels.py REPACK_ROWS).

    python benchmarks/row_cost.py                 # the default pair's target
    python benchmarks/row_cost.py --repeats 20

Four clients get `4 / cost(4 rows)` tokens a second against one alone's `1 / cost(1 row)`, wherever compute, not
the drive, is what a pass waits on: the ratio `cost(4) / cost(1)` bounds what batching gives in RAM and under a memory
limit whose streamed part reads faster than the pass computes. Each way runs in a process of its own (ggml reads its
kernel switches once a process). Nothing else should run beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WAYS = ("dot_product", "repacked")
LANES = 4
PROMPT = 16  # tokens in each lane's context before the timed passes


def measure(path: Path, way: str, repeats: int) -> dict:
    """Median milliseconds of a pass of 1..LANES rows, each row a lane's next token after a PROMPT-token context."""
    import numpy as np
    from edge.runtimes.llama_cpp._native import Batch, Context, Model

    model = Model(path, repack=way == "repacked")
    ctx = Context(model, LANES * 256, n_batch=PROMPT, kv_type="bf16", flash_attn=True, n_outputs=LANES,
                  sequences=LANES, threadpool=True, unified=False)
    batch = Batch(PROMPT)
    tokens = np.random.default_rng(0).integers(1000, 5000, (LANES, PROMPT))
    for lane in range(LANES):
        batch.fill(tokens[lane], 0, seq=lane)
        ctx.decode(batch)
    costs = {}
    for rows in range(1, LANES + 1):
        times = []
        for repeat in range(repeats + 2):  # two warm-up passes, not counted
            batch.fill(tokens[:rows, repeat % PROMPT], np.full(rows, PROMPT, np.int32), outputs=True)
            batch.seq_id[:rows, 0] = np.arange(rows)
            started = time.perf_counter()
            ctx.decode(batch)
            times.append(time.perf_counter() - started)
            for lane in range(rows):
                ctx.seq_rm(lane, PROMPT, -1)
        costs[rows] = round(statistics.median(times[2:]) * 1000, 1)
    ctx.close()
    model.close()
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default=None, help="a pair of models.toml (default: the default pair)")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # a child's one way
    args = parser.parse_args()

    from edge.models.opening import materialize
    from edge.models.registry import load_registry

    path = materialize(load_registry().pair(args.pair).target, lambda message: print(message, file=sys.stderr))
    if args.way:
        print(json.dumps(measure(path, args.way, args.repeats)))
        return
    report: dict = {"target": path.name, "repeats": args.repeats}
    for way in WAYS:
        command = [sys.executable, __file__, "--way", way, "--repeats", str(args.repeats)]
        if args.pair:
            command += ["--pair", args.pair]
        costs = {int(rows): ms for rows, ms in json.loads(subprocess.check_output(command).splitlines()[-1]).items()}
        report[way] = {"pass_ms_by_rows": costs, "four_over_one": round(costs[LANES] / costs[1], 2),
                       "tokens_per_s_one_lane": round(1000 / costs[1], 2),
                       "tokens_per_s_four_lanes": round(LANES * 1000 / costs[LANES], 2)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
