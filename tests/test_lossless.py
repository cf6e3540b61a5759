"""Losslessness on real models (llama.cpp, the two offline pairs): bit-exact trees, token-exact output."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from edge.models.pair import Pair
from edge.runtimes.llama_cpp._native import MAX_SEQ

from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.invariance import check_batch_invariance, compare, large_tree_shapes, sequential_logits
from edge.sampling import SamplingConfig, distribution
from tests.conftest import CHAT_PROMPTS, REPO, GreedyReplies, _load, prompt_tokens, prompts_for

# Greedy replies are checked 64 tokens long: 10-30 rounds a prompt and budget, each budget on four to six prompts but
# 255 on two (budgets_for; 128 tokens took twice the suite's time for rounds of the kinds the first 64 already hold).
MAX_TOKENS = 64
# Budget 255 with fewer, narrower drafter passes than the CLI default: still a full 256-node tree for the
# target to verify (what losslessness depends on), at a third of the drafting time. 16 and 64 without the
# one-node passes that extend a tree's best path past max_steps (up to `budget` passes a round): acceptance
# does not depend on how deep a tree is, those passes only add drafting time here, and tests/test_engine.py
# checks the extension itself.
GROW = {1: GrowConfig.for_budget(1), 16: replace(GrowConfig.for_budget(16), extend_prob=None),
        64: replace(GrowConfig.for_budget(64), extend_prob=None),
        255: GrowConfig(budget=255, beams=12, width=8, max_depth=16, max_steps=7)}


def test_tree_logits_equal_sequential_decoding(pair: Pair) -> None:
    """Chain, 255 leaves, and a drafter-grown 255-node tree: every checked node bit-identical."""
    tokens = prompt_tokens(pair, prompts_for(pair)[0])
    results = check_batch_invariance(pair.target, pair.drafter, tokens)
    assert [r.shape for r in results] == ["chain of 16", "255 leaves", "grown, budget 255"]
    for result in results:
        assert result.nodes_checked >= min(result.nodes, 60), result
        assert result.max_abs_diff == 0.0 and result.argmax_differences == 0, result
    assert results[1].nodes == MAX_SEQ


def test_a_streamed_q4_0_target_is_bit_exact(smollm2: Pair) -> None:
    """A target larger than RAM loads without llama.cpp's repacked buffers (models.loading.load_pair): its Q4_0 weights
    then run on the plain kernels, which must be batch-invariant too for greedy speculation to stay lossless."""
    from edge.models.opening import materialize
    from edge.runtimes.llama_cpp import RunOptions, load_target

    q4_0 = materialize(replace(smollm2.spec.target, quantize="q4_0"))
    target = load_target(q4_0, RunOptions(n_ctx=1024, kv_type="bf16", repack=False))
    try:
        results = check_batch_invariance(target, smollm2.drafter, prompt_tokens(smollm2, prompts_for(smollm2)[0]))
    finally:
        target.close()
    for result in results:
        assert result.max_abs_diff == 0.0 and result.argmax_differences == 0, result


@pytest.fixture(scope="module")
def smollm2_1024() -> Iterator[Pair]:
    """SmolLM2 loaded for budget 1024: a verify batch of 1025 nodes, the drafter's room for as many, and a context
    that holds a prompt and such a tree."""
    pair = _load("smollm2-135m", ctx=2048, budget=1024)
    yield pair
    pair.close()


def test_1024_node_trees_equal_sequential_decoding(smollm2_1024: Pair) -> None:
    """255 chains under the root, and a tree grown at budget 1024: 1025 nodes and 255 leaves in one pass (one seq
    per leaf), every checked node bit-identical to plain decoding."""
    pair = smollm2_1024
    tokens = prompt_tokens(pair, CHAT_PROMPTS[0])
    shapes = large_tree_shapes(pair.drafter, tokens[:-1], tokens[-1])
    for name, tree in shapes.items():
        assert len(tree) == 1025 and len(tree.leaves()) <= MAX_SEQ - 1, name
        checked, worst, flips = compare(pair.target, tree, tokens[:-1], max_paths=30)  # 30 leaves' paths
        assert checked >= 120 and worst == 0.0 and flips == 0, (name, checked, worst, flips)
    assert len(shapes["1024 nodes, 255 leaves"].leaves()) == MAX_SEQ - 1


def test_greedy_speculation_at_budget_1024_equals_plain_decoding(smollm2_1024: Pair) -> None:
    """Short replies (a round here grows for ~1.8 s and verifies 1025 nodes in ~3.4 s): the output token for token,
    the first round's tree full."""
    pair = smollm2_1024
    grow_config = replace(GrowConfig.for_budget(1024), extend_prob=None)
    for text in (CHAT_PROMPTS[1],):
        tokens = prompt_tokens(pair, text)
        outputs, first_tree = [], 0
        for decoder in (Decoder(pair.target), Decoder(pair.target, pair.drafter, grow_config)):
            decoder.reset()
            decoder.load(tokens)
            out = []
            for step in decoder.generate(12):
                first_tree = first_tree or (step.stats.tree_nodes if decoder.drafter is not None else 0)
                out.append(step.token)
            outputs.append(out)
        assert outputs[1] == outputs[0], text
        assert first_tree == 1025 and step.stats.target_passes == step.stats.rounds, step.stats
        assert_caches_hold_exactly(pair, decoder)


