"""Exact answers the sampling tests compare against: a tiny model's continuation distributions, a chi-square bound,
and the residual rule's exact law; and the SIMD level real models' pinned answers are kept by. Test code only: the
engine never computes these."""

from __future__ import annotations

import itertools
import math
import platform

import numpy as np

from edge.residual import Proposal
from edge.sampling import SamplingConfig, distribution
from tests.tiny import TinyModel


def simd_level() -> str:
    """The widest x86 vector extension ggml's and onnxruntime's CPU kernels use here ("avx512", "avx2"), else the
    machine's name: their arithmetic rounds by it, so a real model's greedy text or drafts measured on one may differ
    on another."""
    from edge.runtimes.llama_cpp._native import cpu_flags  # not for the tiny models' tests: llama.cpp's runtime

    flags = cpu_flags()
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else platform.machine()


def first_tokens_distribution(n_vocab: int, target: TinyModel, length: int, sampling: SamplingConfig):
    """Exact probability of every `length`-token continuation of [0, 1] under plain sampling."""
    exact = {}
    for seq in itertools.product(range(n_vocab), repeat=length):
        p, context = 1.0, [0, 1]
        for token in seq:
            ids, probs = distribution(target.logits(context), sampling, context)
            p *= dict(zip(ids.tolist(), probs.tolist(), strict=True)).get(token, 0.0)
            context.append(token)
        exact[seq] = p
    return exact


def chi_square(counts: dict, exact: dict, runs: int) -> tuple[float, float]:
    """(statistic, its critical value at p = 1e-4) over the outcomes, those expected fewer than 5 times pooled.
    The critical value is Wilson and Hilferty's approximation of the chi-square quantile (within 1% here)."""
    expected = np.array([p * runs for p in exact.values()])
    observed = np.array([counts.get(outcome, 0) for outcome in exact], float)
    assert sum(counts.values()) == observed.sum(), "an outcome the target cannot produce"
    small = expected < 5
    expected = np.append(expected[~small], expected[small].sum())
    observed = np.append(observed[~small], observed[small].sum())
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    z = 3.719  # the normal quantile at 1 - 1e-4
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return statistic, critical


def residual_law(p_ids: np.ndarray, p: np.ndarray, proposal: Proposal) -> tuple[np.ndarray, np.ndarray]:
    """The distribution of residual_draw's token given p and the proposal's candidates as drawn (fixed, not
    redrawn): (ids, probs) over p's and q's tokens. Averaged over the candidate draws it is p; given them it leans
    on the candidates (tests/test_residual_law.py checks both). Mirrors residual_draw step by step (the same
    updates, in the same order, with the same early ends), each uniform's test replaced by its probability."""
    support = np.union1d(p_ids, proposal.ids)
    target = np.zeros(len(support))
    target[np.searchsorted(support, p_ids)] = p
    draft = np.zeros(len(support))
    draft[np.searchsorted(support, proposal.ids)] = proposal.probs
    law = np.zeros(len(support))
    reach = 1.0  # the chance that every candidate so far was rejected
    for token in proposal.drawn.tolist():
        at = int(np.searchsorted(support, token))
        taken = min(1.0, target[at] / draft[at]) if draft[at] > 0 else float(target[at] > 0)  # u * q < p
        law[at] += reach * taken
        reach *= 1.0 - taken
        residual = np.maximum(target - draft, 0.0)
        mass = residual.sum()
        if mass <= 0:
            break
        target = residual / mass
        draft[at] = 0.0
        left = draft.sum()
        if left <= 0:
            break
        draft /= left
    # The last draw takes the first token whose cumulative sum passes u * total, the last one past them all.
    total = target.sum()
    edges = np.minimum(np.cumsum(target), total)
    edges[-1] = total
    width = np.diff(edges, prepend=0.0) / total if total > 0 else np.eye(len(support))[-1]
    return support, law + reach * width


def residual_probability(p_ids: np.ndarray, p: np.ndarray, proposal: Proposal, token: int) -> float:
    """The chance that residual_draw returns `token` given p and the proposal's candidates (residual_law's)."""
    support, law = residual_law(p_ids, p, proposal)
    at = int(np.searchsorted(support, token))
    return float(law[at]) if at < len(support) and support[at] == token else 0.0
