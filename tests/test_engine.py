"""The engine's logic on a tiny numpy model: trees, growth, sampling, lossless acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from edge.errors import UserError
from edge.generate import Decoder
from edge.grow import GrowConfig, grow
from edge.sampling import SamplingConfig, distribution, draw
from edge.tree import TokenTree
from tests.oracles import first_tokens_distribution
from tests.tiny import TinyModel, generate_tokens, softmax


def tree_of(parents: list[int], tokens: list[int] | None = None) -> TokenTree:
    parents_arr = np.array(parents, np.int32)
    depth = np.zeros(len(parents), np.int32)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    tokens_arr = np.array(tokens if tokens is not None else range(len(parents)), np.int32)
    return TokenTree(tokens_arr, parents_arr, depth, -depth.astype(np.float32))


def test_tree_masks_and_leaves() -> None:
    tree = tree_of([-1, 0, 0, 1, 1, 2])
    mask = tree.ancestor_mask()
    assert mask[3].tolist() == [True, True, False, True, False, False]
    assert mask[5].tolist() == [True, False, True, False, False, True]
    assert tree.leaves().tolist() == [3, 4, 5]
    assert tree.child(1, 4) == 4 and tree.child(1, 5) is None


@pytest.mark.parametrize("budget", [1, 2, 4, 8, 16, 64, 255])
def test_grow_respects_budget_and_shape(budget: int) -> None:
    drafter = TinyModel(n_vocab=12, seed=3)
    drafter.prefill([1, 2])
    config = GrowConfig.for_budget(budget)
    tree, passes = grow(drafter, 3, config)
    assert len(tree) - 1 <= budget and len(tree.leaves()) <= 255
    assert all(0 <= p < i for i, p in enumerate(tree.parents) if i > 0)
    assert (tree.depth[1:] == tree.depth[tree.parents[1:]] + 1).all()
    assert (tree.score[1:] <= tree.score[tree.parents[1:]]).all()
    assert passes == drafter.passes <= config.max_passes <= max(config.max_steps, budget)
    if budget <= 4:  # a chain
        assert tree.parents.tolist() == list(range(-1, len(tree) - 1))


def test_a_confident_drafter_grows_past_max_steps_into_a_chain() -> None:
    """A drafter that is sure of its path keeps extending it (one node a pass) up to the budget, as a chain of
    that length would: a fixed number of passes must not cap the tree's depth. An unsure one stops at max_steps."""
    table = np.full((4, 4, 4), -50.0, np.float32)
    table[:, :, 1] = 10.0
    sure = TinyModel(table=table, n_vocab=4)
    config = GrowConfig.for_budget(16)
    tree, passes = grow(sure, 1, config)
    assert config.max_steps < passes <= config.max_passes == 16
    assert tree.depth.max() == 16 and len(tree) - 1 == 16  # the chain of 16, the unlikely siblings dropped

    unsure = TinyModel(table=np.zeros((4, 4, 4), np.float32), n_vocab=4)  # uniform: a path of 2 has p = 1/16
    _, passes = grow(unsure, 1, config)
    assert passes <= config.max_steps


def test_grow_tight_stop() -> None:
    """A certain drafter (one token has all the mass) fills a chain and stops at the budget."""
    table = np.full((4, 4, 4), -50.0, np.float32)
    table[:, :, 1] = 10.0
    drafter = TinyModel(table=table, n_vocab=4)
    tree, passes = grow(drafter, 1, GrowConfig(budget=6, beams=1, width=2, max_depth=20, max_steps=20))
    # the chain of six 1s (each runner-up, at -60 nats, loses to the next 1), each node expanded once but the last:
    # once the tree is full no child can beat its worst node, so growth stops
    assert tree.tokens.tolist() == [1] * 7 and tree.parents.tolist() == [-1, 0, 1, 2, 3, 4, 5]
    assert passes == 6


