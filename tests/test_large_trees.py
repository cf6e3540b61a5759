"""Trees past 255 nodes: growth under the leaf bound (llama.cpp's 256 sequence ids bound a tree's leaves, not its
nodes), the shapes of large budgets, when --budget auto may choose them, and the limits said as one line; on tiny
numpy models and synthetic costs. tests/test_lossless.py verifies 1024-node trees on a real target."""

from __future__ import annotations

import json
from dataclasses import replace

import edge.offload.tuning as tuning
import numpy as np
import pytest
from edge.cli.render import flag
from edge.models.pair import Pair
from edge.offload.tuning import measure_costs

import edge.grow as grow_module
from edge.acceptance import Acceptance
from edge.budget import AutoBudget, Costs, budget_limit, is_flat
from edge.errors import UserError
from edge.grow import MAX_BUDGET, MAX_LEAVES, GrowConfig, grow
from edge.options import LoadOptions
from edge.sampling import SamplingConfig
from tests.tiny import TinyModel


def old_keep_best(kept: np.ndarray, score: np.ndarray, depth: np.ndarray, parents: np.ndarray, budget: int) -> None:
    """_keep_best before trees past 255 nodes: the best `budget` nodes (grow then cut leaves past 255)."""
    alive = np.flatnonzero(kept)[1:]
    if len(alive) > budget:
        order = np.lexsort((alive, depth[alive], -score[alive]))
        kept[alive[order[budget:]]] = False


@pytest.mark.parametrize("budget", [2, 5, 16, 64, 128, 255])
def test_budgets_within_the_leaf_bound_grow_the_trees_they_grew_before(budget: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Against the old selection, on drafters of several vocabularies and sharpness, with measured acceptance rates
    and stop tokens; the new drafters' room for 2048 nodes a round changes nothing at these budgets."""
    config = GrowConfig.for_budget(budget)
    for seed, (n_vocab, scale) in enumerate([(12, 2.0), (50, 1.0), (50, 4.0), (7, 0.5)]):
        acceptance = Acceptance()
        if seed % 2:
            acceptance.observe(grow(TinyModel(n_vocab, seed, scale), 1, config)[0], [0], 2)
        trees = []
        for keep_best, capacity in ((old_keep_best, 255), (grow_module._keep_best, MAX_BUDGET)):
            monkeypatch.setattr(grow_module, "_keep_best", keep_best)
            drafter = TinyModel(n_vocab, seed, scale)
            drafter.expand_capacity = capacity
            drafter.prefill([1, 2])
            trees.append(grow(drafter, 3, config, acceptance, frozenset({seed})))
        (old, old_passes), (new, new_passes) = trees
        assert len(old.leaves()) <= MAX_LEAVES  # so the old cut of leaves after growing changed nothing
        assert old_passes == new_passes
        for field in ("tokens", "parents", "depth", "score", "draft", "rank"):
            assert np.array_equal(getattr(old, field), getattr(new, field)), (seed, field)


@pytest.mark.parametrize("budget", [1024, 2048])
@pytest.mark.parametrize("room", ["budget", 255])
def test_large_budgets_fill_the_nodes_the_drafter_allows_within_the_leaf_bound(budget: int, room: int | str) -> None:
    """A drafter with room for the budget's nodes gives exactly `budget` of them; one with room for 255 (a drafter
    loaded for small trees) gives 255 inner nodes and 255 leaves at most, 509 draft nodes."""
    config = GrowConfig.for_budget(budget)
    for seed in (0, 1):
        drafter = TinyModel(n_vocab=12, seed=seed)
        drafter.expand_capacity = budget if room == "budget" else room
        drafter.prefill([1, 2])
        tree, passes = grow(drafter, 3, config)
        assert len(tree) - 1 == min(budget, drafter.expand_capacity + MAX_LEAVES - 1)
        assert len(tree.leaves()) <= MAX_LEAVES
        assert all(0 <= parent < node for node, parent in enumerate(tree.parents) if node > 0)  # connected, in order
        assert (tree.depth[1:] == tree.depth[tree.parents[1:]] + 1).all()
        assert (tree.score[1:] <= tree.score[tree.parents[1:]]).all()
        siblings = set(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True))
        assert len(siblings) == len(tree)  # children of a node carry distinct tokens
        assert passes == drafter.passes <= config.max_steps + 1


