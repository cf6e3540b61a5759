"""The residual rule's replay by importance weighting (edge.replay, edge.residual.residual_law).

residual_law is checked against residual_draw's frequencies with the candidates fixed, and against p once the
candidate draws are averaged out (exactly, by enumeration). The weights are checked exactly on a tiny model: over
every reply a round can be replayed with, weighted by its plain-sampling probability, the weighted tokens are the
real rule's expected tokens for the same tree. An end-to-end run compares replays with real residual runs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from edge.acceptance import Acceptance
from edge.generate import Decoder
from edge.grow import GrowConfig, grow
from edge.replay import ReplayTarget, WeightedStats, plain_replies, plain_replies_with_distributions, replay
from edge.residual import Proposal, Proposer, residual_draw, residual_law, residual_probability
from edge.sampling import SamplingConfig, distribution
from edge.speculative import speculative_round
from tests.test_residual import chi_square
from tests.tiny import TinyModel

# (p, q, the candidates in draw order), each distribution as {token: probability}: q close to p, q holding tokens p
# lacks (the first candidate one of them), a single candidate, and q almost p (the residual is then one token)
CASES = [({2: 0.1, 3: 0.4, 5: 0.3, 7: 0.2}, {2: 0.3, 3: 0.5, 5: 0.2}, [3, 2]),
         ({1: 0.5, 2: 0.3, 4: 0.2}, {0: 0.4, 1: 0.3, 6: 0.2, 9: 0.1}, [6, 0, 1]),
         ({0: 0.1, 1: 0.2, 2: 0.3, 3: 0.25, 4: 0.15}, {1: 0.6, 3: 0.4}, [1]),
         ({3: 0.2, 4: 0.3, 5: 0.5}, {3: 0.2, 4: 0.35, 5: 0.45}, [4, 5, 3])]


def case_of(case: int) -> tuple[np.ndarray, np.ndarray, Proposal]:
    p, q, drawn = CASES[case]
    return (np.array(list(p)), np.array(list(p.values())),
            Proposal(np.array(list(q)), np.array(list(q.values())), np.array(drawn)))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_residual_law_is_p_once_the_candidates_are_averaged_out(case: int) -> None:
    """Given the candidates the law sums to 1 and leans on them; over every ordered draw of them from q (each with
    its probability without replacement) it is exactly p: the rule is lossless, and the law is its law."""
    p_ids, p, proposal = case_of(case)
    count, average = len(proposal.drawn), 0.0
    for order in itertools.permutations(range(len(proposal.ids)), count):
        chance, left = 1.0, 1.0
        for index in order:
            chance, left = chance * proposal.probs[index] / left, left - proposal.probs[index]
        support, law = residual_law(p_ids, p, Proposal(proposal.ids, proposal.probs, proposal.ids[list(order)]))
        assert law.sum() == pytest.approx(1.0, abs=1e-12) and (law >= 0).all()
        average = average + chance * law
    on_support = np.zeros(len(support))
    on_support[np.searchsorted(support, p_ids)] = p
    assert np.allclose(average, on_support, atol=1e-12)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_residual_probability_is_residual_draws_frequency_with_the_candidates_fixed(case: int) -> None:
    """residual_draw over many uniforms, the candidates NOT redrawn: its frequencies pass a chi-square test against
    residual_probability, and (where the law is not p, as it is not but for a proposal that cannot lean) fail one
    against p, so the test tells the law given the candidates from the rule's marginal."""
    p_ids, p, proposal = case_of(case)
    rng, runs = np.random.default_rng(case), 20_000
    draws = [residual_draw(p_ids, p, proposal, rng) for _ in range(runs)]
    counts = {token: draws.count(token) for token in set(draws)}
    tokens = np.union1d(p_ids, proposal.ids).tolist()
    exact = {token: residual_probability(p_ids, p, proposal, token) for token in tokens}
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-12)
    assert residual_probability(p_ids, p, proposal, 99) == 0.0
    statistic, critical = chi_square(counts, exact, runs)
    assert statistic < critical
    as_p = dict(zip(p_ids.tolist(), p.tolist(), strict=True))
    if set(counts) <= set(as_p):  # q's tokens outside p are never drawn, so p is a possible answer
        statistic, critical = chi_square(counts, as_p, runs)
        assert statistic > critical


# The weights, exactly: every reply a round can be replayed with.

CONFIG = GrowConfig(budget=6, beams=2, width=2, max_depth=3, max_steps=3)  # a tree, 2 children a node
SAMPLING = SamplingConfig(temperature=1.0, top_p=0.95)


