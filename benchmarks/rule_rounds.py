"""Each acceptance rule's rounds, one by one: how much a round's yield varies, how the prompts differ, and what share
of the better rule `--accept auto`'s choice (edge.rules.RuleChoice, as shipped) reaches when each round's yield is
drawn from the rounds measured here, fresh and started from what an earlier run of 100 rounds a rule kept
(docs/performance.md, "`--accept auto` against each rule").

    python benchmarks/rule_rounds.py --pair smollm2-135m --budget 64 --temperature 0.8 --seed 0 --json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from edge.models.bench import read_prompts
from edge.models.loading import open_pair

from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.options import LoadOptions
from edge.rules import AUTO_RULES, RuleChoice
from edge.sampling import SamplingConfig


def round_yields(decoder: Decoder, prompts: list[list[int]], max_tokens: int,
                 sampling: SamplingConfig) -> list[list[int]]:
    """Per prompt, the tokens each tree round yielded (from the reply's stats as each round ends)."""
    replies = []
    for tokens in prompts:
        decoder.set_sampling(sampling)
        yields, before = [], {}
        for step in decoder.reply(tokens, max_tokens):
            now = step.stats.rule_tokens
            yields += [now[rule] - before.get(rule, 0) for rule in now if now[rule] != before.get(rule, 0)]
            before = dict(now)
        decoder.reset()
        replies.append(yields)
    return replies


def simulated_share(yields: dict[str, list[int]], rounds: int, runs: int, rng: random.Random,
                    kept: int = 0) -> list[float]:
    """RuleChoice over `rounds` rounds whose yields are drawn from each rule's measured ones: each run's mean yield
    over the better rule's. `kept`: each run starts from what an earlier run kept of each rule, its mean over `kept`
    rounds drawn alike (as a benchmark's rows keep theirs)."""
    best = max(statistics.fmean(values) for values in yields.values())
    shares = []
    for _ in range(runs):
        start = {rule: [statistics.fmean(rng.choice(values) for _ in range(kept)), kept]
                 for rule, values in yields.items()} if kept else {}
        choice, total = RuleChoice.kept(start), 0
        for _ in range(rounds):
            rule = choice.pick().name
            tokens = rng.choice(yields[rule])
            choice.observe(rule, tokens)
            total += tokens
        shares.append(total / rounds / best)
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2-135m")
    parser.add_argument("--placement", default="ram")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-n", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    pair = open_pair(LoadOptions(pair=args.pair, placement=args.placement))
    sampling = SamplingConfig(temperature=args.temperature, seed=args.seed)
    prompts = [pair.prompt_tokens(prompt, raw=None) for prompt in read_prompts(None)]
    out: dict = {"pair": args.pair, "budget": args.budget, "temperature": args.temperature, "rules": {}}
    yields = {}
    for rule in AUTO_RULES:
        decoder = Decoder(pair.target, pair.drafter, GrowConfig.for_budget(args.budget), sampling, rule,
                          overlap=pair.overlaps)
        replies = round_yields(decoder, prompts, args.n, sampling)
        yields[rule] = [y for reply in replies for y in reply]
        half = len(replies) // 2
        out["rules"][rule] = {
            "rounds": len(yields[rule]), "mean": round(statistics.fmean(yields[rule]), 2),
            "stdev": round(statistics.pstdev(yields[rule]), 2),
            "first_half_prompts": round(statistics.fmean(y for r in replies[:half] for y in r), 2),
            "second_half_prompts": round(statistics.fmean(y for r in replies[half:] for y in r), 2)}
    rng = random.Random(0)
    for kept, runs in ((0, (50, 150, 500)), (100, (60, 100))):
        for rounds in runs:
            shares = sorted(simulated_share(yields, rounds, 2000, rng, kept))
            name = f"auto_share_{rounds}_rounds" + (f"_kept_{kept}" if kept else "")
            out[name] = {"mean": round(statistics.fmean(shares), 3), "p10": round(shares[len(shares) // 10], 3)}
    pair.close()
    print(json.dumps(out, indent=2 if args.json else None))


if __name__ == "__main__":
    main()