def test_growth_never_expands_a_stop_token() -> None:
    """The reply ends at a stop token, so nothing grows under it; the budget goes to the other branches."""
    table = np.full((4, 4, 4), -50.0, np.float32)
    table[:, :, 1], table[:, :, 2] = 10.0, 9.0  # token 1 is sure, its runner-up 2 next
    drafter = TinyModel(table=table, n_vocab=4)
    config = GrowConfig.for_budget(16)
    plain, _ = grow(drafter, 3, config)
    ended, _ = grow(drafter, 3, config, stop_tokens=frozenset({1}))
    assert (plain.tokens[plain.parents[1:]] == 1).any()
    assert not (ended.tokens[ended.parents[1:]] == 1).any()  # no node hangs under a stop token
    assert len(ended) == len(plain) and ended.depth.max() > 1  # the budget went under token 2 instead


def test_no_tree_reaches_past_the_replys_last_token() -> None:
    """A reply that wants 5 more tokens takes them from one round of depth 4 (4 accepted + the target's own);
    deeper nodes could never be used, so the depth is capped and the budget goes to branches."""
    target = TinyModel(n_vocab=6, seed=2)
    depths: list[int] = []

    class Recorder:
        def __init__(self, config: GrowConfig):
            self.config = config

        def choose(self, max_nodes: int, rule: str = "match") -> GrowConfig:
            return self.config

        def observe(self, config: GrowConfig | None, result, rule: str = "match") -> None:
            depths.append(int(result.tree.depth.max()))

        def hold_timing(self, held: bool) -> None:
            pass

    decoder = Decoder(target, target, Recorder(GrowConfig.chain(16)))  # the target drafts itself: all taken
    decoder.load([0, 1])
    steps = list(decoder.generate(5, stop_tokens=frozenset()))
    assert steps[-1].finish_reason == "length" and len(steps) == 6
    assert depths == [4]
    config = GrowConfig.for_budget(64)
    assert config.within_reply(5).max_depth == 4 and config.within_reply(5).budget == 64
    assert config.within_reply(1) is config and config.within_reply(config.max_depth + 1) is config


def test_sampling_rules() -> None:
    logits = np.array([1.0, 3.0, 3.0, 0.0, -1.0], np.float32)
    assert draw(logits, SamplingConfig(), [], np.random.default_rng(0)) == 1  # greedy: lowest id on ties
    ids, probs = distribution(logits, SamplingConfig(temperature=1.0, top_k=3), [])
    assert set(ids.tolist()) == {0, 1, 2} and np.isclose(probs.sum(), 1)
    ids, _ = distribution(logits, SamplingConfig(temperature=1.0, min_p=0.5), [])
    assert set(ids.tolist()) == {1, 2}
    ids, _ = distribution(logits, SamplingConfig(temperature=1.0, top_p=0.4), [])
    assert set(ids.tolist()) == {1}
    # the penalty divides positive logits and multiplies negative ones
    assert draw(logits, SamplingConfig(repeat_penalty=4.0), [1, 2], np.random.default_rng(0)) == 0
    ids, probs = distribution(logits, SamplingConfig(temperature=0.5), [])
    assert np.allclose(probs, softmax(logits / 0.5))


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=1),
                                 dict(top_k=-2), dict(repeat_penalty=0)])
def test_invalid_sampling_values(bad: dict) -> None:
    with pytest.raises(UserError):
        SamplingConfig(**bad)


@pytest.mark.parametrize("budget", [1, 3, 16, 64, 255])
def test_greedy_speculation_equals_plain(budget: int) -> None:
    target = TinyModel(n_vocab=9, seed=5)
    plain = generate_tokens(target, None, None, [1, 2, 3], 60, SamplingConfig())
    spec_target = TinyModel(n_vocab=9, seed=5)
    drafter = spec_target.noisy(0.7)
    spec = generate_tokens(spec_target, drafter, budget, [1, 2, 3], 60, SamplingConfig())
    assert spec == plain
    assert spec_target.passes < len(plain)  # the drafter really saved passes
    assert spec_target.cache == [1, 2, 3, *plain][:-1]  # the cache holds exactly the text but its last token


