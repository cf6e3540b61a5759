"""--budget auto (edge/budget.py): counterfactual tokens per budget, the choice it makes from measured costs,
the fall back to plain decoding and the way back; on the tiny numpy model, so every number is known."""

from __future__ import annotations

import numpy as np
import pytest

from edge.budget import FIRST_PROBE, AutoBudget, Costs, tokens_by_budget
from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.sampling import SamplingConfig
from edge.speculative import RoundResult
from edge.tree import TokenTree
from tests.tiny import TinyModel


def scored_tree(parents: list[int], scores: list[float]) -> TokenTree:
    depth = np.zeros(len(parents), np.int32)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return TokenTree(np.arange(len(parents), dtype=np.int32), np.array(parents, np.int32), depth,
                     np.array(scores, np.float32))


def test_tokens_by_budget_follows_growth_ranking() -> None:
    # root -> 1 (-0.1) -> 3 (-0.5) -> 5 (-2.0); root -> 2 (-0.3) -> 4 (-0.9)
    tree = scored_tree([-1, 0, 0, 1, 2, 3], [0, -0.1, -0.3, -0.5, -0.9, -2.0])
    path = [0, 1, 3, 5]  # the target accepted 1, 3, 5
    # ranks: 1 -> 0, 2 -> 1, 3 -> 2, 4 -> 3, 5 -> 4
    assert tokens_by_budget(tree, path, (1, 2, 4, 5, 8)) == {1: 2, 2: 2, 4: 3, 5: 4}
    assert tokens_by_budget(tree, [0], (1, 4)) == {1: 1, 4: 1}  # nothing accepted: the target's own token


def flat_costs(target_ms: float, drafter_ms: float) -> Costs:
    """A target whose pass costs the same for any size (weights streamed), a drafter with a per-pass cost."""
    return Costs({1: target_ms, 256: target_ms}, {1: drafter_ms, 32: drafter_ms})


def test_costs_round_trip_and_interpolate() -> None:
    costs = Costs({1: 10.0, 65: 74.0}, {1: 5.0, 8: 12.0}, 50.0, {1: 2.0, 65: 66.0})
    assert Costs.from_json(costs.to_json()) == costs
    assert costs.target_s(32.5) == pytest.approx(0.0415) and costs.target_s(127) == pytest.approx(0.136)
    assert costs.verify_s(1, grow_s=0.02) == pytest.approx(0.002 + 0.03)  # the reading growth did not hide
    assert costs.verify_s(1, grow_s=0.2) == pytest.approx(0.002)


def test_a_pass_follows_the_reading_and_ends_a_tail_after_it() -> None:
    """Passes started with the reading take 55 ms (1 token) and 80 ms (65 tokens) where reading alone takes 50:
    tails of 5 and 30 ms. After 20 ms of growth, 30 ms of reading are left."""
    costs = Costs({1: 10.0, 65: 74.0}, {1: 5.0, 8: 12.0}, 50.0, {1: 6.0, 65: 66.0}, {1: 55.0, 65: 80.0})
    assert Costs.from_json(costs.to_json()) == costs
    assert costs.verify_s(1, grow_s=0.02) == pytest.approx(0.03 + 0.005)  # bound by the reading, then the tail
    assert costs.verify_s(65, grow_s=0.02) == pytest.approx(0.066)  # bound by its compute: the reading hides in it
    assert costs.verify_s(65, grow_s=0.0) == pytest.approx(0.080)  # as measured
    assert costs.verify_s(1, grow_s=0.2) == pytest.approx(0.006)  # all read: the warm pass


def test_streamed_target_speculates_and_compute_bound_target_does_not() -> None:
    streamed = AutoBudget(flat_costs(target_ms=200, drafter_ms=2))
    assert streamed.choose(256) is not None
    compute_bound = AutoBudget(Costs({1: 5, 16: 40, 64: 150, 256: 600}, {1: 7, 8: 20, 32: 70}))
    assert compute_bound.choose(256) is None  # even a chain of 1 costs more than it can yield here


def test_no_tries_when_the_drafter_catching_up_costs_more_than_their_share() -> None:
    """Plain decoding wins, and a 1-node tree would pay with twice the prior's tokens per pass, cheaply enough
    after ~40 plain rounds; but the drafter first runs every plainly decoded token (3.75 ms each), which costs
    more than 1/PROBE_SHARE of the 20 ms plain passes: no tree is ever tried."""
    costs = Costs({1: 20, 16: 60, 256: 400}, {1: 15, 8: 40, 32: 130})
    policy = AutoBudget(costs)
    assert policy._optimistic_rate(1) > 1 / policy.round_s(0)  # only the catching up stands in the way
    for _ in range(3000):
        assert policy.choose(256) is None
        policy.observe(None, round_result(None, 1, None, [0], 0.0, 0.020))