def generate(pair: Pair, tokens: list[int], budget: int | None, sampling: SamplingConfig | None = None,
             max_tokens: int = MAX_TOKENS, accept: str = "match") -> tuple[list[int], Decoder]:
    decoder = Decoder(pair.target, pair.drafter, GROW[budget] if budget else None, sampling, accept=accept)
    decoder.reset()
    decoder.load(tokens)
    steps, rounds, nodes = [], 0, 0
    for step in decoder.generate(max_tokens):
        stats = step.stats
        if budget == 255 and stats.rounds != rounds:  # a round's first token: its tree is counted
            # the trees really were full, where the reply's end did not cap their depth (edge.generate)
            if max_tokens - (stats.new_tokens - 1) > GROW[255].max_depth:
                assert stats.tree_nodes - nodes >= 250, f"round {stats.rounds}: {stats.tree_nodes - nodes} nodes"
            rounds, nodes = stats.rounds, stats.tree_nodes
        steps.append(step)
    assert stats.target_passes == stats.rounds  # exactly one target pass per round
    return [s.token for s in steps if s.finish_reason is None], decoder


def budgets_for(prompt: int) -> list[int]:
    """The budgets a prompt's greedy reply is checked at, two each: 1 and 255 on prompts 3 and 7, 16 and 64 on 1, 2, 5
    and 6, 1 and 16 on 0 and 4. Budget 255 meets two prompts (~11 rounds of full 256-node trees each; its verify pass
    takes most of the test's time), as test_tree_logits_equal_sequential_decoding checks such trees node by node."""
    return {0: [1, 16], 1: [16, 64], 2: [64, 16], 3: [255, 1]}[prompt % 4]


def test_greedy_speculation_equals_plain_decoding(pair: Pair, greedy: GreedyReplies) -> None:
    prompts = prompts_for(pair)
    for i, text in enumerate(prompts):
        tokens = prompt_tokens(pair, text)
        plain = greedy(pair, tokens, MAX_TOKENS)
        for budget in budgets_for(i):
            spec, decoder = generate(pair, tokens, budget)
            assert spec == plain, f"budget {budget} differs on {text!r}"
            assert_caches_hold_exactly(pair, decoder)
    assert_replies_differ([greedy(pair, prompt_tokens(pair, text), MAX_TOKENS) for text in prompts])


def assert_replies_differ(replies: list[list[int]]) -> None:
    """Eight prompts, eight replies, none empty and no two the same: a decoder that answered every prompt alike
    (the prompt never read, or one reply cached for all) would make every comparison above hold."""
    assert len(replies) >= 8 and all(replies) and len({tuple(reply) for reply in replies}) == len(replies)


def assert_caches_hold_exactly(pair: Pair, decoder: Decoder) -> None:
    """After many rounds each KV cache holds the committed text but its newest token, and nothing else."""
    n = len(decoder.context) - 1
    for runner in (pair.target, pair.drafter):
        assert runner.n_past + len(getattr(runner, "_pending", [])) == n
        assert runner.ctx.seq_pos_min(0) == 0 and runner.ctx.seq_pos_max(0) == runner.n_past - 1
        assert all(runner.ctx.seq_pos_max(seq) == -1 for seq in range(1, MAX_SEQ))


