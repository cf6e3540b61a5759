"""The residual acceptance rule (edge/residual.py): its output has the target's distribution.

Tiny numpy models check the logic with a chi-square test over every 3-token continuation, which a deliberately
wrong rule fails; the real SmolLM2 pair checks it against exact probabilities from the target's logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.policy import Measured
from edge.residual import Proposal, Proposer, _draw_without_replacement, residual_draw
from edge.rules import KEPT_ROUNDS, RuleChoice
from edge.sampling import SamplingConfig, distribution
from edge.tree import TokenTree
from tests.oracles import chi_square, first_tokens_distribution
from tests.tiny import TinyModel

CONFIGS = [  # two temperatures, top-p and min-p on, a penalty on one
    SamplingConfig(temperature=0.7, top_p=0.9, min_p=0.05),
    SamplingConfig(temperature=1.3, top_p=0.95, min_p=0.02, repeat_penalty=1.2),
]
RUNS = 4000


def residual_counts(sampling: SamplingConfig, runs: int = RUNS) -> dict[tuple[int, ...], int]:
    """3-token continuations of [0, 1], drafted by a noisy copy of the target, verified by the residual rule."""
    target = TinyModel(n_vocab=4, seed=8, scale=1.0)
    drafter = target.noisy(1.5, seed=4)
    decoder = Decoder(target, drafter, GrowConfig(budget=6, beams=2, width=2, max_depth=3, max_steps=3),
                      sampling, accept="residual")
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(runs):  # one RNG for all runs, as in one long session
        decoder.load([0, 1])
        key = tuple(s.token for s in decoder.generate(3) if s.finish_reason is None)
        counts[key] = counts.get(key, 0) + 1
    assert decoder.acceptance is decoder.acceptances["residual"]
    return counts


@pytest.mark.parametrize("sampling", CONFIGS, ids=["t0.7", "t1.3-penalty"])
def test_residual_rule_has_the_targets_distribution(sampling: SamplingConfig) -> None:
    exact = first_tokens_distribution(4, TinyModel(n_vocab=4, seed=8, scale=1.0), 3, sampling)
    statistic, critical = chi_square(residual_counts(sampling), exact, RUNS)
    assert statistic < critical


def wrong_residual_draw(p_ids, p, proposal, rng) -> int:
    """The classic mistake: after rejecting a candidate, draw from p itself instead of the residual."""
    for token in proposal.drawn.tolist():
        q = dict(zip(proposal.ids.tolist(), proposal.probs.tolist(), strict=True))[token]
        p_token = dict(zip(p_ids.tolist(), p.tolist(), strict=True)).get(token, 0.0)
        if rng.random() * q < p_token:
            return token
    return int(p_ids[min(int(np.searchsorted(np.cumsum(p), rng.random(), side="right")), len(p) - 1)])


@pytest.mark.parametrize("sampling", CONFIGS, ids=["t0.7", "t1.3-penalty"])
def test_the_chi_square_test_catches_a_wrong_rule(sampling: SamplingConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("edge.rules.residual_draw", wrong_residual_draw)
    exact = first_tokens_distribution(4, TinyModel(n_vocab=4, seed=8, scale=1.0), 3, sampling)
    statistic, critical = chi_square(residual_counts(sampling), exact, RUNS)
    assert statistic > critical


def test_residual_draw_is_exactly_p() -> None:
    """At one node: two candidates drawn from q without replacement, then the rule; the token's frequencies are p's,
    for a q close to p and for one far from it (holding tokens p has not)."""
    p_ids, p = np.array([2, 3, 5, 7]), np.array([0.1, 0.4, 0.3, 0.2])
    for q_ids, q in ((np.array([2, 3, 5]), np.array([0.2, 0.5, 0.3])), (np.array([1, 7]), np.array([0.9, 0.1]))):
        rng = np.random.default_rng(0)
        draws = []
        for _ in range(40_000):
            proposal = Proposal(q_ids, q, q_ids[_draw_without_replacement(q, 2, rng)])
            draws.append(residual_draw(p_ids, p, proposal, rng))
        freq = np.array([draws.count(int(t)) for t in p_ids]) / len(draws)
        assert np.abs(freq - p).max() < 5 * np.sqrt(0.25 / len(draws)), freq


def test_q_uses_the_targets_transforms_on_the_drafters_top_tokens() -> None:
    """With a top-k inside the drafter's pool, q is exactly edge.sampling.distribution of the drafter's full row."""
    drafter = TinyModel(n_vocab=30, seed=5, scale=3.0)
    sampling = SamplingConfig(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05, repeat_penalty=1.3,
                              presence_penalty=0.2)
    history = [3, 4, 7, 4]
    drafter.prefill(history[:-1])
    proposer = Proposer(drafter, sampling, history[:-1], np.random.default_rng(1))
    proposer.expand(TokenTree.root(history[-1]), np.array([0]), 4)
    proposal = proposer.at([history[-1]])
    ids, probs = distribution(drafter.logits(history), sampling, history)
    assert np.array_equal(proposal.ids, ids) and np.allclose(proposal.probs, probs)
    assert len(set(proposal.drawn.tolist())) == min(4, len(ids)) and set(proposal.drawn.tolist()) <= set(ids.tolist())


def test_residual_yields_more_than_match_with_a_close_drafter() -> None:
    """The rule's point: with q close to p at temperature 1, far more tokens per target pass."""
    figures = {}
    for rule in ("match", "residual"):
        target = TinyModel(n_vocab=40, seed=3, scale=2.0)
        decoder = Decoder(target, target.noisy(0.2, seed=4), GrowConfig.for_budget(16),
                          SamplingConfig(temperature=1.0, seed=5), accept=rule)
        decoder.load([1, 2, 3])
        *_, last = decoder.generate(200)
        figures[rule] = last.stats.tokens_per_pass
    assert figures["residual"] > 1.5 * figures["match"], figures