def test_one_slow_plain_pass_does_not_switch_to_trees() -> None:
    """A shared machine stalls now and then: a plain pass 5x slower than usual leaves plain decoding chosen."""
    policy = AutoBudget(Costs({1: 8, 16: 70, 64: 270, 256: 1000}, {1: 3, 8: 10, 32: 40}))
    for i in range(200):
        assert policy.choose(256) is None, f"a tree at round {i}"
        policy.observe(None, round_result(None, 1, None, [0], 0.0, 0.040 if i % 50 == 10 else 0.008))


def round_result(config: GrowConfig | None, tokens: int, tree: TokenTree | None, path: list[int],
                 grow_s: float, verify_s: float) -> RoundResult:
    return RoundResult(list(range(tokens)), TokenTree.root(0) if tree is None else tree, path,
                       0 if config is None else 3, {"grow": grow_s, "verify": verify_s})


def test_bad_acceptance_moves_the_choice_down_to_plain_then_probes_back() -> None:
    policy = AutoBudget(Costs({1: 20, 256: 40}, {1: 4, 32: 6}))
    config = policy.choose(256)
    assert config is not None and config.budget >= 8  # the prior expects trees to pay here
    chain = scored_tree(list(range(-1, config.budget)), [-float(i) for i in range(config.budget + 1)])
    for _ in range(30):  # nothing is ever accepted
        config = policy.choose(256)
        if config is None:
            break
        policy.observe(config, round_result(config, 1, chain, [0], 0.02, 0.03))
    assert config is None, "never fell back to plain decoding"
    def plain_rounds_until_a_tree() -> int:
        rounds = 0
        while (choice := policy.choose(256)) is None:
            policy.observe(None, round_result(None, 1, None, [0], 0.0, 0.02))
            rounds += 1
        policy.observe(choice, round_result(choice, 1, chain, [0], 0.02, 0.03))  # the try fails again
        return rounds

    first, second = plain_rounds_until_a_tree(), plain_rounds_until_a_tree()
    assert first >= FIRST_PROBE - 2  # a tree is tried again: the text may have changed ...
    assert second >= 2 * FIRST_PROBE - 1  # ... less often after each try that did not pay


def test_each_rule_keeps_its_own_yield() -> None:
    """Under --accept auto both rules run: sample-and-match's short walks must not shrink the residual rule's trees.
    A slow streamed target, where the residual rule's chains are taken to their leaf and match's stop at once: after
    rounds of both, match decodes plainly, and the residual rule still expects its measured yield and grows trees."""
    policy = AutoBudget(flat_costs(target_ms=200, drafter_ms=2))
    for _ in range(40):
        for rule, yields in (("match", False), ("residual", True)):
            config = policy.choose(256, rule)
            if config is None:
                assert rule == "match"
                policy.observe(None, round_result(None, 1, None, [0], 0.0, 0.2), rule)
                continue
            chain = scored_tree(list(range(-1, config.budget)), [-0.01 * i for i in range(config.budget + 1)])
            path = list(range(config.budget + 1)) if yields else [0]
            policy.observe(config, round_result(config, len(path), chain, path, 0.002, 0.2), rule)
    assert policy.expected_tokens(8, "residual") == pytest.approx(9, rel=0.01)
    assert policy.expected_tokens(8, "match") == pytest.approx(1, rel=0.01)
    assert policy.choose(256, "match") is None
    assert policy.choose(256, "residual").budget >= 8


def test_one_unlucky_first_round_does_not_keep_larger_trees_off() -> None:
    """The first tree (16 nodes) is rejected at its root: taken whole, that round would say every budget yields one
    token, and only the small trees chosen after it would ever be measured again. A streamed target where every
    later tree is accepted to its leaf: auto climbs back to large trees."""
    policy = AutoBudget(flat_costs(target_ms=200, drafter_ms=2))
    config = policy.choose(256)
    assert config is not None
    chain = scored_tree(list(range(-1, config.budget)), [-0.01 * i for i in range(config.budget + 1)])
    policy.observe(config, round_result(config, 1, chain, [0], 0.002, 0.2))  # nothing accepted
    for _ in range(200):
        config = policy.choose(256)
        if config is None:
            policy.observe(None, round_result(None, 1, None, [0], 0.0, 0.2))
            continue
        chain = scored_tree(list(range(-1, config.budget)), [-0.01 * i for i in range(config.budget + 1)])
        policy.observe(config, round_result(config, config.budget + 1, chain, list(range(config.budget + 1)), 0.002,
                                            0.2))
    assert min(policy.chosen[-20:]) >= 64, policy.chosen[-20:]