def test_plain_decoding_equals_llama_cpp_python(pair: Pair, greedy: GreedyReplies,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An independent greedy decoder: llama-cpp-python's own Llama class, same file and KV settings."""
    import llama_cpp.llama_cpp as native
    from edge.runtimes.llama_cpp._native import USE_EXTRA_BUFFERS
    from llama_cpp import Llama, llama_get_logits_ith

    defaults = native.llama_model_default_params

    def model_params():  # the weight buffers edge-spec uses (no AMX buffers where they crash)
        params = defaults()
        params.use_extra_bufts = USE_EXTRA_BUFFERS
        return params

    monkeypatch.setattr(native, "llama_model_default_params", model_params)
    llm = Llama(str(pair.target.model.path), n_ctx=1024, n_batch=512, type_k=30, type_v=30, flash_attn=True,
                verbose=False)
    for text in prompts_for(pair):
        tokens = prompt_tokens(pair, text)
        expected = greedy(pair, tokens, MAX_TOKENS)
        llm.reset()
        llm.eval(tokens)
        out = []
        for _ in range(len(expected)):
            last = np.ctypeslib.as_array(llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
            token = int(np.argmax(last))
            out.append(token)
            llm.eval([token])
        assert out == expected, text


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.8, top_p=0.95, seed=3),
                                      SamplingConfig(temperature=1.0, top_k=40, min_p=0.02, repeat_penalty=1.1,
                                                     seed=9)])
def test_sampled_speculation_with_a_seed_is_plain_sampling(pair: Pair, sampling: SamplingConfig) -> None:
    """Each emitted token uses exactly one uniform in both decoders, so a seed reproduces plain sampling."""
    for text in prompts_for(pair)[:2]:
        tokens = prompt_tokens(pair, text)
        assert generate(pair, tokens, 16, sampling, 48)[0] == generate(pair, tokens, None, sampling, 48)[0]


@pytest.mark.parametrize("budget", [16, 64])
def test_coupled_speculation_with_a_seed_is_plain_coupled_sampling(pair: Pair, budget: int) -> None:
    """Coupled sampling (edge/coupled.py): the target's draws come from noise fixed by each token's position, so the
    reply is plain sampling's with the same seed whatever the drafter's trees offered (the drafter ranks its children
    on the same noise), at a temperature where they often disagree."""
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=5)
    taken = 0
    for text in prompts_for(pair)[:2]:
        tokens = prompt_tokens(pair, text)
        speculative, decoder = generate(pair, tokens, budget, sampling, 48, accept="coupled")
        assert speculative == generate(pair, tokens, None, sampling, 48, accept="coupled")[0]
        taken += decoder.acceptances["coupled"].hits.sum() > 0
    assert taken == 2  # the trees' children were taken: speculation ran, not two plain replies


# The distribution tests draw two-token continuations: a chain of two drafted nodes is every node that can decide them
# (deeper ones only cost drafter passes).
TWO_DEEP = GrowConfig.for_budget(2)


def test_coupled_sampling_follows_the_targets_distribution(smollm2: Pair) -> None:
    """Coupled sampling on the real pair: two-token continuations over 400 seeded generations against their exact
    probabilities from the target's logits, as for the residual rule below."""
    sampling = SamplingConfig(temperature=1.0, top_k=5, top_p=0.9)
    tokens = prompt_tokens(smollm2, "Name a colour.")
    exact = two_token_probabilities(smollm2, tokens, sampling)
    runs, counts = 400, {}
    decoder = Decoder(smollm2.target, smollm2.drafter, TWO_DEEP, sampling, accept="coupled")
    for seed in range(runs):
        decoder.set_sampling(replace(sampling, seed=seed))
        decoder.load(tokens)
        key = tuple(s.token for s in decoder.generate(2) if s.finish_reason is None)
        counts[key] = counts.get(key, 0) + 1
    assert decoder.acceptance is decoder.acceptances["coupled"]
    assert_within_five_sigma(counts, exact, runs)