def reference_keep(kept: np.ndarray, score: np.ndarray, depth: np.ndarray, parents: np.ndarray, budget: int,
                   max_leaves: int) -> set[int]:
    """Best-first selection under the leaf bound, one node at a time: the rule _keep_best vectorizes."""
    ran = set(parents[1:].tolist())
    alive = np.flatnonzero(kept)[1:].tolist()
    taken, has_child, leaves = {0}, set(), 1
    for node in sorted(alive, key=lambda v: (v not in ran, -score[v], depth[v], v)):
        parent = int(parents[node])
        if len(taken) - 1 == budget or parent not in taken:
            continue
        if parent in has_child:  # a second child: one more leaf
            if leaves == max_leaves:
                continue
            leaves += 1
        has_child.add(parent)
        taken.add(node)
    return taken


@pytest.mark.parametrize("seed", range(40))
def test_keep_best_takes_the_best_nodes_the_leaf_bound_allows(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vectorized selection against the one-node-at-a-time rule, on random trees with tied scores, nodes already
    dropped and a leaf bound of 2-9 (patched in, so that small trees reach it)."""
    rng = np.random.default_rng(seed)
    max_leaves = int(rng.integers(2, 10))
    monkeypatch.setattr(grow_module, "MAX_LEAVES", max_leaves)
    n = int(rng.integers(max_leaves + 3, 150))
    parents = np.array([-1, *(rng.integers(max(0, i - 8), i) for i in range(1, n))], np.int32)
    depth, score = np.zeros(n, np.int32), np.zeros(n, np.float32)
    kept = rng.random(n) > 0.1
    kept[0] = True
    for node in range(1, n):
        depth[node] = depth[parents[node]] + 1
        score[node] = score[parents[node]] - rng.choice([0.0, 0.5, 1.0, 2.0])  # ties: equal scores, children too
        kept[node] &= kept[parents[node]]
    budget = int(rng.integers(max_leaves + 1, n + 5))
    expected = reference_keep(kept, score, depth, parents, budget, max_leaves)
    grow_module._keep_best(kept, score, depth, parents, budget)
    assert set(np.flatnonzero(kept).tolist()) == expected


def test_budget_limits_are_one_line() -> None:
    for make in (lambda: GrowConfig.for_budget(MAX_BUDGET + 1), lambda: LoadOptions(budget=MAX_BUDGET + 1)):
        with pytest.raises(UserError, match=f"at most {MAX_BUDGET}"):
            make()
    assert LoadOptions(budget="2048").budget == 2048
    assert GrowConfig.for_budget(255) == GrowConfig(budget=255, beams=1, width=4, max_depth=255, max_steps=24,
                                                    extend_prob=grow_module.EXTEND_PROB)  # as before
    assert (GrowConfig.for_budget(1024).beams, GrowConfig.for_budget(2048).beams) == (64, 128)


class FixedTarget(TinyModel):
    """A target with the onnx target's fixed 256-node verify pass (no `enlarge`)."""

    def __init__(self) -> None:
        super().__init__()
        self.max_tree = 256


def test_a_budget_past_an_onnx_targets_pass_is_one_line() -> None:
    pair = Pair("qs", FixedTarget(), TinyModel(), None, 64, None, None, LoadOptions())  # type: ignore[arg-type]
    pair.decoder(SamplingConfig(), budget=255)
    with pytest.raises(UserError) as refused:
        pair.decoder(SamplingConfig(), budget=1024)
    assert refused.value.worded(flag) == ("--budget 1024: qs verifies at most 256 nodes a pass (an onnx target, "
                                          "QuantSpec); use 255 or less, or auto")


def flat_costs(large: bool) -> Costs:
    """A large target bound by reading its weights (400 ms a pass, about whatever its size), a drafter likewise."""
    target = {1: 400.0, 16: 400.1, 64: 400.4, 256: 401.5, **({1024: 406.0, 2048: 412.0} if large else {})}
    return Costs(target, {1: 2.0, 8: 2.0, 32: 2.1, 64: 2.2, 128: 2.4})


def test_auto_chooses_large_budgets_only_where_passes_were_measured_flat() -> None:
    assert is_flat(flat_costs(large=False)) and budget_limit(flat_costs(large=True)) == 2048
    assert AutoBudget(flat_costs(large=True)).choose(2049).budget > MAX_LEAVES
    assert AutoBudget(flat_costs(large=True)).choose(256).budget == 255  # a target not enlarged: 256 nodes
    assert AutoBudget(flat_costs(large=False)).choose(2049).budget == 255  # never measured: never chosen
    steep = Costs({1: 7.0, 16: 40.0, 64: 150.0, 256: 600.0}, {1: 7.0, 8: 20.0, 32: 70.0})
    assert not is_flat(steep) and budget_limit(steep) == 255
    # the large passes measured, but far slower than small ones: smaller trees win
    costly = replace(flat_costs(large=True), target_ms={**flat_costs(large=False).target_ms, 1024: 1600.0,
                                                        2048: 3200.0})
    assert AutoBudget(costly).choose(2049).budget <= MAX_LEAVES


class Enlargeable(TinyModel):
    """A llama.cpp-like target and drafter that record how they were resized."""

    def __init__(self) -> None:
        super().__init__()
        self.max_tree, self.enlarged = 256, []

    def resize(self, size: int) -> bool:
        self.enlarged.append(size)
        self.max_tree = self.expand_capacity = size
        return True


@pytest.mark.parametrize("flat", [True, False])
def test_measure_costs_times_large_trees_only_where_flat(flat: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    def pass_ms(target, prefix, sizes, repeats=5, before=None):
        return {n: 20.0 + n * (0.001 if flat else 2.0) for n in sizes}

    def expand_ms(drafter, prefix, sizes=(1, 8, 32), repeats=5):
        return dict.fromkeys(sizes, 2.0)

    monkeypatch.setattr(tuning, "pass_ms", pass_ms)
    monkeypatch.setattr(tuning, "expand_ms", expand_ms)
    target, drafter = Enlargeable(), Enlargeable()
    costs = measure_costs(target, drafter, [1, 2, 3], target.max_tree)
    assert (max(costs.target_ms), target.enlarged, drafter.enlarged) == ((2048, [2049], [2048]) if flat else
                                                                         (256, [], []))
    assert (max(costs.drafter_ms) == 128) == flat


def test_budgets_past_2048_are_one_line_on_the_command_line() -> None:
    from edge.cli.benchmark import parse_budgets

    from tests.cli_helpers import assert_one_line_error, run

    assert parse_budgets("16,64,255,1024,2048") == [16, 64, 255, 1024, 2048]
    assert_one_line_error(run("generate", "hi", "--budget", "4096"), "--budget can be at most 2048")
    assert_one_line_error(run("bench", "--budgets", "16,4096"), "--budgets must be auto or between 1 and 2048")


def test_bench_runs_a_budget_of_1024(tmp_path) -> None:
    """bench sizes the target's verify batch for its largest budget: the 1024 row grows trees past 255 nodes
    (about 8 s here: a 1025-node pass takes 3-6 s on 2 cores)."""
    from tests.cli_helpers import run

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name three colors.\n")
    result = run("bench", "--pair", "smollm2-135m", "--prompts", str(prompts), "--budgets", "1024", "--max-tokens", "6",
                 "--json")
    assert result.exit_code == 0, result.output
    plain, tree = json.loads(result.stdout)["rows"]
    assert plain["method"] == "plain" and tree["budget"] == 1024 and tree["matches_plain"], tree
    assert tree["tree_nodes_per_round"] > 256, tree


@pytest.mark.parametrize("n", [1, 2, 3, 17, 256, 1025])
def test_a_verify_batch_is_put_in_tree_order_in_place(n: int) -> None:
    """llama.cpp's logits come in batch order (spine first); verify moves the rows into tree order inside that same
    buffer, cycle by cycle: every permutation, fixed points and one long cycle included, gives the gathered rows."""
    from edge.runtimes.llama_cpp.models import permute_rows

    rng = np.random.default_rng(n)
    for place in (rng.permutation(n), np.arange(n), np.roll(np.arange(n), 1)):
        rows = rng.standard_normal((n, 5)).astype(np.float32)
        expected = rows[place]
        permute_rows(rows, place)
        assert np.array_equal(rows, expected)
