"""The ONNX runtime on real models: the builder's graph against llama.cpp, the int4 drafter's losslessness,
its commit bookkeeping, and the QuantSpec target's batch invariance."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from edge.models.opening import materialize
from edge.models.pair import Pair
from edge.models.registry import load_registry
from edge.quant.vocab import count_tokens, select
from edge.runtimes.llama_cpp._native import Batch, Context, Model, quantize
from edge.runtimes.onnx import OnnxOptions, load_drafter, load_quantspec
from edge.runtimes.onnx.arch import GGUFWeights
from edge.runtimes.onnx.graph import GraphOptions, build_graph
from edge.runtimes.onnx.session import DecoderSession

from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.invariance import compare
from edge.tree import TokenTree
from tests.conftest import REPO, GreedyReplies, prompt_tokens, prompts_for

TEXT = (REPO / "docs" / "lossless.md").read_text()


def _spec(name: str):
    return load_registry().pair(name)


@pytest.mark.parametrize("weights", ["f32", "int4"])
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_reference_graph_matches_llama_cpp(name: str, weights: str, tmp_path: Path) -> None:
    """Full head, fp32 KV. fp32 weights: top-1 equals llama.cpp's on the same dequantized weights. int4 (the
    drafter's MatMulNBits, int8 compute): the file's own blocks (Q4_1; Q4_K, Q5_0, Q6_K, Q8_0) kept exactly, so top-1
    equals llama.cpp's on the file itself nearly everywhere."""
    source = materialize(_spec(name).target, print)
    if weights == "f32":
        f32 = tmp_path / "model.f32.gguf"  # llama.cpp runs the very weights the builder dequantizes
        quantize(source, f32, "f32")
    model = Model(f32 if weights == "f32" else source)
    tokens = model.tokenize(TEXT, True, False)[:256]
    n = len(tokens)
    ctx = Context(model, 512, n_batch=n, kv_type="f32", flash_attn=False, n_outputs=n)
    batch = Batch(n)
    batch.fill(tokens, 0, outputs=True)
    ctx.decode(batch)
    expected = ctx.logits(n).argmax(axis=1)
    ctx.close()

    arch = GGUFWeights(source).arch
    path = build_graph(source, GraphOptions(weights=weights, kv="f32", outputs="logits"), tmp_path / "ref.onnx")
    session = DecoderSession(path, threads=2)
    positions = np.arange(n)
    mask = np.where(np.tri(n, dtype=bool), np.float32(0), np.float32(-np.inf))
    far = positions[:, None] - positions[None, :] >= max(arch.swa_window, n + 1)
    empty = np.zeros((0, arch.n_layers, arch.n_kv_heads, arch.head_dim), np.float32)
    out = session.run({"input_ids": np.array(tokens), "positions": positions, "mask": mask,
                       "mask_swa": np.where(far, np.float32(-np.inf), mask), "output_rows": positions,
                       "k_win": empty, "v_win": empty, "k_tree": empty, "v_tree": empty})
    agree = float((out["logits"].argmax(axis=1) == expected).mean())
    print(f"{name} {weights}: top-1 agreement with llama.cpp {agree:.3f}")
    assert agree >= (0.99 if weights == "f32" else 0.95), f"top-1 agreement {agree:.3f} on {n} positions"
    # the second half again, reading the first half's keys and values as the cached past
    half = n // 2
    rows = np.arange(n - half)
    second = session.run({"input_ids": np.array(tokens[half:]), "positions": positions[half:], "mask": mask[half:],
                          "mask_swa": np.where(far, np.float32(-np.inf), mask)[half:], "output_rows": rows,
                          "k_win": out["k_new"][:half], "v_win": out["v_new"][:half], "k_tree": empty,
                          "v_tree": empty})
    np.testing.assert_allclose(second["logits"], out["logits"][half:], atol=1e-3, rtol=1e-3)


def _trimmed_head(pair: Pair, size: int, greedy: GreedyReplies) -> np.ndarray:
    """A frequency-ranked head from the target's own greedy completions of the text prompts."""
    sequences = [greedy(pair, prompt_tokens(pair, text), 32) for text in prompts_for(pair)[:4]]
    counts = count_tokens(sequences, pair.target.n_vocab)
    return select(counts, size, pair.target.model.special().ids)


def _onnx_drafter(pair: Pair, head: np.ndarray | None = None):
    model = replace(_spec(pair.name).drafter, runtime="onnx", vocab=None)  # models.toml's, not the fixture's
    drafter_file = materialize(model, print)
    return load_drafter(drafter_file, OnnxOptions(threads=2, n_ctx=pair.spec.ctx + 256), head)