def two_token_probabilities(pair: Pair, tokens: list[int], sampling: SamplingConfig) -> dict[tuple[int, int], float]:
    """The exact probability of every two-token continuation of `tokens`, from the target's sequential logits."""
    first = sequential_logits(pair.target, tokens[:-1], [tokens[-1]])[0]
    ids, probs = distribution(first, sampling, tokens)
    exact = {}
    for token, p in zip(ids.tolist(), probs.tolist(), strict=True):
        second = sequential_logits(pair.target, tokens, [token])[0]
        ids2, probs2 = distribution(second, sampling, [*tokens, token])
        exact.update({(token, t2): p * p2 for t2, p2 in zip(ids2.tolist(), probs2.tolist(), strict=True)})
    return exact


def assert_within_five_sigma(counts: dict, exact: dict, runs: int) -> None:
    assert set(counts) <= set(exact)
    for outcome, p in exact.items():
        assert abs(counts.get(outcome, 0) / runs - p) <= 5 * np.sqrt(p * (1 - p) / runs) + 1e-9, outcome


def test_sampled_first_tokens_follow_the_targets_distribution(smollm2: Pair) -> None:
    """Two-token continuations over 400 draws vs their exact probabilities from the target's logits.

    Bound: 5 standard deviations per outcome; with at most 25 outcomes a correct sampler fails with
    probability < 25 * 5.7e-7. The drafter (a different quantization) disagrees with the target often at
    temperature 1, so a rule that leaned on its proposals would show here.
    """
    sampling = SamplingConfig(temperature=1.0, top_k=5)
    tokens = prompt_tokens(smollm2, "Name a colour.")
    exact = two_token_probabilities(smollm2, tokens, sampling)
    decoder = Decoder(smollm2.target, smollm2.drafter, TWO_DEEP, SamplingConfig(1.0, 5, seed=21))
    decoder.reset()
    runs, counts = 400, {}
    for _ in range(runs):
        decoder.load(tokens)
        key = tuple(s.token for s in decoder.generate(2) if s.finish_reason is None)
        counts[key] = counts.get(key, 0) + 1
    assert_within_five_sigma(counts, exact, runs)


def test_residual_rule_follows_the_targets_distribution(smollm2: Pair) -> None:
    """The residual rule on the real pair (the llama.cpp drafter's q on its Q4_0 requantization, the target's p):
    two-token continuations over 400 seeded generations against their exact probabilities from the target's logits,
    as above, at a temperature and top-p where the drafter's draws are often not the target's."""
    sampling = SamplingConfig(temperature=1.0, top_k=5, top_p=0.9)
    tokens = prompt_tokens(smollm2, "Name a colour.")
    exact = two_token_probabilities(smollm2, tokens, sampling)
    runs, counts, residual_rounds = 400, {}, 0
    decoder = Decoder(smollm2.target, smollm2.drafter, TWO_DEEP, sampling, accept="residual")
    for seed in range(runs):  # a seed per generation, as separate requests would have
        decoder.set_sampling(replace(sampling, seed=seed))
        decoder.load(tokens)
        steps = list(decoder.generate(2))
        key = tuple(s.token for s in steps if s.finish_reason is None)
        counts[key] = counts.get(key, 0) + 1
        residual_rounds += steps[-1].stats.residual_rounds
    assert residual_rounds >= runs  # every generation's first round at least
    assert_within_five_sigma(counts, exact, runs)


def test_greedy_speculation_with_lookup_equals_plain_decoding(pair: Pair, greedy: GreedyReplies) -> None:
    """Lookup's branches beside the drafter's in one tree, and lookup alone: the target's greedy text, token for
    token. The prompt asks the same thing twice (the prompt, its plain reply, the prompt again), so lookup proposes
    long continuations, and they are accepted."""
    from edge.lookup import Lookup

    for text in prompts_for(pair)[:3]:
        first = prompt_tokens(pair, text)
        reply = greedy(pair, first, MAX_TOKENS)
        tokens = [*first, *reply, *first[1:]]  # asked again (the BOS once)
        plain = greedy(pair, tokens, 64)
        for drafter in (pair.drafter, None):
            decoder = Decoder(pair.target, drafter, GROW[16], lookup=Lookup())
            decoder.reset()
            decoder.load(tokens)
            steps = list(decoder.generate(64))
            assert [s.token for s in steps[:-1]] == plain, f"lookup, drafter {drafter is not None}, on {text!r}"
            stats = steps[-1].stats
            assert stats.tokens_per_pass > 1.5 and stats.target_passes == stats.rounds, stats
            assert_caches_hold_exactly(pair, decoder)


