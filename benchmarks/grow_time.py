"""Growth's own time per round (edge/grow.py): grow() with a drafter whose passes cost next to nothing.

    python benchmarks/grow_time.py --budgets 64,255,1024,2048

The drafter gives each expanded node random distinct tokens with peaked log-probs (its top token takes 40-99% of
the mass, the runners-up a geometric share of the rest), so the trees have a real drafter's shapes while the time
measured is growth's bookkeeping: choosing nodes, scoring children, keeping the best under the budget and the leaf
bound. Prints per budget the median ms per grow() call over the rounds, the drafter passes, nodes and leaves.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from edge.grow import GrowConfig, grow
from edge.tree import TokenTree


class FreeDrafter:
    """A Drafter whose expand is a few numpy calls: random top-k, best first."""

    runtime, vocab, n_past = "none", 32000, 0

    def __init__(self, seed: int, expand_capacity: int):
        self.rng = np.random.default_rng(seed)
        self.expand_capacity = expand_capacity

    def expand(self, tree: TokenTree, nodes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        rows = len(nodes)
        top = self.rng.uniform(0.4, 0.99, rows)[:, None]  # the top token's probability
        share = 0.5 ** np.arange(1, k)  # the runners-up split the rest geometrically
        probs = np.concatenate([top, (1 - top) * share / share.sum() * 0.9], axis=1)  # [rows, k], best first
        ids = (self.rng.integers(0, self.vocab - k, rows)[:, None] + np.arange(k)).astype(np.int32)
        return ids, np.log(probs).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="64,255,1024,2048")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    print(f"{'budget':>6s} {'ms/round':>9s} {'passes':>7s} {'nodes':>6s} {'leaves':>6s}")
    for budget in (int(b) for b in args.budgets.split(",")):
        config = GrowConfig.for_budget(budget)
        times, passes, nodes, leaves = [], [], [], []
        for seed in range(args.rounds):
            drafter = FreeDrafter(seed, max(255, budget + 1))
            start = time.perf_counter()
            tree, steps = grow(drafter, 1, config)
            times.append(time.perf_counter() - start)
            passes.append(steps)
            nodes.append(len(tree) - 1)
            leaves.append(len(tree.leaves()))
        print(f"{budget:6d} {1000 * statistics.median(times):9.2f} {statistics.mean(passes):7.1f} "
              f"{statistics.mean(nodes):6.0f} {statistics.mean(leaves):6.0f}")


if __name__ == "__main__":
    main()
