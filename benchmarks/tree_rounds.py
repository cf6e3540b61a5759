"""Tree against chain round by round, from the same state: where a greedy tree of a budget yields less than a
chain drafting as many tokens, replayed against the target's own text (benchmarks/replay.py, as tree_yield.py does).

    python benchmarks/tree_rounds.py --pair smollm2-135m --prompts benchmarks/chat-prompts.txt --budget 16

Every round grows a chain and then a tree from the same drafter state, counts what each accepts of the target's
text, and goes on along the tree's path. It prints how many rounds each won, the tree's top-token depth, and the
drafter's consistency: how far one node's log-probs move when its pass also holds a masked sibling slot (a tree
pass) against the same node run as a chain runs it. A drafter whose outputs move there rounds near-ties
differently in a tree than the chain and the target's own plain decoding did (docs/performance.md, "Where the
greedy tree loses").
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from edge.models.bench import read_prompts
from replay import ReplayTarget, plain_replies, replay  # benchmarks/replay.py, beside this script

import edge
from edge.generate import Decoder
from edge.grow import GrowConfig, grow
from edge.protocols import Drafter
from edge.rules import GREEDY_DRAFT_TEMPERATURE
from edge.sampling import SamplingConfig
from edge.speculative import RoundResult
from edge.tree import TokenTree


class ChainBeside:
    """The Decoder's budget policy: a tree of the budget every round, and before it, from the same drafter state, a
    chain of as many tokens, scored against the replayed text. Keeps (tree accepted, chain accepted, the tree's
    top-token depth) per round."""

    def __init__(self, budget: int, target: ReplayTarget, drafter: Drafter):
        self.tree_config = GrowConfig.for_budget(budget)
        # scored as the Decoder scores the greedy tree (a chain keeps its top tokens whatever the temperature)
        self.chain_config = replace(GrowConfig.chain(budget), draft_temperature=GREEDY_DRAFT_TEMPERATURE)
        self.target, self.drafter = target, drafter
        self.rounds: list[tuple[int, int, int]] = []
        self._chain_accepted = self._wanted = 0

    def choose(self, max_nodes: int, rule: str = "match") -> GrowConfig:
        self._wanted = self.target.tokens_left
        config = self.chain_config.within_reply(self._wanted)
        chain, _ = grow(self.drafter, self.target.root, config, None, self.target.special.stop)
        self._chain_accepted = len(self.target.accepted_path(chain)) - 1
        self.drafter.truncate(self.target.n_past)  # forget the chain's slots; the tree grows from the root again
        return self.tree_config

    def observe(self, config: GrowConfig | None, result: RoundResult, rule: str = "match") -> None:
        assert result.tree is not None and result.path is not None
        accepted = min(len(result.path) - 1, self._wanted)  # nothing past the reply's end counts
        self.rounds.append((accepted, self._chain_accepted, top_depth(result.tree)))

    def hold_timing(self, held: bool) -> None:
        pass  # a fixed tree, as FixedBudget


def top_depth(tree: TokenTree) -> int:
    """How deep the drafter's top-token path runs inside the tree."""
    node, depth = 0, 0
    while True:
        children = np.flatnonzero(tree.parents == node)
        top = children[tree.rank[children] == 0]
        if len(top) == 0:
            return depth
        node, depth = int(top[0]), depth + 1


def masked_slot_shift(drafter, prompt: list[int], width: int = 8) -> float:
    """Largest log-prob difference for the root's top child expanded after a masked sibling ran, against alone."""
    def tree(tokens: list[int]) -> TokenTree:
        parents = np.array([-1] + [0] * (len(tokens) - 1), np.int32)
        depth = np.array([0] + [1] * (len(tokens) - 1), np.int32)
        return TokenTree(np.array(tokens, np.int32), parents, depth, np.zeros(len(tokens), np.float32))

    outputs = []
    for sibling in (None, True):
        drafter.truncate(0)
        drafter.prefill(prompt[:-1])
        ids, _ = drafter.expand(TokenTree.root(prompt[-1]), np.array([0]), 2)
        first, second = (int(t) for t in ids[0])
        if sibling:
            both = tree([prompt[-1], first, second])
            drafter.expand(both, np.array([2]), width)
            outputs.append(drafter.expand(both, np.array([1]), width))
        else:
            outputs.append(drafter.expand(tree([prompt[-1], first]), np.array([1]), width))
    drafter.truncate(0)
    (ids_a, lp_a), (ids_b, lp_b) = outputs
    common = np.intersect1d(ids_a[0], ids_b[0])
    a = {int(t): float(v) for t, v in zip(ids_a[0], lp_a[0], strict=True)}
    b = {int(t): float(v) for t, v in zip(ids_b[0], lp_b[0], strict=True)}
    return max(abs(a[int(t)] - b[int(t)]) for t in common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("-n", type=int, default=64, help="tokens per prompt")
    args = parser.parse_args()

    with edge.load(args.pair, report=lambda message: print(message, file=sys.stderr)) as pair:
        prompts = [pair.prompt_tokens(text) for text in read_prompts(args.prompts)]
        references = plain_replies(pair.target, prompts, args.n, SamplingConfig())
        target = ReplayTarget.like(pair.target)
        policy = ChainBeside(args.budget, target, pair.drafter)
        decoder = Decoder(target, pair.drafter, policy, SamplingConfig())
        for prompt, reference in zip(prompts, references, strict=True):
            replay(decoder, prompt, reference)
        shifts = [masked_slot_shift(pair.drafter, prompt) for prompt in prompts]
    rounds = policy.rounds
    tree_won = sum(t > c for t, c, _ in rounds)
    chain_won = sum(c > t for t, c, _ in rounds)
    print(f"{args.pair}, budget {args.budget}, {len(prompts)} prompts x {args.n} tokens, greedy, {len(rounds)} rounds")
    tree_mean, chain_mean = (np.mean([r[i] for r in rounds]) for i in (0, 1))
    print(f"  accepted per round: tree {tree_mean:.2f}, chain {chain_mean:.2f} (from the same state); "
          f"rounds won: tree {tree_won}, chain {chain_won}")
    print(f"  tree's top-token depth: {np.mean([r[2] for r in rounds]):.1f} (the chain's: up to {args.budget})")
    print(f"  a node's log-probs with a masked sibling slot in its pass against alone: largest shift "
          f"{max(shifts):.4f}, median {np.median(shifts):.4f} over {len(prompts)} prompts")


if __name__ == "__main__":
    try:
        main()
    except edge.UserError as error:
        from edge.cli.render import worded

        sys.exit(f"error: {worded(error)}")
