"""Tokens per pass of tree growth, replayed against the target's own text: no target pass runs.

    python benchmarks/tree_yield.py --pair smollm2-135m --prompts benchmarks/chat-prompts.txt --budgets 16,64,255
    python benchmarks/tree_yield.py --pair gemma3-270m --prompts benchmarks/text-prompts.txt --drafter-vocab 32768

With greedy decoding the target's answer at every node of a tree is its plain greedy text, so decoding each prompt
plainly once tells how many tokens any tree would have yielded. Sampling with a seed works the same way
(`--temperature`): acceptance draws each token with the same random numbers plain sampling uses for it, so a tree
yields the plain text too. The rounds then run as a run does, over a target that answers from that text
(benchmarks/replay.py): the trees grow with the pair's real drafter, acceptance is learned (edge/acceptance.py), and it
prints tokens per pass and growth time per round for a chain and a tree of each budget, in the same order as
`edge-spec bench` runs its rows (each prompt through every row in turn). With a batch-invariant target (the pairs'
Q4_1 / Q8_0 files) the figures are what `edge-spec bench` measures; with `--target-dtype f16` a near-tie can round
the other way in a tree pass.

    python benchmarks/tree_yield.py --pair smollm2-135m --prompts benchmarks/chat-prompts.txt --budgets 64,255,1024 \
        --methods tree --temperature 0.8 --accept match,residual

The residual rule (`--accept residual`, edge/residual.py) does not emit plain sampling's text, so no reply can be
replayed for it: its rows run over replay.PathTarget, the real target run only on the nodes acceptance reads,
one token a pass down the accepted path (plain decoding's cost, never the tree pass). Exact on a batch-invariant
target, and the way to compare budgets whose tree passes are slow here (1024 nodes: seconds a pass on 2 cores).
Rows in the same order as `edge-spec bench`: with a seed, each row's figures are a bench row's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edge.models.bench import read_prompts
from replay import PathTarget, ReplayTarget, plain_replies, replay  # benchmarks/replay.py, beside this script

import edge
from edge.generate import Decoder, Stats
from edge.grow import GrowConfig
from edge.protocols import Drafter
from edge.sampling import SamplingConfig
from edge.speculative import RoundResult


class Row:
    """One method and budget: its own Decoder (acceptance learned across prompts, as a bench row's), and its figures
    summed over prompts. It is that Decoder's budget policy, a fixed tree shape, to see the depth of each tree."""

    def __init__(self, method: str, budget: int, accept: str, target: ReplayTarget | PathTarget, drafter: Drafter,
                 sampling: SamplingConfig):
        self.method, self.budget, self.accept = method, budget, accept
        self.config = GrowConfig.chain(budget) if method == "chain" else GrowConfig.for_budget(budget)
        self.decoder = Decoder(target, drafter, self, sampling, accept=accept)
        self.stats = Stats()
        self.depths: list[int] = []

    def choose(self, max_nodes: int, rule: str = "match") -> GrowConfig:
        return self.config  # the Decoder fits it to the room and the reply left, as a fixed budget

    def observe(self, config: GrowConfig | None, result: RoundResult, rule: str = "match") -> None:
        assert result.tree is not None
        self.depths.append(int(result.tree.depth.max()))

    def hold_timing(self, held: bool) -> None:
        pass  # a fixed tree, as FixedBudget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--budgets", default="16,32,64,255")
    parser.add_argument("--methods", default="chain,tree")
    parser.add_argument("--drafter-vocab", type=int, default=None, help="an onnx drafter with this trimmed head")
    parser.add_argument("--target-dtype", default=None, help="as in edge-spec bench (default: the pair's target)")
    parser.add_argument("-n", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="the target's sampling temperature (0: greedy)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accept", default="match", help="acceptance rules, comma-separated: match, residual")
    args = parser.parse_args()

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              seed=args.seed)
    accepts = args.accept.split(",")
    if not set(accepts) <= {"match", "residual"}:
        raise edge.UserError(f"--accept takes match and residual (got {args.accept})")
    accepts = ["match"] if sampling.greedy else accepts  # greedy: the rules are the same, as in edge-spec bench
    with edge.load(args.pair, report=lambda message: print(message, file=sys.stderr), target_dtype=args.target_dtype,
                   drafter_runtime="onnx" if args.drafter_vocab else None, drafter_vocab=args.drafter_vocab) as pair:
        prompts = [pair.prompt_tokens(text) for text in read_prompts(args.prompts)]
        references = plain_replies(pair.target, prompts, args.n, sampling)
        replayed, walked = ReplayTarget.like(pair.target), PathTarget(pair.target)
        rows = [Row(method, int(budget), accept, replayed if accept == "match" else walked, pair.drafter, sampling)
                for budget in args.budgets.split(",") for method in args.methods.split(",") for accept in accepts]
        for prompt, reference in zip(prompts, references, strict=True):  # each prompt through every row in turn
            for row in rows:
                if row.accept == "match":
                    row.stats.add(replay(row.decoder, prompt, reference))
                else:
                    row.stats.add(walk(row.decoder, prompt, args.n))
    how = "greedy" if sampling.greedy else sampling.described()
    print(f"{args.pair}, {len(prompts)} prompts x {args.n} tokens ({sum(map(len, references))} in all), {how}")
    print(f"{'method':>6s} {'budget':>6s} {'accept':>8s} {'tokens/pass':>11s} {'passes/round':>12s} "
          f"{'grow s/round':>12s} {'mean depth':>10s}")
    for row in rows:
        stats = row.stats
        print(f"{row.method:>6s} {row.budget:6d} {row.accept:>8s} {stats.new_tokens / stats.rounds:11.2f} "
              f"{stats.drafter_passes / stats.rounds:12.1f} {stats.grow_s / stats.rounds:12.3f} "
              f"{sum(row.depths) / len(row.depths):10.1f}")


def walk(decoder: Decoder, prompt: list[int], max_tokens: int) -> Stats:
    """One prompt over a PathTarget, from empty caches and the sampling seed, as a bench row decodes it."""
    decoder.set_sampling(decoder.sampling)
    decoder.reset()
    decoder.load(prompt)
    *_, last = decoder.generate(max_tokens)
    decoder.reset()
    return last.stats


if __name__ == "__main__":
    try:
        main()
    except edge.UserError as error:
        from edge.cli.render import worded

        sys.exit(f"error: {worded(error)}")