@pytest.mark.parametrize("vocab", [None, 16384])
def test_onnx_drafter_is_lossless(pair: Pair, vocab: int | None, greedy: GreedyReplies) -> None:
    """int4 weights, 4-bit KV, full or trimmed head: greedy speculation == the target's plain greedy output."""
    drafter = _onnx_drafter(pair, None if vocab is None else _trimmed_head(pair, vocab, greedy))
    # without the extension passes past max_steps, as in test_lossless.py: they only add drafting time here
    grow = replace(GrowConfig.for_budget(64), extend_prob=None)
    tree = Decoder(pair.target, drafter, grow)
    tree.reset()
    passes = 0
    for text in prompts_for(pair)[:3]:
        tokens = prompt_tokens(pair, text)
        tree.load(tokens)
        steps = list(tree.generate(48))
        passes += steps[-1].stats.target_passes
        assert [s.token for s in steps if s.token is not None] == greedy(pair, tokens, 48), text
        # the drafter's cache holds exactly the committed text but the root
        assert drafter.history + drafter.pending == tree.context[: len(drafter.history) + len(drafter.pending)]
    assert passes < 3 * 48 / 2, "the drafter should accept well over one token per pass"
    tree.reset()


def test_onnx_drafter_commit_keeps_the_accepted_path(smollm2: Pair) -> None:
    drafter = _onnx_drafter(smollm2)
    tokens = prompt_tokens(smollm2, prompts_for(smollm2)[0])
    drafter.prefill(tokens[:-1])
    held = drafter.kv.n_tokens
    from edge.grow import grow

    tree, _ = grow(drafter, tokens[-1], GrowConfig.for_budget(32))
    leaf = int(tree.leaves()[np.argmax(tree.depth[tree.leaves()])])
    path = [leaf]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    path.reverse()
    drafter.commit(tree, path)
    assert drafter.kv.n_tokens + len(drafter.pending) == held + len(path)
    assert drafter.history[held:] + drafter.pending == tree.path_tokens(path)
    assert drafter.n_tree == 0 and (drafter.node_slot < 0).all()


def test_a_node_drafts_what_a_chain_drafts_there_whatever_its_siblings(smollm2: Pair) -> None:
    """A node's pass reads its ancestors' keys alone: with a sibling already run (its slot masked for the node), the
    node's children and log-probs are bit-identical to the same node's in a chain, so a tree's top path is the
    chain's token for token."""
    drafter = _onnx_drafter(smollm2)
    tokens = prompt_tokens(smollm2, prompts_for(smollm2)[0])

    def tree_of(children: list[int]) -> TokenTree:
        n = 1 + len(children)
        return TokenTree(np.array([tokens[-1], *children], np.int32), np.array([-1] + [0] * len(children), np.int32),
                         np.array([0] + [1] * len(children), np.int32), np.zeros(n, np.float32))

    drafter.prefill(tokens[:-1])
    ids, _ = drafter.expand(tree_of([]), np.array([0]), 4)
    top, runner_up = int(ids[0, 0]), int(ids[0, 1])
    drafter.expand(tree_of([runner_up, top]), np.array([1]), 4)  # the sibling runs first: its slot comes before
    in_tree = drafter.expand(tree_of([runner_up, top]), np.array([2]), 4)
    drafter.truncate(0)
    drafter.prefill(tokens[:-1])
    drafter.expand(tree_of([]), np.array([0]), 4)
    in_chain = drafter.expand(tree_of([top]), np.array([1]), 4)
    assert (in_tree[0] == in_chain[0]).all() and (in_tree[1] == in_chain[1]).all()
    drafter.truncate(0)


