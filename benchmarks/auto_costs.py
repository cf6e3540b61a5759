"""What `--budget auto` measures and predicts for a pair placed on the SSD (docs/performance.md, `--budget auto`).

    python benchmarks/auto_costs.py --pair smollm2-135m
    python benchmarks/auto_costs.py --pair gemma3-270m --drafter-vocab 32768

Measures the costs as `--budget auto` does at load (offload.tuning.measure_costs: target passes as placed, over
read-ahead weights, and started together with the reading; drafter passes), prints them, and the predicted round
time per budget from the overlap-aware model (Costs.verify_s) and from the older one that added the whole warm pass
after the reading, before any running correction. Compare with `ssd_timeline.py --budget B` (mean round).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from edge.models.pair import CALIBRATION_TEXT
from edge.offload.tuning import measure_costs

import edge
from edge.budget import CANDIDATES, AutoBudget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", required=True)
    parser.add_argument("--drafter-vocab", type=int, default=None, help="an onnx drafter with this trimmed head")
    parser.add_argument("--target-dtype", default="f16")
    args = parser.parse_args()

    with edge.load(args.pair, report=lambda message: print(message, file=sys.stderr), placement="ssd",
                   target_dtype=args.target_dtype, drafter_runtime="onnx" if args.drafter_vocab else None,
                   drafter_vocab=args.drafter_vocab) as pair:
        prefix = pair.target.tokenizer.tokenize(CALIBRATION_TEXT, add_special=True, parse_special=False)
        costs = measure_costs(pair.target, pair.drafter, prefix, pair.target.max_tree)
    print(json.dumps(costs.to_json()))
    overlap, no_overlap = AutoBudget(costs), AutoBudget(replace(costs, overlap_ms=None))
    print(f"{'budget':>6s} {'prior tokens':>12s} {'round ms':>9s} {'old model':>10s}")
    for budget in CANDIDATES:
        print(f"{budget:6d} {overlap.expected_tokens(budget):12.2f} {1000 * overlap.round_s(budget):9.1f} "
              f"{1000 * no_overlap.round_s(budget):10.1f}")
    print(f"{'plain':>6s} {1.0:12.2f} {1000 * overlap.round_s(0):9.1f}")


if __name__ == "__main__":
    try:
        main()
    except edge.UserError as error:
        from edge.cli.render import worded

        sys.exit(f"error: {worded(error)}")
