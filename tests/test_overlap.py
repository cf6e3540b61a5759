"""Overlapped drafting's bookkeeping (edge/overlap.py) on the tiny numpy model: the drafter grows during the target's
pass, the tree grown for the outcome that happened is the next round's, and one grown for any other is dropped."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.overlap import Overlap
from edge.rules import MATCH, Reply
from edge.sampling import SamplingConfig
from edge.speculative import RoundPlan, run_round
from edge.tree import TokenTree
from tests.tiny import TinyModel

PROMPT = [1, 2, 3, 4]


class SlowTarget(TinyModel):
    """A target whose pass lasts until the drafter has grown `steps` more passes (a drive, a GPU: the drafter works
    meanwhile), or `limit` seconds where growth stops before that (a tiny drafter pass takes well under 1 ms)."""

    def __init__(self, steps: int = 3, limit: float = 0.05, **kwargs) -> None:
        super().__init__(**kwargs)
        self.steps, self.limit = steps, limit
        self.drafter: TinyModel | None = None

    def verify(self, tree: TokenTree) -> np.ndarray:
        if self.drafter is not None:
            until, deadline = self.drafter.passes + self.steps, time.monotonic() + self.limit
            while self.drafter.passes < until and time.monotonic() < deadline:
                time.sleep(0.0005)
        return super().verify(tree)


def pair(seed: int = 4, noise: float = 0.6) -> tuple[SlowTarget, TinyModel]:
    target = SlowTarget(n_vocab=16, seed=seed)
    target.drafter = target.noisy(noise, seed=seed + 1)
    return target, target.drafter


def alone(target: SlowTarget) -> TinyModel:
    """The same target model for plain decoding (no drafter to wait for)."""
    return TinyModel(target.n_vocab, table=target.table)


def run(target: TinyModel, drafter: TinyModel | None, budget: int | None, n: int, sampling: SamplingConfig,
        overlap: bool = False, accept: str = "match") -> tuple[list[int], Decoder]:
    decoder = Decoder(target, drafter, GrowConfig.for_budget(budget) if budget else None, sampling, overlap=overlap,
                      accept=accept)
    decoder.load(PROMPT)
    steps = list(decoder.generate(n))
    return [s.token for s in steps if s.finish_reason is None], decoder


@pytest.mark.parametrize("budget", [4, 16, 64])
def test_greedy_output_with_overlap_is_plain_decoding(budget: int) -> None:
    target, drafter = pair()
    plain, _ = run(alone(target), None, None, 80, SamplingConfig())
    spec, decoder = run(target, drafter, budget, 80, SamplingConfig(), overlap=True)
    assert spec == plain
    # both caches hold exactly the committed text but its newest token
    assert target.cache + target.pending == decoder.context[:-1]
    assert drafter.cache + drafter.pending == decoder.context[:-1]


def test_trees_grown_during_the_pass_are_used_and_counted() -> None:
    target, drafter = pair(noise=0.3)
    decoder = Decoder(target, drafter, GrowConfig.for_budget(16), SamplingConfig(), overlap=True)
    decoder.load(PROMPT)
    steps = list(decoder.generate(120))
    stats = steps[-1].stats
    assert 0 < stats.pregrown_rounds < stats.rounds  # some rounds drafted nothing before their pass, not all
    assert stats.hidden_s > 0 and stats.target_passes == stats.rounds
    plain, _ = run(alone(target), None, None, 120, SamplingConfig())
    assert [s.token for s in steps[:-1]] == plain


def test_sampled_output_with_a_seed_is_plain_sampling() -> None:
    """Each emitted token still takes exactly one uniform: the seed gives plain sampling's text with overlap on."""
    target, drafter = pair()
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=11)
    plain, _ = run(alone(target), None, None, 60, sampling)
    spec, _ = run(target, drafter, 16, 60, sampling, overlap=True)
    assert spec == plain


def test_coupled_sampling_with_overlap_is_plain_coupled_sampling() -> None:
    """Coupled rounds overlap too: a tree grown during the previous pass was ranked on the same noise (the text's
    positions), and the seed gives plain coupled sampling's text."""
    target, drafter = pair(noise=0.3)
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=11)
    plain, _ = run(alone(target), None, None, 80, sampling, accept="coupled")
    spec, decoder = run(target, drafter, 16, 80, sampling, overlap=True, accept="coupled")
    assert spec == plain
    assert decoder.acceptances["coupled"].hits.sum() > 0  # coupled trees ran, overlapped


def overlapped_round(target, drafter, context: list[int], config: GrowConfig, overlap: Overlap):
    """A greedy sample-and-match round with `overlap` (Decoder.generate's, without the decoder): the round, and
    whether its tree was grown during the previous pass."""
    reply = Reply(SamplingConfig(), np.random.default_rng(0), np.random.default_rng(1))
    result = run_round(target, drafter, context, RoundPlan(config, MATCH, drafting=True), reply, overlap)
    return result, result.pregrown


def test_a_tree_grown_for_another_outcome_is_dropped_without_effect() -> None:
    """The tree grown during a pass roots at the token the target drew; any other outcome leaves nothing behind: the
    next round takes no tree, and the drafter's cache holds the committed text alone (no branch grown past it)."""
    target, drafter = pair(noise=0.3)
    for model in (target, drafter):
        model.prefill(PROMPT[:-1])
    overlap = Overlap()
    context = list(PROMPT)
    config = GrowConfig.for_budget(16)
    result, pregrown = overlapped_round(target, drafter, context, config, overlap)
    assert not pregrown and overlap.pending is not None  # growth reached the target's token during the pass
    after = [*context, *result.tokens]
    assert drafter.cache + drafter.pending == after[:-1]  # the accepted path, nothing of the branches grown past it
    assert overlap.pending.root == after[-1] and overlap.pending.context_length == len(after)
    # another outcome: the same length, another token at the end (or another length): no tree for it
    other = [*after[:-1], (after[-1] + 1) % target.n_vocab]
    assert overlap.take(other, config) is None and overlap.pending is None  # taken once, then gone
    _, pregrown2 = overlapped_round(target, drafter, after, config, overlap)
    assert not pregrown2  # nothing pending: this round grew its own tree before its pass
    overlap.close()
    # a tree that is taken is the subtree for the outcome that happened, re-rooted there, within the budget
    target2, drafter2 = pair(noise=0.3)
    for model in (target2, drafter2):
        model.prefill(PROMPT[:-1])
    overlap2 = Overlap()
    result3, _ = overlapped_round(target2, drafter2, list(PROMPT), config, overlap2)
    after3 = [*PROMPT, *result3.tokens]
    tree = overlap2.take(after3, GrowConfig.for_budget(4))
    assert tree is not None and tree.tokens[0] == after3[-1] and tree.parents[0] == -1
    assert 2 <= len(tree) <= 5 and (tree.depth[1:] == tree.depth[tree.parents[1:]] + 1).all()
    overlap2.close()