def test_greedy_speculation_with_overlap_equals_plain_decoding(pair: Pair, greedy: GreedyReplies) -> None:
    """The drafter grows during the target's pass (llama.cpp's decode in a worker thread, the drafter on the main
    one; edge/overlap.py), and rounds verify the trees grown so: the target's greedy text, token for token, and
    each cache holds exactly the committed text."""
    for text in prompts_for(pair)[:2]:
        tokens = prompt_tokens(pair, text)
        plain = greedy(pair, tokens, 64)
        decoder = Decoder(pair.target, pair.drafter, GROW[16], overlap=True)
        decoder.reset()
        decoder.load(tokens)
        steps = list(decoder.generate(len(plain)))
        assert [s.token for s in steps[:-1]] == plain, f"overlap, on {text!r}"
        stats = steps[-1].stats
        assert stats.target_passes == stats.rounds and stats.hidden_s > 0, stats
        assert_caches_hold_exactly(pair, decoder)


def test_sampled_speculation_with_lookup_follows_the_targets_distribution(smollm2: Pair) -> None:
    """Two-token continuations of a conversation whose last question was asked before (so lookup proposes the
    earlier answer), lookup's branches in every tree: beside the drafter's under the residual rule, and alone
    (sample-and-match). 400 seeded generations each against the exact probabilities, as above."""
    from edge.lookup import Lookup

    sampling = SamplingConfig(temperature=1.0, top_k=5, top_p=0.9)
    tokens = smollm2.prompt_tokens([{"role": "user", "content": "Name a colour."},
                                    {"role": "assistant", "content": "Blue is a colour."},
                                    {"role": "user", "content": "Name a colour."}])
    proposed = Lookup()
    proposed.set_text(tokens)
    assert len(proposed.propose(8)) >= 2  # the earlier answer
    exact = two_token_probabilities(smollm2, tokens, sampling)
    for drafter, accept in ((smollm2.drafter, "residual"), (None, "match")):
        runs, counts = 400, {}
        decoder = Decoder(smollm2.target, drafter, TWO_DEEP, sampling, accept=accept, lookup=Lookup())
        decoder.reset()
        for seed in range(runs):
            decoder.set_sampling(replace(sampling, seed=seed))
            decoder.load(tokens)
            steps = list(decoder.generate(2))
            key = tuple(s.token for s in steps if s.finish_reason is None)
            counts[key] = counts.get(key, 0) + 1
        assert_within_five_sigma(counts, exact, runs)


CODE_PROMPTS = ("Write a Python function that reverses a string.", CHAT_PROMPTS[4])


def test_the_real_pairs_k_quant_target_is_guaranteed_lossless(qwen: Pair) -> None:
    """Q4_K and Q6_K weights as shipped: every K-quant batch takes one kernel (runtimes/llama_cpp/kernels.py), so the
    pair loads with no lossless warning."""
    from edge.runtimes.gguf_file import check_gguf

    assert {"Q4_K", "Q6_K"} <= check_gguf(qwen.target.model.path).weight_types
    assert qwen.lossless_warning is None


def test_greedy_speculation_on_the_real_pair_equals_plain_decoding(qwen: Pair, greedy: GreedyReplies) -> None:
    """Two different models, both files as shipped (K-quant target and drafter): the same tokens at budget 16, and 64
    on the first prompt (a 1.5B target's 65-node pass is the test's cost), and caches holding exactly the committed
    text."""
    for i, text in enumerate(CODE_PROMPTS):
        tokens = prompt_tokens(qwen, text)
        plain = greedy(qwen, tokens, 48)
        for budget in (16, 64) if i == 0 else (16,):
            spec, decoder = generate(qwen, tokens, budget, max_tokens=48)
            assert spec == plain, f"budget {budget} differs on {text!r}"
            assert_caches_hold_exactly(qwen, decoder)