def test_no_probing_where_trees_cannot_pay() -> None:
    """A small target in RAM: even twice the prior's tokens per pass loses, so auto never tries a tree."""
    policy = AutoBudget(Costs({1: 7, 16: 68, 64: 264, 256: 1156}, {1: 7, 8: 19, 32: 68}))
    for _ in range(2000):
        assert policy.choose(256) is None
        policy.observe(None, round_result(None, 1, None, [0], 0.0, 0.007))


@pytest.mark.parametrize("seed", [5, 8])
def test_auto_is_lossless_and_uses_trees_when_the_target_is_slow(seed: int) -> None:
    """Greedy output with the policy equals plain decoding, whatever budgets it picks along the way."""
    prompt, n = [1, 2, 3], 80
    plain = Decoder(TinyModel(n_vocab=9, seed=seed), None, None, SamplingConfig())
    plain.load(prompt)
    expected = [s.token for s in plain.generate(n) if s.token is not None and s.finish_reason is None]
    target = TinyModel(n_vocab=9, seed=seed)
    policy = AutoBudget(flat_costs(target_ms=100, drafter_ms=1))
    decoder = Decoder(target, target.noisy(0.5), policy, SamplingConfig())
    decoder.load(prompt)
    steps = list(decoder.generate(n))
    assert [s.token for s in steps if s.token is not None and s.finish_reason is None] == expected
    assert min(policy.chosen) > 0  # a slow target: every round grew a tree
    assert steps[-1].stats.target_passes < n / 2  # trees paid
    assert target.cache == [*prompt, *expected][:-1]


class SlowTarget:
    """A target whose pass takes `base + per_token x n` seconds of a virtual clock: pass_ms reads that clock (no
    real sleeping, so no margin of real time decides the test)."""

    def __init__(self, base: float, per_token: float):
        self.base, self.per_token, self.passes, self.now = base, per_token, [], 0.0
        self.n_vocab = 1000

    def truncate(self, n: int) -> None:
        pass

    def prefill(self, tokens: list[int]) -> None:
        pass

    def verify(self, tree: TokenTree) -> None:
        self.passes.append(len(tree))
        self.now += self.base + self.per_token * len(tree)


def test_slow_passes_are_timed_once_and_long_ones_end_the_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 70B target from the drive takes ~20 s a token: pass_ms times each slow size once and extrapolates past a
    long pass once two sizes are measured, instead of 5 x (1 + 16 + 64 + 256) tokens' passes."""
    from types import SimpleNamespace

    import edge.offload.tuning as tuning

    fast = SlowTarget(0.0, 0.0)
    monkeypatch.setattr(tuning, "time", SimpleNamespace(perf_counter=lambda: fast.now))
    assert set(tuning.pass_ms(fast, [1, 2], (1, 16, 64), repeats=3, slow_s=0.05, long_s=0.1)) == {1, 16, 64}
    assert fast.passes == [1] * 3 + [16] * 3 + [64] * 3
    slow = SlowTarget(0.06, 0.001)  # every pass is slow (> 0.05 s); 16 tokens are long (> 0.07 s)
    monkeypatch.setattr(tuning, "time", SimpleNamespace(perf_counter=lambda: slow.now))
    measured = tuning.pass_ms(slow, [1, 2], (1, 16, 64, 256), repeats=3, slow_s=0.05, long_s=0.07)
    assert slow.passes == [1, 16] and measured == {1: 61.0, 16: 76.0}
    costs = Costs(measured, {1: 1.0})
    assert costs.target_s(64) > costs.target_s(16)  # the larger sizes extrapolated along the two measured