@pytest.mark.parametrize("sampling", [
    SamplingConfig(temperature=1.0, seed=7),
    SamplingConfig(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05, repeat_penalty=1.3, seed=11),
])
def test_same_seed_same_sample(sampling: SamplingConfig) -> None:
    """One uniform per emitted token in both decoders: a fixed seed gives plain decoding's exact text."""
    plain = generate_tokens(TinyModel(n_vocab=9, seed=2), None, None, [4, 5], 80, sampling)
    target = TinyModel(n_vocab=9, seed=2)
    spec = generate_tokens(target, target.noisy(1.0), 32, [4, 5], 80, sampling)
    assert spec == plain


def sample_counts(target: TinyModel, drafter: TinyModel, length: int, runs: int,
                  sampling: SamplingConfig, accept: str = "match") -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    decoder = Decoder(target, drafter, GrowConfig(budget=6, beams=2, width=2, max_depth=3, max_steps=3), sampling,
                      accept)
    rules: dict[str, int] = {}
    for _ in range(runs):  # one RNG for all runs, as in one long session
        decoder.load([0, 1])
        steps = list(decoder.generate(length))
        key = tuple(s.token for s in steps if s.finish_reason is None)
        counts[key] = counts.get(key, 0) + 1
        for rule, rounds in steps[-1].stats.rule_rounds.items():
            rules[rule] = rules.get(rule, 0) + rounds
    assert set(rules) == ({"match"} if accept == "match" else {"residual", "coupled"} if accept == "auto" else
                          {accept}), rules
    return counts


def assert_matches(counts: dict, exact: dict, runs: int) -> None:
    """Every outcome within 5 standard deviations of its exact frequency.

    With 64 outcomes the chance that a correct sampler fails is below 64 * 5.7e-7 = 4e-5.
    """
    for outcome, p in exact.items():
        freq = counts.get(outcome, 0) / runs
        assert abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / runs) + 1e-9, (outcome, freq, p)


SAMPLING = SamplingConfig(temperature=1.0, top_k=3, repeat_penalty=1.2)


def test_sampled_speculation_has_the_targets_distribution() -> None:
    """Exact: the 3-token continuations of a 4-token vocabulary, drafted by a wrong-ish drafter."""
    target = TinyModel(n_vocab=4, seed=8, scale=1.5)
    drafter = target.noisy(1.5, seed=4)
    exact = first_tokens_distribution(4, target, 3, SAMPLING)
    runs = 12_000
    assert_matches(sample_counts(target, drafter, 3, runs, SAMPLING), exact, runs)


def test_auto_speculation_has_the_targets_distribution() -> None:
    """`--accept auto` switches between the residual rule and coupled sampling as their measured yields say, over one
    long session: the mixture still draws every token from the target's distribution."""
    target = TinyModel(n_vocab=4, seed=8, scale=1.5)
    drafter = target.noisy(1.5, seed=4)
    exact = first_tokens_distribution(4, target, 3, SAMPLING)
    runs = 12_000
    assert_matches(sample_counts(target, drafter, 3, runs, SAMPLING, "auto"), exact, runs)


def test_the_distribution_test_catches_a_biased_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above can fail: accepting the drafter's first child whenever the target gives it p > 0.2."""

    def biased_accept(tree, logits, history, rule):
        sampling, rng = rule.reply.sampling, rule.reply.rng
        path = [0]
        while True:
            children = np.flatnonzero(tree.parents == path[-1])
            seen = [*history, *tree.path_tokens(path)]
            ids, probs = distribution(logits[path[-1]], sampling, seen)
            p = dict(zip(ids.tolist(), probs.tolist(), strict=True))
            if len(children) and p.get(int(tree.tokens[children[0]]), 0) > 0.2:
                path.append(int(children[0]))
                continue
            return path, draw(logits[path[-1]], sampling, seen, rng)

    target = TinyModel(n_vocab=4, seed=8, scale=1.5)
    drafter = target.noisy(1.5, seed=4)
    exact = first_tokens_distribution(4, target, 3, SAMPLING)
    runs = 12_000
    monkeypatch.setattr("edge.speculative.accept", biased_accept)
    with pytest.raises(AssertionError):
        assert_matches(sample_counts(target, drafter, 3, runs, SAMPLING), exact, runs)


