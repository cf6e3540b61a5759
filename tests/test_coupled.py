"""Coupled sampling (edge/coupled.py): the target's draws come from noise fixed by position, so a seeded reply is the
same with or without a tree, and its distribution is the target's.

Tiny numpy models check the logic: pathwise equality with plain decoding over many seeds and tree shapes, a
chi-square test over every 3-token continuation (which a drafter that changed the target's draws would fail), the
noise's own uniformity, and that the drafter's children follow the noise (the whole point of coupling).
"""

from __future__ import annotations

import numpy as np
import pytest

from edge.coupled import CoupledProposer, Noise, keyed_draw
from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.sampling import SamplingConfig, distribution
from edge.tree import TokenTree
from tests.oracles import chi_square, first_tokens_distribution
from tests.tiny import TinyModel

CONFIGS = [
    SamplingConfig(temperature=0.7, top_p=0.9, min_p=0.05),
    SamplingConfig(temperature=1.3, top_p=0.95, min_p=0.02, repeat_penalty=1.2),
]
RUNS = 4000


def reply(target: TinyModel, drafter: TinyModel | None, grow: GrowConfig | None, sampling: SamplingConfig,
          prompt: list[int], n: int) -> tuple[list[int], Decoder, float]:
    """The reply's tokens, its decoder, and its tokens per target pass."""
    decoder = Decoder(target, drafter, grow, sampling, accept="coupled")
    decoder.load(prompt)
    steps = list(decoder.generate(n))
    return [s.token for s in steps if s.finish_reason is None], decoder, steps[-1].stats.tokens_per_pass


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_a_seeded_coupled_reply_is_plain_decodings_token_for_token(budget: int) -> None:
    """The reply is a function of the seed alone: a noisy drafter's trees of any size change how many passes it takes,
    never a token."""
    target = TinyModel(n_vocab=12, seed=3, scale=1.5)
    drafter = target.noisy(0.8, seed=5)
    yields = []
    for seed in range(12):
        sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=seed)
        plain, _, _ = reply(target, None, None, sampling, [0, 1], 24)
        speculative, decoder, tokens_per_pass = reply(target, drafter, GrowConfig.for_budget(budget), sampling,
                                                      [0, 1], 24)
        assert speculative == plain, seed
        yields.append(tokens_per_pass)
    assert decoder.acceptance is decoder.acceptances["coupled"]
    assert np.mean(yields) > 1.3  # the trees were taken: this compared speculation, not two plain runs


def coupled_counts(sampling: SamplingConfig, runs: int = RUNS) -> tuple[dict[tuple[int, ...], int], Decoder]:
    """3-token continuations of [0, 1], drafted by a noisy copy of the target, one decoder (one generator) for all."""
    target = TinyModel(n_vocab=4, seed=8, scale=1.0)
    drafter = target.noisy(1.5, seed=4)
    decoder = Decoder(target, drafter, GrowConfig(budget=6, beams=2, width=2, max_depth=3, max_steps=3),
                      sampling, accept="coupled")
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(runs):
        decoder.load([0, 1])
        key = tuple(s.token for s in decoder.generate(3) if s.finish_reason is None)
        counts[key] = counts.get(key, 0) + 1
    return counts, decoder


@pytest.mark.parametrize("sampling", CONFIGS, ids=["t0.7", "t1.3-penalty"])
def test_coupled_sampling_has_the_targets_distribution(sampling: SamplingConfig) -> None:
    exact = first_tokens_distribution(4, TinyModel(n_vocab=4, seed=8, scale=1.0), 3, sampling)
    counts, decoder = coupled_counts(sampling)
    statistic, critical = chi_square(counts, exact, RUNS)
    assert statistic < critical
    assert decoder.acceptance is decoder.acceptances["coupled"]


def test_the_chi_square_test_catches_noise_reused_across_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draw whose noise ignores the position (every token of a reply shares one Gumbel vector) is not the target's
    distribution: the test above must see it."""
    real = Noise.gumbel
    monkeypatch.setattr(Noise, "gumbel", lambda self, position, ids: real(self, 0, ids))
    sampling = CONFIGS[0]
    exact = first_tokens_distribution(4, TinyModel(n_vocab=4, seed=8, scale=1.0), 3, sampling)
    statistic, critical = chi_square(coupled_counts(sampling)[0], exact, RUNS)
    assert statistic > critical


def test_the_noise_is_gumbel_and_fixed_by_key_position_and_token() -> None:
    noise = Noise(12345)
    ids = np.arange(200_000)
    g = noise.gumbel(7, ids)
    assert np.array_equal(g, noise.gumbel(7, ids))  # fixed
    assert np.array_equal(g[[5, 99_999]], noise.gumbel(7, np.array([5, 99_999])))  # by token, whatever else is asked
    assert not np.array_equal(g[:100], noise.gumbel(8, ids[:100]))  # by position
    assert not np.array_equal(g[:100], Noise(12346).gumbel(7, ids[:100]))  # by key
    uniform = np.exp(-np.exp(-g))  # the Gumbel CDF: uniform on (0, 1) if g is Gumbel
    counts = np.histogram(uniform, bins=20, range=(0, 1))[0]
    expected = len(ids) / 20
    assert ((counts - expected) ** 2 / expected).sum() < 50  # chi-square, 19 degrees of freedom: p < 1e-4
    assert abs(np.corrcoef(uniform[:-1], uniform[1:])[0, 1]) < 0.01  # neighbouring tokens independent


def test_keyed_draws_over_positions_follow_the_distribution() -> None:
    ids, probs = np.array([2, 5, 9]), np.array([0.6, 0.3, 0.1])
    noise = Noise(99)
    draws = np.array([keyed_draw(ids, probs, noise, t) for t in range(6000)])
    for token, p in zip(ids, probs, strict=True):
        assert abs((draws == token).mean() - p) < 5 * np.sqrt(p * (1 - p) / len(draws))


def test_the_drafters_children_follow_the_noise() -> None:
    """With the drafter the target itself and the whole noise shared, its first child at each node is the target's own
    draw there: coupling is what makes a drafter's first guess the target's sampled token, not only its likeliest
    one."""
    target = TinyModel(n_vocab=16, seed=2, scale=0.5)  # flat: the likeliest token is drawn far less than always
    sampling = SamplingConfig(temperature=1.0)
    same = 0
    for key in range(200):
        noise = Noise(key)
        target.truncate(0)
        target.prefill([0])
        proposer = CoupledProposer(target, sampling, [0], noise, coupling=1.0)
        tree = TokenTree.root(1)
        ids, log_shares = proposer.expand(tree, np.array([0]), 3)
        ids_p, probs = distribution(target.logits([0, 1]), sampling, [0, 1])
        same += int(ids[0, 0]) == keyed_draw(ids_p, probs, noise, 2)
        assert np.all(np.diff(log_shares[0]) <= 0) and np.all(log_shares[0] <= 0)
    assert same == 200
