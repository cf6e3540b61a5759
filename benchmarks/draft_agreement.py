"""How often the drafter's top-k holds the target's greedy token, along the target's own text: what any greedy tree
can gain over a chain of the same size.

    python benchmarks/draft_agreement.py --pair smollm2-135m --prompts benchmarks/chat-prompts.txt -n 128
    python benchmarks/draft_agreement.py --pair gemma3-270m --prompts benchmarks/text-prompts.txt \
        --drafter-vocab 32768 --target-dtype f16 -n 128

The drafter reads each reply token by token (one node a pass, as a chain drafts), and at every position its top
`--width` tokens are compared with the token the target chose there. A greedy tree can only beat the chain where
the target's token is a runner-up: a runner-up kept at depth d is worth (chance to reach d) x (its rate), while
the chain's last token of a budget B is worth about agreement^B. Where runner-ups are rarely right even in the
drafter's least sure bins, the best tree of B nodes is the chain itself.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np
from edge.models.bench import read_prompts
from replay import plain_replies  # benchmarks/replay.py, beside this script

import edge
from edge.sampling import SamplingConfig
from edge.tree import TokenTree

EDGES = [0.0, 0.3, 0.5, 0.7, 0.9, 0.98, 1.0001]  # bins of the drafter's probability for its top token


def teacher_forced(drafter, prompt: list[int], reply: list[int], width: int) -> list[tuple[float, int]]:
    """(the drafter's top probability, the target token's rank in its top `width`, or `width` when absent) for
    every position of `reply`, the drafter reading the reply itself."""
    drafter.truncate(0)
    drafter.prefill(prompt[:-1])
    context, rows = list(prompt), []
    for token in reply:
        root = TokenTree.root(context[-1])
        ids, log_probs = drafter.expand(root, np.array([0]), width)
        hits = np.flatnonzero(ids[0] == token)
        rows.append((float(np.exp(log_probs[0, 0])), int(hits[0]) if len(hits) else width))
        drafter.commit(root, [0])
        context.append(token)
    drafter.truncate(0)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--drafter-vocab", type=int, default=None, help="an onnx drafter with this trimmed head")
    parser.add_argument("--target-dtype", default=None, help="as in edge-spec bench (default: the pair's target)")
    parser.add_argument("-n", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--width", type=int, default=4, help="children a tree scores per node")
    args = parser.parse_args()

    with edge.load(args.pair, report=lambda message: print(message, file=sys.stderr), target_dtype=args.target_dtype,
                   drafter_runtime="onnx" if args.drafter_vocab else None, drafter_vocab=args.drafter_vocab) as pair:
        prompts = [pair.prompt_tokens(text) for text in read_prompts(args.prompts)]
        replies = plain_replies(pair.target, prompts, args.n, SamplingConfig())
        rows = np.array([row for prompt, reply in zip(prompts, replies, strict=True)
                         for row in teacher_forced(pair.drafter, prompt, reply, args.width)])
    top_p, rank = rows[:, 0], rows[:, 1].astype(int)
    agreement = float(np.mean(rank == 0))
    print(f"{args.pair}, {len(prompts)} prompts x {args.n} tokens ({len(rows)} positions), greedy: the drafter's top "
          f"token is the target's {agreement:.2%} of the time; misses: {int(np.sum(rank == 1))} at rank 1, "
          f"{int(np.sum((rank > 1) & (rank < args.width)))} at ranks 2-{args.width - 1}, "
          f"{int(np.sum(rank == args.width))} outside the top {args.width}")
    print(f"{'top p':>11s} {'positions':>9s} {'top right':>9s} {'rank 1':>7s} {'ranks 2+':>8s} {'absent':>7s}")
    best_runner_up = 0.0
    for low, high in itertools.pairwise(EDGES):
        cell = rank[(top_p >= low) & (top_p < high)]
        if len(cell):
            best_runner_up = max(best_runner_up, float(np.mean(cell == 1)))
            print(f"{low:5.2f}-{min(high, 1):5.2f} {len(cell):9d} {np.mean(cell == 0):9.3f} {np.mean(cell == 1):7.3f} "
                  f"{np.mean((cell > 1) & (cell < args.width)):8.3f} {np.mean(cell == args.width):7.3f}")
    chain_last = ", ".join(f"{b}: {agreement ** b:.2f}" for b in (16, 32, 64, 127))
    print(f"a runner-up is right at most {best_runner_up:.3f} of the time in any bin; the chain's last token of a "
          f"budget is worth about agreement^budget ({chain_last})")


if __name__ == "__main__":
    try:
        main()
    except edge.UserError as error:
        from edge.cli.render import worded

        sys.exit(f"error: {worded(error)}")
