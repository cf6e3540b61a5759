"""Drafting while the target's pass runs: each round's tree is verified in a worker thread, and meanwhile the drafter
goes on growing past it, on the cores the pass leaves idle (a target streamed from a drive waits on its reads; a
target on a GPU leaves every core to the drafter).

    tree  = the tree grown before the pass, or the one grown during the previous pass (below)
    pass  = target.verify(tree), in a worker thread
    while the pass runs: the drafter grows on, best first, past the tree's budget
    path, token = accept(tree, logits)                     # on the main thread (edge/speculative.py run_round)
    next tree = what growth holds below path + token       # the outcome that happened, grown while it was unknown

Growth goes on from the tree's own frontier, so the nodes it adds are the likeliest continuations of every outcome
the pass may have: deeper along the paths the target may accept, and the runner-ups of each node, one of which is
the target's own token wherever the accepted path ends. Once acceptance is known, the node for that token (if growth
offered it) roots the next round's tree: its subtree, re-rooted, the round's budget at most. That round then drafts
nothing before its pass; during it, the drafter grows from the new root again (the subtree's nodes first, being the
best, then past them), and so on. Where growth had not reached the target's token, the next round grows its tree
before its pass, as without overlap. A tree grown for an outcome that did not happen is dropped: the drafter commits
the accepted path by its tokens (its other branches go), and nothing else of it is kept.

Losslessness is untouched: acceptance is sample-and-match on the tree that was verified, with the same draws, and a
round's tree depends only on committed text (the previous rounds' outcomes), never on its own pass's draws (coupled
rounds rank children on the reply's noise, which the draws never depend on either: edge/coupled.py). Only
sample-and-match rounds, coupled or not, overlap (the residual rule's tree is drawn from q as it is verified); a
residual round grows its tree first, as without overlap.

A drafter and a target that share the CPU contend for its cores while the pass computes (llama.cpp's threads wait
for each other by spinning, so a pass slows down sharply when another process takes a core); the overlap pays where
the pass leaves the cores idle: a target on a GPU. `LoadOptions.overlap` is "auto" by default: on where the target
has layers on a GPU (docs/performance-log.md, "Overlapped drafting", has the figures from the SSD on a 2-core CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from edge.grow import MAX_LEAVES, GrowConfig, Growth
from edge.protocols import Target
from edge.tree import TokenTree

GROW_ON = 4  # while a pass runs, growth may keep this many times the round's budget (MAX_LEAVES at most)
GROW_ON_EXPANSIONS = 64  # expansions growth may add while a pass runs (each is one drafter pass of `beams` nodes)


@dataclass
class Pending:
    """A tree grown during the last pass for the outcome that happened: the next round's, if its context is still
    the one it was grown for."""

    context_length: int  # len(context) after the round: the tree's root is context[-1]
    root: int
    growth: Growth
    node: int  # the root's node in growth


class Overlap:
    """A Decoder's overlapped drafting: the worker thread target passes run in, and the tree grown for the next round.
    `hidden_s`: the drafter's seconds spent while passes ran, summed."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self.pending: Pending | None = None

    def submit(self, target: Target, tree: TokenTree) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="edge-spec-verify")
        return self._pool.submit(target.verify, tree)

    def take(self, context: Sequence[int], config: GrowConfig) -> TokenTree | None:
        """The tree grown during the last pass for this context's root, cut to `config`'s budget and depth; None if
        there is none (or the context is not the one it was grown for). It is taken once."""
        pending, self.pending = self.pending, None
        if pending is None or pending.context_length != len(context) or pending.root != context[-1]:
            return None
        return pending.growth.subtree(pending.node, config.budget, config.max_depth)

    def forget(self) -> None:
        self.pending = None

    def close(self) -> None:
        self.pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def grow_on_budget(config: GrowConfig) -> int:
    """The nodes growth may keep while a pass runs: GROW_ON times the round's budget, within the leaf bound (a budget
    past it keeps its own)."""
    return config.budget if config.budget > MAX_LEAVES else min(MAX_LEAVES, GROW_ON * config.budget)