def p_after(target: TinyModel, text: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return distribution(target.logits(text), SAMPLING, text)


def grown(drafter: TinyModel, prompt: list[int], draft_seed: int):
    """The tree and the proposals speculative_round grows from `prompt` with this draft seed and fresh rates."""
    drafter.truncate(0)
    drafter.prefill(prompt[:-1])
    proposer = Proposer(drafter, SAMPLING, prompt[:-1], np.random.default_rng(draft_seed))
    tree, _ = grow(drafter, prompt[-1], CONFIG, Acceptance(), frozenset(), proposer.expand)
    return tree, proposer


def expected_tokens(target: TinyModel, tree, proposer: Proposer, prompt: list[int]) -> float:
    """A real round's expected tokens given its tree: the sum over nodes of the chance the rule reaches them."""
    reach, total = {0: 1.0}, 0.0
    for node in range(len(tree)):  # parents come first
        total += reach[node]
        path = [node]
        while path[0] != 0:
            path.insert(0, int(tree.parents[path[0]]))
        p_ids, p = p_after(target, [*prompt, *tree.path_tokens(path[1:])])
        proposal = proposer.at(tree.path_tokens(path))
        support, law = (p_ids, p) if proposal is None else residual_law(p_ids, p, proposal)
        for child in np.flatnonzero(tree.parents == node).tolist():
            at = int(np.searchsorted(support, tree.tokens[child]))
            reach[child] = reach[node] * (law[at] if at < len(support) and support[at] == tree.tokens[child] else 0)
    return total


@pytest.mark.parametrize("draft_seed", [0, 1, 2])
def test_weights_make_a_replayed_round_exactly_a_real_one(draft_seed: int) -> None:
    """For one tree, the replay over each reply y (weighted by its chance under plain sampling) gives weights that
    average 1 and weighted tokens that average the real rule's expected tokens, to rounding: E[W f] = E[f]."""
    target = TinyModel(n_vocab=4, seed=8, scale=1.0)
    drafter = target.noisy(1.0, seed=4)
    prompt = [0, 1]
    tree, proposer = grown(drafter, prompt, draft_seed)
    assert tree.depth.max() == CONFIG.max_depth and len(proposer.proposals) > 1  # deep enough to multiply factors
    exact = expected_tokens(target, tree, proposer, prompt)
    replayed = ReplayTarget.like(target)
    mass = weight_sum = weighted_tokens = plain_tokens = 0.0
    for reply in itertools.product(range(4), repeat=CONFIG.max_depth + 1):
        distributions = [p_after(target, [*prompt, *reply[:i]]) for i in range(len(reply))]
        chance = np.prod([dict(zip(*p, strict=True)).get(token, 0.0)
                          for p, token in zip(distributions, reply, strict=True)])
        if chance == 0:  # outside top-p: plain sampling never replies so
            continue
        replayed.expect(prompt, list(reply), distributions)
        replayed.prefill(prompt[:-1])
        drafter.truncate(0)
        drafter.prefill(prompt[:-1])
        result = speculative_round(replayed, drafter, prompt, CONFIG, SAMPLING, np.random.default_rng(0),
                                   Acceptance(), frozenset(), "residual", np.random.default_rng(draft_seed))
        assert np.array_equal(result.tree.tokens, tree.tokens)  # the same tree, whatever the reply
        [(weight, tokens)] = replayed.rounds
        mass += chance
        weight_sum += chance * weight
        weighted_tokens += chance * weight * tokens
        plain_tokens += chance * tokens
    assert mass == pytest.approx(1.0, abs=1e-9)
    assert weight_sum == pytest.approx(1.0, abs=1e-9)
    assert weighted_tokens == pytest.approx(exact, abs=1e-9)
    assert abs(plain_tokens - exact) > 0.1  # the walk along the reply alone is another figure


# End to end: plain replies with their distributions, then replay() against real runs.


def test_plain_replies_with_distributions_are_the_plain_replies_and_their_p() -> None:
    target = TinyModel(n_vocab=9, seed=5)
    sampling = SamplingConfig(temperature=0.8, top_k=6, seed=3)
    prompts = [[1, 2, 3], [4, 5]]
    replies, distributions = plain_replies_with_distributions(target, prompts, 12, sampling)
    assert replies == plain_replies(TinyModel(n_vocab=9, seed=5), prompts, 12, sampling)
    for prompt, reply, reply_p in zip(prompts, replies, distributions, strict=True):
        assert len(reply_p) == len(reply) == 12
        for i, (ids, probs) in enumerate(reply_p):
            text = [*prompt, *reply[:i]]
            want_ids, want = distribution(target.logits(text), sampling, text)
            assert np.array_equal(ids, want_ids) and np.array_equal(probs, want) and reply[i] in ids


def test_distributions_keep_the_likely_tokens_and_the_drawn_one() -> None:
    """Without top-k a row is the whole vocabulary: tokens under KEPT_PROB are dropped, except the one drawn."""
    table = np.zeros((9, 9, 9), np.float32)
    table[:, :, 0] = 40.0  # every other token at about e^-40 / 8 of token 0's chance
    [reply], [reply_p] = plain_replies_with_distributions(TinyModel(table=table, n_vocab=9), [[1, 2]], 5,
                                                          SamplingConfig(temperature=1.0, seed=0))
    assert reply == [0] * 5 and all(ids.tolist() == [0] for ids, _ in reply_p)


def test_a_weighted_replay_estimates_real_residual_runs() -> None:
    """Tokens per pass of real residual runs (120 seeds, 3 prompts) against the weighted replays of as many plain
    replies. Both are estimates: the real one's standard error comes from its runs, the replay's from the delta
    method on its rounds (sum w^2 (t - estimate)^2)^(1/2) / sum w, here with an effective sample size of some 200
    rounds (a 2-node chain keeps the weights tame); they must agree within 4 combined standard errors, about 0.1
    tokens, while the unweighted walk along the replies is a token and more away."""
    target = TinyModel(n_vocab=9, seed=3, scale=2.0)
    drafter, config, n, seeds = target.noisy(0.3, seed=4), GrowConfig.for_budget(2), 30, range(120)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8]]
    real = []
    for seed in seeds:
        decoder = Decoder(target, drafter, config, SamplingConfig(temperature=1.0, seed=seed), accept="residual")
        decoder.load(prompts[seed % 3])
        *_, last = decoder.generate(n)
        real.append((last.stats.new_tokens, last.stats.rounds))
    tokens, rounds = np.array(real).T
    real_estimate = tokens.sum() / rounds.sum()
    real_error = np.std(tokens / rounds) / np.sqrt(len(real))

    replayed, total = ReplayTarget.like(target), WeightedStats()
    for seed in seeds:
        sampling = SamplingConfig(temperature=1.0, seed=10_000 + seed)
        [reply], [reply_p] = plain_replies_with_distributions(target, [prompts[seed % 3]], n, sampling)
        decoder = Decoder(replayed, drafter, config, sampling, accept="residual")
        total.add(replay(decoder, prompts[seed % 3], reply, reply_p))
    weights, round_tokens = np.array(total.round_weights), np.array(total.round_tokens)
    estimate = total.weighted_tokens_per_pass
    error = np.sqrt((weights**2 * (round_tokens - estimate) ** 2).sum()) / weights.sum()
    assert total.effective_rounds > 100
    assert abs(estimate - real_estimate) < 4 * np.hypot(error, real_error), (estimate, real_estimate, error)
    assert real_estimate - total.tokens_per_pass > 1.0


