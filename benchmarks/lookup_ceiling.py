"""How much lookup could add to the drafter's trees at a fixed budget, at most: the drafter alone decodes each prompt
(greedy, lookup off), and at the start of each of its rounds the lookup proposer sees the same text. Where lookup's
branches hold a longer stretch of the target's own reply than the drafter's accepted path (at most the budget's
nodes of it), the round could have yielded that stretch instead. The sum over rounds of the better of the two, over
the drafter's own tokens, bounds what merging lookup's branches into the tree can give in tokens a pass with the
same rounds: it is the ratio to compare with what drafter + lookup measures (`edge-spec bench --drafters
onnx,onnx+lookup`).

    python benchmarks/lookup_ceiling.py --pair qwen2.5-coder-1.5b --prompts benchmarks/editing-prompts.jsonl \
        --budgets 16,64 -n 128 --json

Tokens a pass do not depend on where the target's weights are (RAM or the SSD: the same kernels, the same tokens),
so this runs the target in RAM.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def follow(tree, truth: list[int], start: int) -> int:
    """How many of truth[start:] a path of lookup's tree holds, from its root."""
    children: dict[tuple[int, int], int] = {(b.parent, b.token): i for i, b in enumerate(tree.branches)}
    node, held = -1, 0
    while start + held < len(truth) and (node := children.get((node, truth[start + held]), -2)) != -2:
        held += 1
    return held


def ceiling(pair, prompts: list[list[int]], budget: int, n: int) -> dict:
    from edge.lookup import Corpus, Lookup
    from edge.policy import LOOKUP_BRANCHES
    from edge.sampling import SamplingConfig

    decoder = pair.decoder(SamplingConfig(), speculate=True, budget=budget)
    corpus = Corpus()  # earlier replies count, as in a run of the pair
    rounds = drafted = best = passes = 0
    for ids in prompts:
        decoder.reset()
        steps = list(decoder.reply(ids, n))
        tokens = [s.token for s in steps[:-1]]
        starts = [i for i, s in enumerate(steps[:-1]) if i == 0 or s.stats.rounds != steps[i - 1].stats.rounds]
        truth = list(ids) + tokens
        lookup = Lookup(corpus)
        for k, first in enumerate(starts):
            got = (starts[k + 1] if k + 1 < len(starts) else len(tokens)) - first
            lookup.set_text(truth[: len(ids) + first])
            held = min(follow(lookup.propose(LOOKUP_BRANCHES), truth, len(ids) + first), budget)
            drafted += got
            best += max(got, min(held + 1, len(tokens) - first))
        rounds += len(starts)
        passes += steps[-1].stats.target_passes
        lookup.remember(tokens)
    return {"budget": budget, "rounds": rounds, "tokens": drafted, "tokens_per_pass": round(drafted / passes, 3),
            "best_of_tokens": best, "ceiling_ratio": round(best / drafted, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="qwen2.5-coder-1.5b")
    parser.add_argument("--prompts", type=Path, default=Path("benchmarks/editing-prompts.jsonl"))
    parser.add_argument("--budgets", default="16,64", help="fixed tree budgets to run the drafter at")
    parser.add_argument("-n", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--drafter-vocab", type=int, default=None,
                        help="an onnx drafter's head cut to this many frequent tokens (VocabTrim; 0: the full head)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    from edge.models.bench import read_prompts

    import edge

    say = lambda message: print(message, file=sys.stderr)  # noqa: E731
    with edge.load(args.pair, placement="ram", lookup="off", drafter_vocab=args.drafter_vocab, report=say) as pair:
        if pair.drafter is None:
            raise SystemExit(f"{args.pair} has no drafter model: the ceiling compares lookup with one")
        prompts = [pair.prompt_tokens(text) for text in read_prompts(args.prompts)]
        rows = [ceiling(pair, prompts, int(b), args.n) for b in args.budgets.split(",")]
    out = {"pair": args.pair, "prompts": str(args.prompts), "n": args.n, "drafter_vocab": args.drafter_vocab,
           "rows": rows}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for row in rows:
        print(f"budget {row['budget']:4d}: drafter alone {row['tokens_per_pass']:.2f} tokens/pass over "
              f"{row['rounds']} rounds; with lookup's better stretch each round, at most {row['ceiling_ratio']:.3f}x")


if __name__ == "__main__":
    main()