def test_trimmed_head_drafts_the_contexts_tokens_it_lacks(smollm2: Pair,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A word the trimmed head does not keep is still drafted once the context holds it (extra_ids)."""
    model = smollm2.target.model
    tokens = model.tokenize("The cat sat on the mat. The dog sat on the rug. The cat sat on the", True, False)
    full = _onnx_drafter(smollm2)
    full.prefill(tokens[:-1])
    ids, _ = full.expand(TokenTree.root(tokens[-1]), np.array([0]), 4)
    top = int(ids[0, 0])
    assert model.token_bytes(top) == b" cat"
    head = np.array(sorted((set(range(4096)) | model.special().ids) - {top}), np.int32)
    drafter = _onnx_drafter(smollm2, head)
    drafter.prefill(tokens[:-1])
    outside = [t for t in tokens[:-1] if t not in set(head.tolist())]
    assert list(drafter.extra) == list(dict.fromkeys(reversed(outside)))[::-1]  # each once, by its last time
    assert top in drafter.extra
    ids, log_probs = drafter.expand(TokenTree.root(tokens[-1]), np.array([0]), 4)
    assert ids[0, 0] == top and np.all(np.diff(log_probs[0]) <= 0)
    assert set(ids[0].tolist()) <= set(head.tolist()) | set(drafter.extra)
    # Cut back to before the context said " cat": the head cannot propose it again.
    drafter.truncate(tokens.index(top))
    assert top not in drafter.extra
    drafter.truncate(0)
    assert not drafter.extra
    other = model.tokenize("The dog sat on the rug. The cat sat on the", True, False)[:-1]
    drafter.prefill(other)
    assert top in drafter.extra
    drafter.truncate(0)
    drafter.prefill(model.tokenize("A dog sat on the", True, False)[:-1])
    ids, _ = drafter.expand(TokenTree.root(tokens[-1]), np.array([0]), 8)
    assert top not in ids[0]
    # Only the newest MAX_EXTRA are kept.
    from edge.runtimes.onnx import models

    monkeypatch.setattr(models, "MAX_EXTRA", 2)
    drafter.truncate(0)
    drafter.prefill(tokens[:-1])
    assert list(drafter.extra) == list(dict.fromkeys(reversed(outside)))[::-1][-2:]


@pytest.fixture(scope="module")
def quantspec(smollm2: Pair):
    spec = _spec("smollm2-135m")
    source = materialize(spec.target, print)
    drafter_file = materialize(spec.drafter, print)
    model = smollm2.target.model
    return load_quantspec(source, drafter_file, OnnxOptions(threads=2, n_ctx=1024), model)


def test_quantspec_cache_is_shared_and_at_most_8_5_bits(quantspec) -> None:
    target, drafter = quantspec
    assert drafter.kv is target.kv and drafter.shared
    kv = target.kv
    bits = 8 + (16 / kv.group + 16 / kv.group + 16 / kv.value_group + 16 / kv.value_group) / 2
    assert kv.bits == 8 and bits <= 8.5


@pytest.mark.parametrize("prefix", [0, 250], ids=["short prompt", "crossing a quantization point"])
def test_quantspec_target_is_batch_invariant(smollm2: Pair, quantspec, prefix: int) -> None:
    """A branched tree verified in one pass gives the logits of one-token-at-a-time decoding, bit for bit; at
    250 committed tokens its deeper nodes lie past the point (256) where plain decoding quantizes a group."""
    target, _ = quantspec
    tokens = prompt_tokens(smollm2, prompts_for(smollm2)[0])
    if prefix:
        tokens = (tokens * (prefix // len(tokens) + 1))[:prefix] + tokens[-1:]
    parents = [-1, *range(12), *range(12)]  # a chain of 12 with a second child on every chain node
    depth = [0, *range(1, 13), *range(1, 13)]
    tree = TokenTree(np.array([tokens[-1], *range(100, 124)], np.int32), np.array(parents, np.int32),
                     np.array(depth, np.int32), np.zeros(len(parents), np.float32))
    checked, worst, flips = compare(target, tree, tokens[:-1], cuts=False)  # a cut group runs again as a batch
    assert checked == len(tree) and worst == 0.0 and flips == 0


def test_a_graph_built_a_chunk_at_a_time_is_the_graph_built_whole(tmp_path: Path, monkeypatch) -> None:
    """The build writes each weight to the .data file as it is packed, and packs a table a few rows at a time (its
    memory: one chunk and the packed table, not the vocabulary in float32). Q4_1 (SmolLM2) keeps its own blocks with
    the offsets as a residual, across chunks of rows and a trimmed head's ids in their own order: byte for byte what
    one packing of every table whole, kept in the proto and saved by onnx, gives."""
    import onnx
    from edge.runtimes.onnx import graph

    source = materialize(_spec("smollm2-135m").target, print)
    weights = GGUFWeights(source)
    head = np.random.default_rng(0).permutation(weights.arch.n_vocab)[:3000]
    options = GraphOptions(weights="int4", head_ids=head)
    monkeypatch.setattr(graph, "ROWS_BYTES", 1 << 40)
    whole = graph.DecoderBuilder(weights, options).build()
    onnx.save_model(whole, str(tmp_path / "whole.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="chunked.onnx.data", size_threshold=1024)
    saved = (tmp_path / "whole.onnx").read_bytes(), (tmp_path / "chunked.onnx.data").read_bytes()
    monkeypatch.setattr(graph, "ROWS_BYTES", 1 << 16)  # some 28 rows of 576 weights a chunk
    path = build_graph(source, options, tmp_path / "chunked.onnx")
    assert path.read_bytes() == saved[0]
    assert Path(str(path) + ".data").read_bytes() == saved[1]


def test_a_build_the_memory_cannot_hold_is_refused_before_it_starts(tmp_path: Path, monkeypatch) -> None:
    from edge.offload import probe
    from edge.runtimes.onnx import prepare_graph

    from edge.errors import UserError

    source = materialize(_spec("smollm2-135m").target, print)
    monkeypatch.setattr(probe, "free_bytes", lambda: 50 << 20)
    with pytest.raises(UserError, match=r"needs about \d+ MiB of memory and only 50 MiB is free") as refused:
        prepare_graph(source, "drafter", None, print, tmp_path)
    assert "\n" not in str(refused.value)
    assert list(tmp_path.iterdir()) == []
