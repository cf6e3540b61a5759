"""benchmarks/synthetic_gguf.py: a cut-down 70B-shaped file with random weights that llama.cpp loads and decodes and
whose header the plan reads; the full shapes' sizes; refusals (short disk, existing file) in one line."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
from edge.offload.plan import Shape
from edge.runtimes.gguf_file import check_gguf, gguf_header
from gguf import GGMLQuantizationType

from edge.tree import TokenTree

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("synthetic_gguf", REPO / "benchmarks" / "synthetic_gguf.py")
assert spec is not None and spec.loader is not None
synthetic = importlib.util.module_from_spec(spec)
sys.modules["synthetic_gguf"] = synthetic  # its dataclasses look their module up while it runs
spec.loader.exec_module(synthetic)


@pytest.fixture(scope="module")
def tokenizer_file() -> Path:
    return synthetic.default_tokenizer_file()  # SmolLM2-135M, the offline pair's target


def test_tiny_70b_loads_decodes_and_plans(tmp_path: Path, tokenizer_file: Path) -> None:
    from edge.runtimes.llama_cpp import RunOptions, load_target

    out = tmp_path / "tiny-70b.q4_0.gguf"
    shape = synthetic.resolve_shape("tiny-70b", None, 1)
    size, _ = synthetic.write_synthetic("tiny-70b", shape, "q4_0", out, tokenizer_file)
    assert size == out.stat().st_size < 12e6 and not (tmp_path / "tiny-70b.q4_0.gguf.partial").exists()

    planned = Shape.from_gguf(out)  # what `edge-spec plan` reads
    assert (planned.n_layers, planned.n_embd, planned.n_kv_heads, planned.head_dim) == (2, 128, 1, 128)
    scalars = gguf_header(out).scalars
    assert (scalars["llama.attention.head_count"], scalars["llama.feed_forward_length"]) == (1, 448)
    assert (scalars["llama.rope.freq_base"], scalars["llama.context_length"]) == (500000.0, 131072)
    assert "random weights" in scalars["general.name"]
    info, source = check_gguf(out), check_gguf(tokenizer_file)
    assert (info.vocab_digest, info.chat_template, info.eos_token_id) == (
        source.vocab_digest, source.chat_template, source.eos_token_id)  # SmolLM2's tokenizer, byte for byte
    assert info.weight_types == {"Q4_0"}

    target = load_target(out, RunOptions(n_ctx=64, kv_type="bf16"))
    try:
        target.prefill([1, 504, 3458])
        last, tokens = 28, []
        for _ in range(4):
            tree = TokenTree.root(last)
            logits = target.verify(tree)  # [1, n_vocab]
            assert logits.shape == (1, 49152) and np.isfinite(logits).all() and logits.std() > 0.1
            last = int(np.argmax(logits[0]))
            target.commit(tree, [0])
            tokens.append(last)
    finally:
        target.close()
    assert len(tokens) == 4


def test_full_shapes_have_the_published_parameter_counts() -> None:
    """With Llama 3.1's own vocabulary the layouts have the published parameter counts (rope_freqs is not a
    parameter); with SmolLM2's 49152 tokens the 70B's Q4_0 tensors are 38.96 GB."""
    q4_0 = GGMLQuantizationType.Q4_0
    llama70 = synthetic.SHAPES["llama3.1-70b"]

    def params(name: str) -> int:
        specs = synthetic.tensor_specs(synthetic.SHAPES[name], 128256, q4_0)
        return sum(int(np.prod(s.dims)) for s in specs if s.name != "rope_freqs.weight")

    assert (params("llama3.1-70b"), params("llama3.1-8b")) == (70_553_706_496, 8_030_261_248)
    assert round(synthetic.data_bytes(synthetic.tensor_specs(llama70, 49152, q4_0)) / 1e9, 2) == 38.96


def test_the_plan_streams_a_70b_shaped_file_from_the_ssd_on_24_gb(tmp_path: Path, tokenizer_file: Path) -> None:
    """The full 70B layout as a sparse file (its header and a hole: 2 MB on disk) is what `edge-spec plan` sizes:
    on a 24 GB machine 22.3 GB of its 38.7 GB of layers and head stay resident (while the context holds up to 512
    tokens: the KV cache takes room from them as it grows) and every pass reads the other 16.4 GB from the drive; with
    64 GB it fits in RAM."""
    from edge.models.registry import load_registry
    from edge.offload.machine import parse_machine
    from edge.offload.plan import plan_pair

    out = tmp_path / "llama3.1-70b.sparse.gguf"
    size, _ = synthetic.write_synthetic("llama3.1-70b", synthetic.SHAPES["llama3.1-70b"], "q4_0", out,
                                       tokenizer_file, sparse=True)
    assert size == out.stat().st_size > 38.9e9 and out.stat().st_blocks * 512 < 10e6
    pair = load_registry().pair("smollm2-135m")
    target, drafter = Shape.from_gguf(out), Shape.from_gguf(tokenizer_file)
    assert (target.n_layers, target.n_embd, target.n_kv_heads, target.head_dim) == (80, 8192, 8, 128)
    small = plan_pair(pair, target, drafter, parse_machine("ram=24G,disk=2GB/s,cores=2"))
    assert small.target.placement == "ssd" and round(target.streamed_bytes / 1e9, 1) == 38.7  # the table: looked up
    assert round(small.ssd_bytes / 1e9, 1) == 16.4 and small.ssd_bytes + small.target.resident_bytes == \
        target.streamed_bytes
    assert small.one_token.bound == "disk"
    assert plan_pair(pair, target, drafter, parse_machine("ram=64G,cores=2")).target.placement == "ram"


def test_refuses_when_the_disk_is_short(tmp_path: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * 10**9, 99 * 10**9, 10**9))
    out = tmp_path / "llama3.1-70b.q4_0.gguf"
    with pytest.raises(synthetic.Refused, match=r"not enough disk for .*: it needs 39\.96 GB \(the file and a 1\.00 GB "
                                                r"margin\), .* has 1\.00 GB free"):
        synthetic.write_synthetic("llama3.1-70b", synthetic.SHAPES["llama3.1-70b"], "q4_0", out, tokenizer_file)
    assert list(tmp_path.iterdir()) == []


def test_refuses_an_existing_file_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "exists.gguf"
    out.write_bytes(b"mine")
    run = subprocess.run([sys.executable, "benchmarks/synthetic_gguf.py", "--shape", "tiny-70b", "--out", str(out)],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert (run.returncode, run.stdout, run.stderr) == (1, "", f"error: {out} exists; pass --force to replace it\n")
    assert out.read_bytes() == b"mine"


def test_cuts_that_do_not_divide_are_refused() -> None:
    with pytest.raises(synthetic.Refused, match="--width-divisor 40 must divide"):
        synthetic.resolve_shape("qwen2.5-32b", 2, 40)
    with pytest.raises(synthetic.Refused, match=r"--layers must be 1\.\.80"):
        synthetic.resolve_shape("llama3.1-70b", 81, 1)