def test_fitted_constants_recover_the_model_they_come_from() -> None:
    from dataclasses import replace

    from edge.models.registry import ModelFacts, load_registry
    from edge.offload.machine import parse_machine
    from edge.offload.plan import Shape, fit_constants, pass_cost, plan_pair

    pair = replace(load_registry().pair("llama3.1-70b"), ctx=512)  # its KV cache planned whole: none of it lent
    target, drafter = (Shape.from_facts(m.facts) for m in (pair.target, pair.drafter))
    assert isinstance(pair.target.facts, ModelFacts)
    machine = parse_machine("ram=3.5G,disk=3GB/s,cores=2")  # too little to keep any of it resident
    plan = plan_pair(pair, target, drafter, machine)
    assert plan.target.placement == "ssd" and not plan.target.repack  # streamed from the mapping
    assert plan.target.resident_bytes == 0
    truth = replace(machine, disk_gbps=2.5)
    passes = {n: [pass_cost(plan.target, truth, n, cpu_gflops_per_core=90.0).seconds] for n in (1, 4, 16, 64)}
    fit = fit_constants(plan.target, machine, passes)
    assert fit is not None and fit["disk_gbps"] == pytest.approx(2.5, rel=1e-3)
    assert fit["cpu_gflops_per_core"] == pytest.approx(90.0, rel=1e-3)
    assert fit_constants(plan.target, machine, {1: [10.0, 11.0]}) is None  # one size: nothing to fit


@pytest.mark.parametrize("damage", [{"target_ms": {}}, {"target_ms": {"1": -3.0}}, {"target_ms": {"1": "nan"}},
                                    {"target_ms": {"0": 5.0}}, {"target_ms": []}, {"drafter_ms": {"8": 0}},
                                    {"read_ahead_ms": -1}, {"warm_ms": {}}])
def test_damaged_pass_times_are_refused(damage: dict) -> None:
    """pass-times.json is read back through Costs.from_json: what to_json could not have written is a ValueError
    (the pair then times its passes again) or a KeyError/TypeError, never costs that break --budget auto later."""
    good = Costs({1: 10.0, 16: 40.0}, {1: 2.0, 8: 5.0}).to_json()
    with pytest.raises((ValueError, KeyError, TypeError)):
        Costs.from_json({**good, **damage})
    assert Costs.from_json({**good, "drafter_ms": {}}).drafter_ms == {}  # lookup drafting alone: no drafter times


def test_a_seeded_reply_under_auto_repeats_whatever_the_rounds_took(monkeypatch) -> None:
    """--budget auto scales its predictions by how long rounds took; a seeded sampled reply's trees shape its draws
    (the residual rule draws the drafter's children), so with a seed the choice holds to the pass times the pair
    loaded with: the same text on a clock that runs fast, slow or erratically. Without the seed's hold, the same
    clocks choose other trees (the twin below)."""
    import time as clock_module

    import numpy as np

    from edge.budget import AutoBudget, Costs
    from edge.generate import Decoder
    from edge.sampling import SamplingConfig
    from tests.tiny import TinyModel

    target = TinyModel(n_vocab=6, seed=8, scale=1.0)
    costs = Costs({1: 30.0, 2: 33.0, 4: 36.0, 8: 40.0, 16: 48.0, 32: 60.0, 64: 90.0},
                  {1: 3.0, 2: 3.2, 4: 3.5, 8: 4.0, 16: 5.0})
    sampling = SamplingConfig(temperature=0.9, seed=7)

    def run(rate: float, seed_noise: int, held: bool) -> tuple[list[int], list[int]]:
        noise = np.random.default_rng(seed_noise)
        now = [0.0]

        def fake_clock() -> float:  # each reading a random step: rounds "took" arbitrary times
            now[0] += rate * float(noise.exponential())
            return now[0]

        monkeypatch.setattr(clock_module, "perf_counter", fake_clock)
        budget = AutoBudget(costs)
        decoder = Decoder(target, target.noisy(0.3, seed=4), budget, sampling, accept="residual")
        if not held:
            decoder.rounds.set_sampling(sampling)
            budget.hold_timing(False)
        decoder.load([0, 1])
        text = [step.token for step in decoder.generate(40) if step.finish_reason is None]
        monkeypatch.undo()
        return text, budget.chosen

    texts = {tuple(run(rate, noise, True)[0]) for rate, noise in ((1e-4, 1), (1.0, 2), (30.0, 3))}
    assert len(texts) == 1
    chosen = {tuple(run(rate, noise, False)[1]) for rate, noise in ((1e-4, 1), (1.0, 2), (30.0, 3))}
    assert len(chosen) > 1  # the twin: timing that is not held chooses other trees