def test_auto_runs_the_rule_that_yields_more_and_greedy_stays_match() -> None:
    """`--accept auto` chooses by the tokens a pass each rule has yielded on the pair at this temperature, measured by
    every decoder that shares the pair's choices (each rule's own runs too): with a drafter close to its target the
    residual rule yields more, and auto's rounds then go mostly to it. Alone, auto measures both rules itself.
    Greedy decoding is sample-and-match."""
    target = TinyModel(n_vocab=40, seed=3, scale=2.0)
    sampling = SamplingConfig(temperature=1.0, seed=5)
    choices = Measured()
    figures, rounds = {}, {}
    for rule in ("residual", "coupled", "auto"):
        decoder = Decoder(target, target.noisy(0.2, seed=4), GrowConfig.for_budget(16), sampling, accept=rule,
                          choices=choices)
        decoder.load([1, 2, 3])
        *_, last = decoder.generate(400)
        figures[rule], rounds[rule] = last.stats.tokens_per_pass, last.stats.rule_rounds
    best = max(("residual", "coupled"), key=figures.__getitem__)
    other = ({"residual", "coupled"} - {best}).pop()
    assert figures[best] > 1.2 * figures[other], figures  # a choice that matters
    assert rounds["auto"][best] > 5 * rounds["auto"].get(other, 0), rounds
    assert figures["auto"] > 0.9 * figures[best], figures
    alone = Decoder(target, target.noisy(0.2, seed=4), GrowConfig.for_budget(16), sampling, accept="auto")
    alone.load([1, 2, 3])
    *_, last = alone.generate(200)
    assert set(last.stats.rule_rounds) == {"residual", "coupled"}, last.stats.rule_rounds
    alone.set_sampling(SamplingConfig())
    assert alone.rounds.rule().name == "match" and not alone.rounds.coupled


def test_auto_leaves_a_rule_whose_yield_falls() -> None:
    """The choice's mean weighs a rule's last 128 rounds or so (YIELD_WEIGHT): a rule that yielded ten tokens a pass
    for 600 rounds and then three (the texts changed) is left for the one yielding six within 170 rounds, and the
    rule behind is tried now and then meanwhile."""
    choice, yields, picks = RuleChoice(), {"residual": 10, "coupled": 6}, []
    for _ in range(600):
        rule = choice.pick().name
        picks.append(rule)
        choice.observe(rule, yields[rule])
    assert 0 < picks.count("coupled") < 20
    yields["residual"] = 3
    for _ in range(170):
        rule = choice.pick().name
        choice.observe(rule, yields[rule])
    assert choice.pick().name == "coupled", choice.described()


