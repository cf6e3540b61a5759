"""One round of lossless tree speculation: grow, verify, accept, commit.

    tree      = grow(drafter, root, budget)            # SpecExec best-first, drafter only
    logits    = target.verify(tree)                    # ONE target pass over every node
    path, tok = accept(tree, logits, ...)              # sample-and-match below, or the residual rule
    target.commit(path); drafter.commit(path)          # both caches hold the committed text
    emit tokens of path[1:], then tok                  # tok is the next round's root

Acceptance (sample-and-match) is lossless for ANY drafter: at node v draw x from the target's own
distribution at v; if some child of v carries x, move there, else emit x and stop. Every emitted token is
a draw from the target given exactly the tokens before it, so the output has the target's distribution
(greedy: the target's argmax, token for token); the drafter only decides how many draws one pass yields.
The tree must not depend on those draws, and it does not: growth uses the drafter alone.

The residual rule (edge/residual.py, `rule="residual"`) draws each expanded node's children from the drafter's
distribution q instead of taking its top-k, and at each node of the path tests them against the target's p
(accept x with probability min(1, p(x)/q(x)), else go on with the residual); its token has p's distribution too.
Coupled sampling (edge/coupled.py, `rule="coupled"`) is sample-and-match whose draws come from noise fixed by each
token's position, the noise the drafter ranks its children on too.
Which rule a round uses, and its tree's shape, is the round policy's choice (edge/policy.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from edge.acceptance import Acceptance
from edge.coupled import CoupledProposer, Noise, coupled_draw
from edge.errors import ModelFault
from edge.grow import GrowConfig, grow
from edge.lookup import LookupTree
from edge.protocols import Drafter, Target
from edge.residual import Proposer, residual_draw
from edge.sampling import SamplingConfig, distribution, draw
from edge.tree import DRAFTED, LOOKED_UP, TokenTree

RULES = ("match", "residual", "coupled")


def accept(tree: TokenTree, logits: np.ndarray, sampling: SamplingConfig, history: Sequence[int],
           rng: np.random.Generator, proposer: Proposer | None = None,
           noise: Noise | None = None) -> tuple[list[int], int]:
    """logits: [n_nodes, n_vocab]. Returns the accepted path (node ids, root first) and the target's next token.

    Touches only the rows on one path; `history` is the committed text before the root, for penalties. With a
    `proposer` (the residual rule), a node whose children were drawn from q tests them first. With `noise` (coupled
    sampling, edge/coupled.py) the target draws by the noise of each token's position instead of from `rng`.
    """
    path = [0]
    seen = [*history, int(tree.tokens[0])]
    while True:
        row = logits[path[-1]]  # read once: a replayed target's rows can be read only down one path
        if np.isnan(row).any():
            raise ModelFault("the target's logits are not numbers (NaN): its model file is damaged or was changed "
                             "while loaded; download it again (edge-spec rm, then pull)")
        proposal = None if proposer is None else proposer.at(seen[len(history):])
        if proposal is None:
            token = draw(row, sampling, seen, rng) if noise is None else coupled_draw(row, sampling, seen, noise)
        else:
            token = residual_draw(*distribution(row, sampling, seen), proposal, rng)
        child = tree.child(path[-1], token)
        if child is None:
            return path, token
        path.append(child)
        seen.append(token)


def accept_and_learn(tree: TokenTree, logits: np.ndarray, sampling: SamplingConfig, history: Sequence[int],
                     rng: np.random.Generator, proposer: Proposer | None, acceptance: Acceptance | None,
                     lookup_acceptance: Acceptance | None, noise: Noise | None = None) -> tuple[list[int], int]:
    """accept(), then each measured rate learns from the round: the drafter's nodes, and lookup's."""
    path, token = accept(tree, logits, sampling, history, rng, proposer, noise)
    if acceptance is not None:
        acceptance.observe(tree, path, token, DRAFTED)
    if lookup_acceptance is not None:
        lookup_acceptance.observe(tree, path, token, LOOKED_UP)
    return path, token


class Stopwatch:
    """Seconds by step of one round: `with clock("verify"):` adds the block's time to clock.seconds["verify"]."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class RoundResult:
    tokens: list[int]  # accepted path tokens after the root, then the target's own token
    tree: TokenTree  # what was verified (the root alone in a plain round)
    path: list[int]  # the accepted path, node ids, root first
    drafter_passes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # by step: grow, verify, commit, drafter commit

    @property
    def tree_size(self) -> int:
        return len(self.tree)

    @property
    def grow_s(self) -> float:  # growing the tree (drafter passes)
        return self.seconds.get("grow", 0.0)

    @property
    def draft_s(self) -> float:  # all drafter time: growth plus keeping the accepted path
        return self.grow_s + self.seconds.get("drafter commit", 0.0)

    @property
    def verify_s(self) -> float:  # the target's pass and acceptance
        return self.seconds.get("verify", 0.0)


def speculative_round(target: Target, drafter: Drafter | None, context: Sequence[int], grow_config: GrowConfig | None,
                      sampling: SamplingConfig, rng: np.random.Generator,
                      acceptance: Acceptance | None = None, stop_tokens: frozenset[int] = frozenset(),
                      rule: str = "match", draft_rng: np.random.Generator | None = None,
                      lookup: LookupTree | None = None, lookup_acceptance: Acceptance | None = None,
                      noise: Noise | None = None) -> RoundResult:
    """context: every committed token; its last one is the root. Without a grow config, or with neither a drafter nor
    lookup branches, this is plain decoding. `acceptance` (optional) ranks the drafter's nodes by measured acceptance
    and learns from this round, `lookup_acceptance` the lookup branches'; the tree grows nothing past `stop_tokens`.
    `rule`: "match" or "residual" (whose children are drawn with `draft_rng`: the target's draws must not depend on
    them) or "coupled", which needs the reply's `noise`: the target draws by it in every round, plain ones included,
    and the drafter's children are ranked on it (edge/coupled.py). A lookup branch is accepted whenever the target's
    own draw lands on it, under any rule."""
    clock, proposer, expand, passes = Stopwatch(), None, None, 0
    with clock("grow"):
        tree = TokenTree.root(context[-1])
        if grow_config is not None and (drafter is not None or lookup):
            if drafter is not None:
                target.prefetch()  # a streamed target reads its weights while we draft
                if rule == "residual":
                    proposer = Proposer(drafter, sampling, context[:-1], draft_rng or np.random.default_rng())
                    expand = proposer.expand
                elif rule == "coupled" and noise is not None:
                    expand = CoupledProposer(drafter, sampling, context[:-1], noise).expand
            tree, passes = grow(drafter, context[-1], grow_config, acceptance, stop_tokens, expand, lookup,
                                lookup_acceptance)
    with clock("verify"):
        path, token = accept_and_learn(tree, target.verify(tree), sampling, context[:-1], rng, proposer, acceptance,
                                       lookup_acceptance, noise)
    with clock("commit"):
        target.commit(tree, path)
    with clock("drafter commit"):
        if drafter is not None:
            drafter.commit(tree, path)
    return RoundResult([*tree.path_tokens(path[1:]), token], tree, path, passes, clock.seconds)
