"""ONNX Runtime: the fast drafter (int4 weights, 4-bit KV, frequency-ranked head) and the QuantSpec target.

Graphs are built by edge-spec itself from GGUF weights (runtimes/onnx/graph.py) and cached beside the
prepared model files; docs/drafter.md says why each piece is built the way it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quant.kv import QuantSpecKV, value_group
from runtimes.onnx.arch import GGUFWeights, file_arch
from runtimes.onnx.graph import GraphOptions, build_graph
from runtimes.onnx.models import OnnxDrafter, OnnxTarget
from runtimes.onnx.session import PROVIDERS, DecoderSession, provider_name

__all__ = ["PROVIDERS", "OnnxDrafter", "OnnxOptions", "OnnxTarget", "graph_path", "load_drafter",
           "load_quantspec", "prepare_graph", "provider_name"]


@dataclass(frozen=True)
class OnnxOptions:
    provider: str = "cpu"
    threads: int | None = None
    n_ctx: int = 4096
    mem_reuse: bool = False  # onnxruntime's buffer-reuse planning (off: a faster start; benchmarks/session_start.py)
    graph_dir: Path | None = None  # where graphs are cached; None: beside the GGUF (a file in edge-spec's own cache)
    int4_block: int = 0  # a drafter's matmuls requantized into int4 blocks of this many weights (GraphOptions)


GRAPH_VERSION = 7  # bumped whenever graph.py builds a different graph: cached graphs of older versions are not reused


def _variant(role: str, head_ids: np.ndarray | None, int4_block: int = 0) -> str:
    # the ids' hash: a vocabulary prepared again (other prompts, other ranking) must not reuse an old graph
    head = "full" if head_ids is None else f"vocab{len(head_ids)}-{_digest(head_ids)}"
    weights = f"int4b{int4_block}" if int4_block else "int4"
    kind = {"drafter": f"{weights}-{head}-kv4", "shared-drafter": f"{weights}-{head}-kv8d",
            "target": "int8-full-kv8-f64"}[role]
    return f"{kind}.v{GRAPH_VERSION}"


def _digest(ids: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:8]


def graph_path(gguf: Path, role: str, head_ids: np.ndarray | None = None, folder: Path | None = None,
               int4_block: int = 0) -> Path:
    """The cached graph for a GGUF file and a role: beside the file (one in edge-spec's cache), or in `folder` (a
    user's own file, whose folder is not ours to write in), named for the file's path, size and time."""
    variant = _variant(role, head_ids, int4_block)
    if folder is None:
        return gguf.with_name(f"{gguf.stem}.{variant}.onnx")
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return folder / f"{gguf.stem}-{key}.{variant}.onnx"


def _options(role: str, arch, head_ids: np.ndarray | None, int4_block: int = 0) -> GraphOptions:
    vg = value_group(arch.n_kv_heads, arch.head_dim)
    if role == "target":  # int8 weights, full head, full reader of the shared hierarchical cache, logits out
        return GraphOptions(weights="int8", kv="hier8", kv_reader="full", kv_value_group=vg, outputs="logits",
                            attention="f64")
    kv = "upper4" if role == "drafter" else "hier8"
    return GraphOptions(weights="int4", head_ids=head_ids, kv=kv, kv_reader="draft", kv_value_group=vg,
                        int4_block=int4_block)


def prepare_graph(gguf: Path, role: str, head_ids: np.ndarray | None = None, report=None,
                  folder: Path | None = None, int4_block: int = 0) -> Path:
    """Builds (once) the graph for `role` in 'drafter', 'shared-drafter', 'target'; returns its path."""
    dest = graph_path(gguf, role, head_ids, folder, int4_block)
    if dest.exists() and Path(str(dest) + ".data").exists():
        return dest
    if report:
        report(f"building {dest.name} (ONNX graph from {gguf.name})")
    weights = GGUFWeights(gguf)
    tmp_dir = dest.with_name(dest.name + f".tmp-{os.getpid()}")  # a killed build's is cleaned: models.cache.clean_stale
    tmp_dir.mkdir(parents=True, exist_ok=True)
    try:
        built = build_graph(gguf, _options(role, weights.arch, head_ids, int4_block), tmp_dir / dest.name)
        os.replace(str(built) + ".data", str(dest) + ".data")  # the weights first: a graph is never half there
        os.replace(built, dest)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return dest


def load_drafter(gguf: Path, options: OnnxOptions, head_ids: np.ndarray | None = None, report=None) -> OnnxDrafter:
    """The drafter with its own 4-bit KV cache."""
    arch = file_arch(gguf)
    session = DecoderSession(prepare_graph(gguf, "drafter", head_ids, report, options.graph_dir, options.int4_block),
                             options.provider, options.threads, options.mem_reuse)
    kv = QuantSpecKV(arch.n_layers, arch.n_kv_heads, arch.head_dim, options.n_ctx, bits=4,
                     value_group=value_group(arch.n_kv_heads, arch.head_dim))
    drafter = OnnxDrafter(session, arch, kv)
    if head_ids is not None:
        drafter.trim_head(head_ids, arch.n_vocab)
    return drafter


def load_quantspec(target_gguf: Path, drafter_gguf: Path, options: OnnxOptions, tokenizer,
                   stop_tokens: frozenset[int], head_ids: np.ndarray | None = None,
                   report=None) -> tuple[OnnxTarget, OnnxDrafter]:
    """A self-speculative pair on one hierarchical cache: the target writes it, the drafter reads nibbles."""
    arch = file_arch(target_gguf)
    kv = QuantSpecKV(arch.n_layers, arch.n_kv_heads, arch.head_dim, options.n_ctx, bits=8,
                     value_group=value_group(arch.n_kv_heads, arch.head_dim))
    target_session = DecoderSession(prepare_graph(target_gguf, "target", None, report, options.graph_dir),
                                    options.provider, options.threads, options.mem_reuse)
    drafter_session = DecoderSession(prepare_graph(drafter_gguf, "shared-drafter", head_ids, report,
                                                   options.graph_dir), options.provider, options.threads,
                                     options.mem_reuse)
    target = OnnxTarget(target_session, arch, kv, tokenizer, stop_tokens, options.n_ctx)
    drafter = OnnxDrafter(drafter_session, file_arch(drafter_gguf), kv, shared=True)
    if head_ids is not None:
        drafter.trim_head(head_ids, arch.n_vocab)
    return target, drafter