def test_auto_starts_on_the_rule_an_earlier_run_kept_and_a_hostile_entry_is_left_out() -> None:
    """What a run measured of each rule (Measured.to_json) starts the next run's choice (RuleChoice.kept), each rule's
    rounds counted as at most KEPT_ROUNDS: auto's first rounds go to the rule kept as yielding more, not to trying
    both. A kept file anyone could write: entries that are not [tokens a pass, rounds] are left out."""
    target = TinyModel(n_vocab=40, seed=3, scale=2.0)
    sampling = SamplingConfig(temperature=1.0, seed=5)
    first = Measured()
    decoder = Decoder(target, target.noisy(0.2, seed=4), GrowConfig.for_budget(16), sampling, accept="auto",
                      choices=first)
    decoder.load([1, 2, 3])
    *_, last = decoder.generate(300)
    assert first.to_json() == {}  # a seeded reply's measurements are not kept ...
    joined = Measured()
    joined.take(first)  # ... unless taken, as a benchmark's rows are
    kept = joined.to_json()
    [(key, yields)] = kept.items()
    best = max(yields, key=lambda name: yields[name][0])
    assert sum(last.stats.rule_rounds.values()) == sum(rounds for _, rounds in yields.values())
    second = Measured(kept.get)
    again = Decoder(target, target.noisy(0.2, seed=4), GrowConfig.for_budget(16), sampling, accept="auto",
                    choices=second)
    again.load([1, 2, 3])
    *_, last = again.generate(40)
    assert set(last.stats.rule_rounds) == {best}, last.stats.rule_rounds  # no rounds spent trying the other
    assert all(rounds <= KEPT_ROUNDS + last.stats.rounds for rounds in second.choices[key].rounds.values())
    # benchmark rows, each run from the same kept start, join the pair's measurement: each row's own rounds are
    # averaged in, the start counted once, and a rule no row ran stays as kept
    kept_start = {key: {"residual": [9.0, 400], "coupled": [7.0, 300]}}.get
    pair, rows = Measured(kept_start), [Measured(kept_start), Measured(kept_start)]
    for row, tokens in zip(rows, ((10, 12, 11), (20,) * KEPT_ROUNDS), strict=True):
        for value in tokens:
            row._choice(key).observe("residual", value)
        pair.take(row)
    rounds = 2 * KEPT_ROUNDS + 3
    expected = round((9.0 * KEPT_ROUNDS + 33 + 20 * KEPT_ROUNDS) / rounds, 4)
    assert pair.to_json()[key] == {"residual": [expected, rounds], "coupled": [7.0, KEPT_ROUNDS]}
    auto_row = Measured(kept_start)
    for rule in ("residual", "coupled"):
        auto_row._choice(key).observe(rule, 1)
    pair.take(auto_row, ["coupled"])  # a bench's auto row: only the rules no row ran alone
    assert pair.to_json()[key] == {"residual": [expected, rounds], "coupled": [round(
        (7.0 * KEPT_ROUNDS + 1) / (KEPT_ROUNDS + 1), 4), KEPT_ROUNDS + 1]}
    # a kept yield's rounds are capped; what is not a rule's [tokens a pass, rounds] is left out
    choice = RuleChoice.kept({"residual": [9.5, 10**9], "coupled": ["7", 3], "match": [1.0, 5]})
    assert choice.rounds == {"residual": KEPT_ROUNDS, "coupled": 0} and choice.mean["residual"] == 9.5
    for hostile in (None, [], {"residual": [float("nan"), 4]}, {"residual": [-1, 4]}, {"residual": [3.0, 0]},
                    {"residual": [1e300, 4]}, {"residual": [True, 4]}, {"residual": [3.0, 4, 5]}):
        assert RuleChoice.kept(hostile).rounds == {"residual": 0, "coupled": 0}, hostile


def test_a_bench_keeps_each_rules_rounds_from_the_row_that_ran_it_alone() -> None:
    """An auto row's rounds of a rule fall on the texts where auto chose it: a bench keeps a rule's rounds from the
    row that ran it alone, and an auto row's only for a rule no row ran alone."""
    from types import SimpleNamespace

    from edge.models.bench import _keep_row_yields

    key = "k"

    def row(yields: dict[str, int]) -> SimpleNamespace:
        measured = Measured()
        for rule, tokens in yields.items():
            measured._choice(key).observe(rule, tokens)
        return SimpleNamespace(rounds=SimpleNamespace(choices=measured))

    pair = SimpleNamespace(rule_choices=Measured())
    _keep_row_yields(pair, [("tree", 64, "residual", row({"residual": 9})),
                            ("tree", 64, "auto", row({"residual": 1, "coupled": 5}))])
    assert pair.rule_choices.to_json()[key] == {"residual": [9.0, 1], "coupled": [5.0, 1]}