@pytest.fixture(scope="module")
def cut_qwen_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real pair's target cut to its first 2 layers: its Q4_K and Q6_K blocks (the head's too) as shipped, in a
    file whose passes take milliseconds."""
    from edge.models.opening import materialize
    from edge.models.registry import load_registry

    from tests.ggufs import cut_layers

    source = materialize(load_registry().pair("qwen2.5-coder-1.5b").target)
    return cut_layers(source, tmp_path_factory.mktemp("qwen-target") / "cut.gguf", 2)


def test_k_quant_tree_logits_equal_sequential_decoding(cut_qwen_target: Path) -> None:
    """Chain, 255 leaves and a grown 255-node tree over Q4_K/Q6_K weights, loaded as a pair loads its target (no
    repacked buffers): every checked node bit-identical to plain decoding."""
    from edge.runtimes.gguf_file import check_gguf
    from edge.runtimes.llama_cpp import RunOptions, keeps_repacking, load_drafter, load_target

    repack = keeps_repacking(check_gguf(cut_qwen_target).weight_types)
    assert not repack
    target = load_target(cut_qwen_target, RunOptions(n_ctx=1024, kv_type="bf16", repack=repack))
    drafter = load_drafter(cut_qwen_target, RunOptions(n_ctx=1024, kv_type="q4_0"))
    try:
        tokens = target.tokenizer.tokenize(CHAT_PROMPTS[4] * 4, add_special=False, parse_special=False)[:100]
        results = check_batch_invariance(target, drafter, tokens)
    finally:
        drafter.close()
        target.close()
    for result in results:
        assert result.max_abs_diff == 0.0 and result.argmax_differences == 0, result


CHAIN_AGAINST_ONE_AT_A_TIME = """
import sys
import numpy as np
from pathlib import Path
from edge.invariance import sequential_logits
from edge.offload.tuning import timing_chain
from edge.runtimes.llama_cpp import RunOptions, load_target
target = load_target(Path(sys.argv[1]), RunOptions(n_ctx=512, kv_type="bf16", repack=sys.argv[2] == "1"))
tokens = target.tokenizer.tokenize(sys.argv[3], add_special=False, parse_special=False)[:48]
prefix, rest = tokens[:32], tokens[32:]
one_at_a_time = sequential_logits(target, prefix, rest)
target.truncate(0)
target.prefill(prefix)
chain = timing_chain(rest[0], len(rest))
chain.tokens[:] = rest
print(float(np.abs(target.verify(chain) - one_at_a_time).max()))
"""


@pytest.mark.parametrize(("switches", "repack", "exact"), [
    ({"GGML_CPU_TILED_MM": "0"}, "0", True),  # the dot-product kernels at every size (a target in RAM)
    ({"GGML_CPU_TILED_MM_FORCE": "1"}, "0", True),  # the tiled kernel at every size (a streamed target)
    ({"GGML_CPU_TILED_MM_FORCE": "0"}, "0", False),  # stock llama.cpp (said so): the tiled kernel from 8 tokens
    ({"GGML_CPU_TILED_MM": "0"}, "1", False),  # repacked Q4_K: a GEMM from 4 tokens
])
def test_the_kernel_switches_are_what_keeps_k_quants_exact(cut_qwen_target: Path, switches: dict[str, str],
                                                          repack: str, exact: bool) -> None:
    """The cause, shown: a 16-token chain against one token a pass, in a fresh process (ggml reads its switches
    once). Stock settings, or repacked Q4_K weights, make the chain's logits differ; one kernel at every batch size
    and no repacking make them equal."""
    import os
    import subprocess
    import sys

    from edge.runtimes.llama_cpp._native import USE_EXTRA_BUFFERS

    if repack == "1" and not USE_EXTRA_BUFFERS:
        pytest.skip("llama.cpp repacks no weights on this CPU (AMX: its repacked buffers crash on a batch)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_CPU_TILED")} | switches
    run = subprocess.run([sys.executable, "-c", CHAIN_AGAINST_ONE_AT_A_TIME, str(cut_qwen_target), repack,
                          CHAT_PROMPTS[4] * 4], capture_output=True, text=True, env=env, cwd=REPO, check=True)
    difference = float(run.stdout.split()[-1])
    assert (difference == 0.0) == exact, difference