def test_stop_tokens_and_length() -> None:
    target = TinyModel(n_vocab=6, seed=1)
    target.stop_tokens = frozenset({int(np.argmax(target.logits([0, 2])))})
    decoder = Decoder(target, target.noisy(0.3), GrowConfig.for_budget(16))
    decoder.load([0, 2])
    steps = list(decoder.generate(50))
    assert steps[-1].finish_reason == "stop"
    assert target.cache == decoder.context[:-1]
    decoder.load([1, 2, 3])
    steps = list(decoder.generate(5, stop_tokens=frozenset()))
    assert steps[-1].finish_reason == "length" and len(steps) == 6


def test_should_stop_interrupts_between_rounds() -> None:
    target = TinyModel(n_vocab=6, seed=1)
    decoder = Decoder(target, target.noisy(0.3), GrowConfig.for_budget(8))
    decoder.load([0, 1])
    calls = iter(range(100))
    steps = list(decoder.generate(500, should_stop=lambda: next(calls) >= 3))
    assert steps[-1].finish_reason == "interrupted"
    assert target.cache == decoder.context[:-1]


def test_prompt_longer_than_context() -> None:
    target = TinyModel()
    target.n_ctx = 8
    with pytest.raises(UserError, match="context holds 8"):
        Decoder(target).load(list(range(5)) * 2)


def test_a_long_prompt_is_read_in_chunks_and_can_be_stopped_between_them() -> None:
    """Ctrl-C while a prompt is read: Interrupted after the chunk in hand, the caches keep what was read, and loading
    the same prompt again reads only the rest and decodes what an uninterrupted load decodes."""
    from edge.errors import Interrupted
    from edge.generate import PREFILL_CHUNK

    target, drafter = TinyModel(n_vocab=12, seed=1), TinyModel(n_vocab=12, seed=3)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 12, 3 * PREFILL_CHUNK + 10)]
    decoder = Decoder(target, drafter, GrowConfig.for_budget(8))
    asked = iter([False, False, True])
    with pytest.raises(Interrupted):
        decoder.load(prompt, should_stop=lambda: next(asked))
    assert len(target.cache) == len(drafter.cache) == 2 * PREFILL_CHUNK
    assert decoder.context == prompt[: 2 * PREFILL_CHUNK + 1]
    read: list[int] = []
    real_prefill = target.prefill
    target.prefill = lambda tokens: read.append(len(tokens)) or real_prefill(tokens)
    decoder.load(prompt)
    assert read == [PREFILL_CHUNK, 9]  # the rest (the last token is the first tree's root), not the whole prompt
    resumed = [s.token for s in decoder.generate(20) if s.token is not None]
    fresh = Decoder(TinyModel(n_vocab=12, seed=1), TinyModel(n_vocab=12, seed=3), GrowConfig.for_budget(8))
    fresh.load(prompt)
    assert resumed == [s.token for s in fresh.generate(20) if s.token is not None]


def test_logits_that_are_not_numbers_are_a_model_fault() -> None:
    """A damaged model file (NaN weights) gives NaN logits: an error that says so, not an empty reply."""
    from edge.errors import ModelFault

    table = np.full((5, 5, 5), np.nan, np.float32)
    decoder = Decoder(TinyModel(table=table), None, None, SamplingConfig())
    decoder.load([1, 2])
    with pytest.raises(ModelFault, match="not numbers"):
        list(decoder.generate(4))
