"""Measured acceptance: what verified trees teach, and the trees growth builds from it."""

from __future__ import annotations

import numpy as np

from edge.acceptance import Acceptance
from edge.grow import GrowConfig, grow
from edge.tree import TokenTree
from tests.tiny import TinyModel


def test_observe_counts_the_children_of_the_accepted_path() -> None:
    """Root 0 offers tokens 5 (p 0.6) and 6 (p 0.3); node 1 offers 7 (p 0.6). The target takes 5, then draws 8:
    one hit among the root's children, a miss at each of the other two, nothing from nodes off the path."""
    tree = TokenTree(np.array([1, 5, 6, 7, 9], np.int32), np.array([-1, 0, 0, 1, 2], np.int32),
                     np.array([0, 1, 1, 2, 2], np.int32), np.zeros(5, np.float32),
                     np.log(np.array([1.0, 0.6, 0.3, 0.6, 0.9], np.float32)))
    acceptance = Acceptance()
    acceptance.observe(tree, [0, 1], 8)
    assert acceptance.seen.sum() == 3 and acceptance.hits.sum() == 1  # node 4 sits under a rejected node
    bin_06 = np.searchsorted([0.0, 0.01, 0.03, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 0.6, side="right") - 1
    assert acceptance.seen[0, :, bin_06].sum() == 1 and acceptance.hits[0, :, bin_06].sum() == 1  # node 1, depth 1
    assert acceptance.seen[1, :, bin_06].sum() == 1 and acceptance.hits[1, :, bin_06].sum() == 0  # node 3, depth 2


def test_rates_start_at_the_draft_probability_and_follow_the_target() -> None:
    acceptance = Acceptance()
    assert abs(acceptance.rate(0.55) - 0.55) < 0.01 and abs(acceptance.rate(0.35) - 0.35) < 0.01
    tree = TokenTree(np.array([1, 5, 6], np.int32), np.array([-1, 0, 0], np.int32), np.array([0, 1, 1], np.int32),
                     np.zeros(3, np.float32), np.log(np.array([1.0, 0.55, 0.35], np.float32)))
    for _ in range(40):  # the drafter's top token at p = 0.55 is always right, its runner-up never
        acceptance.observe(tree, [0, 1], 2)
    assert acceptance.rate(0.55) > 0.95 and acceptance.rate(0.35) < 0.05
    assert abs(acceptance.rate(0.05) - 0.05) < 0.02  # bins never seen stay near their prior


def test_a_greedy_targets_rates_start_higher_for_the_top_token() -> None:
    """A greedy target takes the drafter's top token whenever it is its argmax: before any count its rate starts
    at sqrt(p); a runner-up's still starts at its probability."""
    greedy = Acceptance(greedy=True)
    assert abs(greedy.rate(0.25) - 0.5) < 0.03 and abs(greedy.rate(0.25, rank=1) - 0.25) < 0.01


def test_a_drafter_right_more_often_than_it_says_grows_a_chain() -> None:
    """The drafter gives its top token p ~ 0.55 and the runner-up ~ 0.3. Ranked by those, 16 nodes make a bushy
    tree a few levels deep; once the rates say the top token is always taken, the same budget makes a deep chain."""
    table = np.full((4, 4, 4), -3.0, np.float32)
    table[:, :, 1], table[:, :, 2] = 1.0, 0.4
    drafter = TinyModel(table=table, n_vocab=4)
    config = GrowConfig.for_budget(16)
    raw, _ = grow(drafter, 1, config)
    acceptance = Acceptance()
    for _ in range(40):  # verified rounds: the target took the top token at every level of the path
        tree, _ = grow(drafter, 1, config, acceptance)
        path = [0]
        while (child := tree.child(path[-1], 1)) is not None:
            path.append(child)
        acceptance.observe(tree, path, 1)
    calibrated, _ = grow(drafter, 1, config, acceptance)
    assert raw.depth.max() <= 6
    assert calibrated.depth.max() >= 12 > raw.depth.max()


def test_the_decoder_keeps_its_rates_across_prompts_but_not_across_sampling_rules() -> None:
    from edge.generate import Decoder
    from edge.sampling import SamplingConfig

    target = TinyModel(n_vocab=9, seed=5)
    decoder = Decoder(target, target.noisy(0.5), GrowConfig.for_budget(16), SamplingConfig(seed=1))
    decoder.load([1, 2, 3])
    list(decoder.generate(20))
    learned = decoder.acceptance
    assert learned.seen.sum() > 0
    decoder.set_sampling(SamplingConfig(seed=2))  # the bench does this before every prompt
    assert decoder.acceptance is learned
    decoder.set_sampling(SamplingConfig(temperature=0.8, seed=2))
    assert decoder.acceptance is not learned and decoder.acceptance.seen.sum() == 0


def test_rates_are_kept_by_depth() -> None:
    """Runs of acceptance: the same probability is taken more often deep in a path that survived so far."""
    acceptance = Acceptance()
    shallow = TokenTree(np.array([1, 5], np.int32), np.array([-1, 0], np.int32), np.array([0, 1], np.int32),
                        np.zeros(2, np.float32), np.log(np.array([1.0, 0.55], np.float32)))
    deep = TokenTree(shallow.tokens, shallow.parents, np.array([0, 40], np.int32), shallow.score, shallow.draft)
    for i in range(60):
        acceptance.observe(shallow, [0, 1] if i % 2 else [0], 2)  # taken half the time at depth 1
        acceptance.observe(deep, [0, 1], 2)  # always at depth 40
    assert 0.4 < acceptance.rate(0.55, depth=1) < 0.6 and acceptance.rate(0.55, depth=40) > 0.9
    assert 0.6 < acceptance.rate(0.55, depth=12) < 0.9  # depths never seen: the rate over all depths


def test_rates_are_kept_apart_for_the_top_token_and_runners_up() -> None:
    """An unsure drafter at p = 0.45 / 0.42: its top token is taken, the runner-up of the same probability not."""
    tree = TokenTree(np.array([1, 5, 6], np.int32), np.array([-1, 0, 0], np.int32), np.array([0, 1, 1], np.int32),
                     np.zeros(3, np.float32), np.log(np.array([1.0, 0.45, 0.42], np.float32)),
                     np.array([0, 0, 1], np.int32))
    acceptance = Acceptance()
    for _ in range(40):
        acceptance.observe(tree, [0, 1], 2)
    assert acceptance.rate(0.45, rank=0) > 0.95 and acceptance.rate(0.42, rank=1) < 0.05


def test_a_depth_learns_from_every_bin_and_lends_its_offset_to_bins_it_has_not_seen() -> None:
    """Deep in a path the top token at p = 0.75 is always taken, near the root a third of the time: a top token at
    p = 0.55, never seen deep, is still rated higher there than near the root."""
    acceptance = Acceptance()
    shallow = TokenTree(np.array([1, 5], np.int32), np.array([-1, 0], np.int32), np.array([0, 1], np.int32),
                        np.zeros(2, np.float32), np.log(np.array([1.0, 0.75], np.float32)))
    deep = TokenTree(shallow.tokens, shallow.parents, np.array([0, 20], np.int32), shallow.score, shallow.draft)
    at_055 = TokenTree(shallow.tokens, shallow.parents, shallow.depth, shallow.score,
                       np.log(np.array([1.0, 0.55], np.float32)))
    for i in range(60):
        acceptance.observe(shallow, [0, 1] if i % 3 == 0 else [0], 2)
        acceptance.observe(deep, [0, 1], 2)
        acceptance.observe(at_055, [0, 1] if i % 2 else [0], 2)  # half the time, near the root only
    assert acceptance.rate(0.75, depth=20) > 0.9 > 0.6 > acceptance.rate(0.75, depth=1)
    assert acceptance.rate(0.55, depth=20) > acceptance.rate(0.55, depth=1) + 0.2


def test_the_children_of_one_node_are_never_promised_more_than_certainty() -> None:
    """The target takes one token at a node. Rounds where an unsure top token (p 0.45) was always taken and rounds
    where a strong runner-up (p 0.42, under a top token of 0.55) was always taken rate both high; offered side by
    side, the two get chances that sum to at most 1: the top token keeps its measured rate, the runner-up gets what
    it leaves."""
    def node(top: float, runner_up: float) -> TokenTree:
        return TokenTree(np.array([1, 5, 6], np.int32), np.array([-1, 0, 0], np.int32),
                         np.array([0, 1, 1], np.int32), np.zeros(3, np.float32),
                         np.log(np.array([1.0, top, runner_up], np.float32)), np.array([0, 0, 1], np.int32))

    acceptance = Acceptance()
    for _ in range(40):
        acceptance.observe(node(0.45, 0.3), [0, 1], 3)
        acceptance.observe(node(0.55, 0.42), [0, 2], 3)
    draft = np.log(np.array([0.45, 0.42], np.float32))
    raw = np.exp(acceptance.log_accept(draft, 1, np.arange(2)))
    capped = np.exp(acceptance.log_accept_children(draft[None], np.array([1])))[0]
    assert raw.sum() > 1.5
    assert abs(capped.sum() - 1.0) < 1e-5 and abs(capped[0] - raw[0]) < 1e-6