def test_sample_and_match_replays_unweighted() -> None:
    """A match replay's rounds all weigh 1: its weighted figure is its plain one, and its run is the real run's."""
    target = TinyModel(n_vocab=9, seed=5)
    sampling = SamplingConfig(temperature=1.0, seed=7)
    [reply] = plain_replies(target, [[1, 2, 3]], 40, sampling)
    stats = replay(Decoder(ReplayTarget.like(target), target.noisy(0.7), GrowConfig.for_budget(16), sampling),
                   [1, 2, 3], reply)
    real = Decoder(TinyModel(n_vocab=9, seed=5), target.noisy(0.7), GrowConfig.for_budget(16), sampling)
    real.load([1, 2, 3])
    *_, last = real.generate(40)
    assert stats.round_weights == [1.0] * stats.rounds and stats.effective_rounds == stats.rounds
    assert stats.weighted_tokens_per_pass == stats.tokens_per_pass == last.stats.tokens_per_pass
    assert sum(stats.round_tokens) == stats.new_tokens == 40


def test_a_residual_replay_needs_the_distributions() -> None:
    target = TinyModel(n_vocab=9, seed=5)
    sampling = SamplingConfig(temperature=1.0, seed=7)
    [reply] = plain_replies(target, [[1, 2, 3]], 10, sampling)
    decoder = Decoder(ReplayTarget.like(target), target.noisy(0.7), GrowConfig.for_budget(8), sampling,
                      accept="residual")
    with pytest.raises(ValueError, match="distributions"):
        replay(decoder, [1, 2, 3], reply)
    auto = Decoder(ReplayTarget.like(target), target.noisy(0.7), GrowConfig.for_budget(8), sampling, accept="auto")
    with pytest.raises(ValueError, match="auto"):
        replay(auto, [1, 2, 3], reply)
