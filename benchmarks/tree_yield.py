"""Tokens per pass of tree growth, replayed against the target's own text: no target pass runs.

    python benchmarks/tree_yield.py --pair smollm2-135m --prompts benchmarks/chat-prompts.txt --budgets 16,64,255
    python benchmarks/tree_yield.py --pair gemma3-270m --prompts benchmarks/text-prompts.txt --drafter-vocab 32768

With greedy decoding the target's answer at every node of a tree is its plain greedy text, so decoding each prompt
plainly once tells how many tokens any tree would have yielded: walk the tree along that text, accept what
matches, and the next token of the text is the one the target draws. Sampling with a seed works the same way
(`--temperature`): acceptance draws each token with the same random numbers plain sampling uses for it, so a
tree yields the plain text too. This grows the trees with the pair's real
drafter, learns acceptance (edge/acceptance.py) the way a run does, and prints tokens per pass and growth time per
round for a chain and a tree of each budget, in the same order as `edge-spec bench` runs its rows (each prompt
through every row in turn). With a batch-invariant target (the pairs' Q4_1 / Q8_0 files) the figures are what
`edge-spec bench` measures; with `--target-dtype f16` a near-tie can round the other way in a tree pass.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli.loading import head_drafter, load_pair, resolve_pair
from cli.main import prompt_for
from edge.acceptance import Acceptance
from edge.generate import GREEDY_DRAFT_TEMPERATURE, Decoder
from edge.grow import GrowConfig, grow
from edge.registry import load_registry
from edge.sampling import SamplingConfig


class Row:
    def __init__(self, method: str, budget: int, draft_temperature: float, greedy: bool):
        self.method, self.budget = method, budget
        config = GrowConfig.chain(budget) if method == "chain" else GrowConfig.for_budget(budget)
        self.config = replace(config, draft_temperature=draft_temperature)
        self.acceptance = Acceptance(greedy)  # one per row, kept across prompts, as a bench row's Decoder keeps it
        self.tokens = self.rounds = self.passes = 0
        self.grow_s = 0.0
        self.depths: list[int] = []


def replay(row: Row, drafter, prompt: list[int], reference: list[int], stop_tokens: frozenset[int]) -> None:
    """Decode `reference` (the target's greedy tokens after `prompt`) with row's trees; count what they yield.
    As edge.generate.Decoder does, no tree reaches past the reply's last token or grows past a stop token."""
    drafter.truncate(0)
    drafter.prefill(prompt[:-1])
    context, done = list(prompt), 0
    while done < len(reference):
        wanted = len(reference) - done
        config = row.config.within_reply(wanted)
        start = time.perf_counter()
        tree, passes = grow(drafter, context[-1], config, row.acceptance, stop_tokens)
        row.grow_s += time.perf_counter() - start
        path = accepted_path(tree, reference, done)
        accepted = len(path) - 1
        row.depths.append(int(tree.depth.max()))
        new = min(accepted + 1, len(reference) - done)
        row.tokens, row.rounds, row.passes = row.tokens + new, row.rounds + 1, row.passes + passes
        if done + accepted < len(reference):
            row.acceptance.observe(tree, path, reference[done + accepted])
        drafter.commit(tree, path)
        context += reference[done: done + new]
        done += new
    drafter.truncate(0)


def accepted_path(tree, reference: list[int], done: int) -> list[int]:
    """The nodes from the root along `reference` (the target's text, `done` tokens of it already decoded)."""
    path = [0]
    while done + len(path) - 1 < len(reference):
        child = tree.child(path[-1], reference[done + len(path) - 1])
        if child is None:
            break
        path.append(child)
    return path


def plain_replies(loaded, path: Path, n: int, sampling: SamplingConfig) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt of the file (in the pair's chat template, or raw for a base model) and the target's plain reply
    to it, up to `n` tokens; a stop token that ends a reply is part of it, as it is a new token in a run."""
    texts = [line for line in path.read_text().splitlines() if line.strip()]
    prompts = [prompt_for(loaded, text, loaded.template is None) for text in texts]
    plain, replies = Decoder(loaded.target, sampling=sampling), []
    for prompt in prompts:
        plain.set_sampling(sampling)  # the same seed for every prompt, as edge-spec bench does
        plain.reset()
        plain.load(prompt)
        steps = list(plain.generate(n))
        tokens = [s.token for s in steps if s.token is not None]
        if steps[-1].finish_reason == "stop":
            tokens.append(int(plain.context[-1]))
        replies.append(tokens)
    plain.reset()
    return prompts, replies


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
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    spec = resolve_pair(load_registry(), args.pair, None, None, None)
    loaded = load_pair(spec, lambda message: print(message, file=sys.stderr), target_dtype=args.target_dtype)
    drafter = head_drafter(loaded, args.drafter_vocab)
    sampling = SamplingConfig(temperature=args.temperature, seed=args.seed)
    prompts, references = plain_replies(loaded, args.prompts, args.n, sampling)
    stop_tokens = loaded.target.stop_tokens
    budgets = [int(b) for b in args.budgets.split(",")]
    draft_temperature = args.temperature or GREEDY_DRAFT_TEMPERATURE  # what edge.generate.Decoder uses
    methods = args.methods.split(",")
    rows = [Row(method, budget, draft_temperature, not args.temperature) for budget in budgets for method in methods]
    for prompt, reference in zip(prompts, references, strict=True):
        for row in rows:
            replay(row, drafter, prompt, reference, stop_tokens)
    how = f"temperature {args.temperature}, seed {args.seed}" if args.temperature else "greedy"
    print(f"{args.pair}, {len(prompts)} prompts x {args.n} tokens ({sum(map(len, references))} in all), {how}")
    print(f"{'method':>6s} {'budget':>6s} {'tokens/pass':>11s} {'passes/round':>12s} {'grow s/round':>12s} "
          f"{'mean depth':>10s}")
    for row in rows:
        print(f"{row.method:>6s} {row.budget:6d} {row.tokens / row.rounds:11.2f} {row.passes / row.rounds:12.1f} "
              f"{row.grow_s / row.rounds:12.3f} {sum(row.depths) / len(row.depths):10.1f}")


if __name__ == "__main__":
    main()
