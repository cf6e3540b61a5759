"""The residual rule's exact law (tests/oracles.py: residual_law), and PathTarget (benchmarks/replay.py), which runs
the rule without tree passes.

residual_law is checked against residual_draw's frequencies with the candidates fixed, and against p once the
candidate draws are averaged out (exactly, by enumeration): the rule is lossless, computed rather than sampled.
PathTarget gives a real run's tokens and figures on the real pair.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from edge.models.pair import Pair

from benchmarks.replay import PathTarget
from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.residual import Proposal, residual_draw
from edge.sampling import SamplingConfig
from tests.conftest import prompt_tokens
from tests.oracles import chi_square, residual_law, residual_probability

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




@pytest.mark.parametrize("accept", ["match", "residual", "coupled"])
def test_path_target_is_a_real_run_without_tree_passes(smollm2: Pair, accept: str) -> None:
    """The real pair at budget 64, temperature 0.8: over PathTarget the same tokens and the same tokens per pass as
    over the target itself (batch-invariant: its one-token rows are the tree pass's), with one-token passes only."""
    sampling = SamplingConfig(temperature=0.8, top_k=40, seed=4)
    tokens = prompt_tokens(smollm2, "Write a short poem about the sea.")
    runs = []
    for target in (smollm2.target, PathTarget(smollm2.target)):
        smollm2.fit_budget(64)
        decoder = Decoder(target, smollm2.drafter, GrowConfig.for_budget(64), sampling, accept=accept)
        before = smollm2.target.passes
        decoder.load(tokens)
        steps = list(decoder.generate(48))
        runs.append((decoder.context, steps[-1].stats.tokens_per_pass, smollm2.target.passes - before))
        decoder.reset()
    (real, real_per_pass, tree_passes), (walked, walked_per_pass, one_token_passes) = runs
    assert walked == real and walked_per_pass == real_per_pass
    assert one_token_passes >= 48 > tree_passes  # a pass per token read, where the real run verified trees
