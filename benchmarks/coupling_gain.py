"""How often the drafter's first child (and first `--width` children) holds the target's sampled token, by how much
of the target's noise the drafter ranks them with (edge/coupled.py's COUPLING): what coupled sampling can gain over
sample-and-match with independent draws, position by position.

    python benchmarks/coupling_gain.py --pair qwen2.5-coder-1.5b --prompts benchmarks/chat-prompts.txt \
        --temperature 0.8 -n 48

The target samples a reply at the temperature (no top-k, top-p or min-p) while the drafter reads it, and at every
position both distributions are kept: p (the target's, its 256 likeliest tokens) and q (the drafter's, over the pool
edge/coupled.py ranks). Then, for `--draws` Gumbel noises g per position, the target's token is argmax log p + g and
the drafter's children are its tokens by log q + c * g, for each share c of `--couplings`: c = 0 is the drafter's
likeliest tokens, what sample-and-match with independent draws offers (its hit rate is then sum p over them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from edge.models.bench import read_prompts

import edge
from edge.residual import POOL
from edge.sampling import SamplingConfig, distribution
from edge.tree import TokenTree

P_TOP = 256  # the target's likeliest tokens kept per position (their mass is all but a rounding error at T <= 1)


def positions(pair, prompts: list[list[int]], n: int, sampling: SamplingConfig,
              rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """(p, q) over the union of their tokens at each position of the target's sampled replies."""
    target, drafter, out = pair.target, pair.drafter, []
    for ids in prompts:
        for model in (target, drafter):
            model.truncate(0)
            model.prefill(ids[:-1])
        context = list(ids)
        for _ in range(n):
            root = TokenTree.root(context[-1])
            row = np.array(target.verify(root)[0])
            q_top, q_log, q_logits = drafter.expand_logits(root, np.array([0]), POOL)
            p_ids, p = distribution(row, sampling, context)
            q_ids, q = distribution(q_logits[0], sampling, context, ids=q_top[0].astype(np.int64),
                                    log_mass=float(q_logits[0, 0] - q_log[0, 0]))
            top = np.argsort(-p)[:P_TOP]
            union = np.union1d(p_ids[top], q_ids)
            p_u, q_u = np.zeros(len(union)), np.zeros(len(union))
            p_u[np.searchsorted(union, p_ids[top])] = p[top]
            q_u[np.searchsorted(union, q_ids)] = q
            out.append((p_u / p_u.sum(), q_u))
            token = int(p_ids[min(int(np.searchsorted(np.cumsum(p), rng.random())), len(p) - 1)])
            target.commit(root, [0])
            drafter.commit(root, [0])
            context.append(token)
            if token in target.special.stop:
                break
    return out


def hit_rates(rows: list[tuple[np.ndarray, np.ndarray]], coupling: float, width: int, draws: int,
              rng: np.random.Generator) -> tuple[float, float]:
    """(first child's hit rate, first `width` children's) over the positions and noises."""
    first = within = total = 0
    for p, q in rows:
        g = rng.gumbel(size=(draws, len(p)))
        with np.errstate(divide="ignore"):
            token = np.argmax(np.log(p) + g, axis=1)
            order = np.argsort(-(np.log(q) + coupling * g), axis=1)[:, :width]
        first += int((order[:, 0] == token).sum())
        within += int((order == token[:, None]).any(axis=1).sum())
        total += draws
    return first / total, within / total


def main() -> None:
    parser = argparse.ArgumentParser(prog="coupling_gain.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("-n", type=int, default=48, help="tokens per prompt")
    parser.add_argument("--width", type=int, default=4, help="children a tree scores per node")
    parser.add_argument("--couplings", default="0,0.25,0.5,0.75,1", help="shares of the noise, comma-separated")
    parser.add_argument("--draws", type=int, default=400, help="noises per position")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sampling = SamplingConfig(temperature=args.temperature)
    rng = np.random.default_rng(args.seed)
    with edge.load(args.pair, report=lambda m: print(m, file=sys.stderr)) as pair:
        if pair.drafter is None:
            raise SystemExit(f"{args.pair} has no drafter model")
        prompts = [pair.prompt_tokens(text) for text in read_prompts(args.prompts)]
        rows = positions(pair, prompts, args.n, sampling, rng)
    result = {"pair": args.pair, "prompts": str(args.prompts), "temperature": args.temperature,
              "positions": len(rows), "width": args.width, "rows": []}
    for coupling in (float(c) for c in args.couplings.split(",")):
        first, within = hit_rates(rows, coupling, args.width, args.draws, rng)
        result["rows"].append({"coupling": coupling, "first": round(first, 4), "within_width": round(within, 4)})
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.pair}, {len(prompts)} prompts, {len(rows)} positions, temperature {args.temperature:g}")
    print(f"{'coupling':>8s} {'first':>7s} {'first ' + str(args.width):>8s}")
    for row in result["rows"]:
        print(f"{row['coupling']:8.2f} {row['first']:7.1%} {row['within_width']:8.1%}")


if __name__ == "__main__":
    main()
