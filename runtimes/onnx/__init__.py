"""ONNX Runtime: the fast drafter (int4 weights, 4-bit KV, frequency-ranked head) and the QuantSpec target.

Graphs are built by edge-spec itself from GGUF weights (runtimes/onnx/graph.py) and cached beside the
prepared model files; docs/drafter.md says why each piece is built the way it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from glob import escape as glob_escape
from pathlib import Path

import numpy as np
from edge.quant.kv import QuantSpecKV, value_group
from edge.runtimes import ModelOptions, Report
from edge.runtimes.onnx.arch import GGUFWeights, file_arch
from edge.runtimes.onnx.graph import GraphOptions, build_bytes, build_graph
from edge.runtimes.onnx.models import MAX_TREE, OnnxDrafter, OnnxTarget
from edge.runtimes.onnx.session import PROVIDERS, open_session, provider_name

from edge.errors import UserError

__all__ = ["PROVIDERS", "OnnxDrafter", "OnnxOptions", "OnnxTarget", "graph_path", "load_drafter",
           "load_quantspec", "lossless_guarantee", "open_drafter", "open_session", "open_shared", "open_target",
           "prepare_graph", "provider_name"]


@dataclass(frozen=True)
class OnnxOptions:
    provider: str = "cpu"
    threads: int | None = None
    n_ctx: int = 4096
    mem_reuse: bool = False  # onnxruntime's buffer-reuse planning (off: a faster start; benchmarks/session_start.py)
    graph_dir: Path | None = None  # where graphs are cached; None: beside the GGUF (a file in edge-spec's own cache)
    reserve: Callable[[Path, int], None] | None = field(default=None, compare=False)  # ModelOptions.reserve
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


def derived_bytes(path: Path, role: str) -> int:
    """The bytes of the largest drafter graph of this GRAPH_VERSION built from the GGUF `path` beside it (its .onnx and
    its weights' .onnx.data; any head and block size, as _variant names them), 0 where none is, or for another role.
    The plan counts a drafter at it: Gemma-3-270M's graph is 486 MB against its 253 MB GGUF (its 262k-row embedding at
    8 bits beside a 4-bit head)."""
    if role != "drafter":
        return 0
    sizes = []
    for graph in path.parent.glob(f"{glob_escape(path.stem)}.*-kv4.v{GRAPH_VERSION}.onnx"):
        data = Path(f"{graph}.data")
        if data.is_file():
            sizes.append(graph.stat().st_size + data.stat().st_size)
    return max(sizes, default=0)


def _options(role: str, arch, head_ids: np.ndarray | None, int4_block: int = 0) -> GraphOptions:
    vg = value_group(arch.n_kv_heads, arch.head_dim)
    if role == "target":  # int8 weights, full head, full reader of the shared hierarchical cache, logits out
        return GraphOptions(weights="int8", kv="hier8", kv_reader="full", kv_value_group=vg, outputs="logits",
                            attention="f64")
    kv = "upper4" if role == "drafter" else "hier8"
    return GraphOptions(weights="int4", head_ids=head_ids, kv=kv, kv_reader="draft", kv_value_group=vg,
                        int4_block=int4_block)


def prepare_graph(gguf: Path, role: str, head_ids: np.ndarray | None = None, report=None,
                  folder: Path | None = None, reserve: Callable[[Path, int], None] | None = None,
                  int4_block: int = 0) -> Path:
    """Builds (once) the graph for `role` in 'drafter', 'shared-drafter', 'target'; returns its path. `reserve` hears
    of the space a build may take first (its weights take up to twice the GGUF file)."""
    dest = graph_path(gguf, role, head_ids, folder, int4_block)
    if dest.exists() and Path(str(dest) + ".data").exists():
        return dest
    if reserve is not None:
        reserve(dest, 2 * gguf.stat().st_size)
    weights = GGUFWeights(gguf)
    _check_memory(dest, build_bytes(weights))
    if report:
        report(f"building {dest.name} (ONNX graph from {gguf.name})")
    tmp_dir = dest.with_name(dest.name + f".tmp-{os.getpid()}")  # a killed build's is cleaned: models.cache.clean_stale
    tmp_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        built = build_graph(gguf, _options(role, weights.arch, head_ids, int4_block), tmp_dir / dest.name)
        os.replace(str(built) + ".data", str(dest) + ".data")  # the weights first: a graph is never half there
        os.replace(built, dest)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    if report:
        report(f"built {dest.name} in {time.perf_counter() - started:.1f} s (once: kept in the cache)")
    return dest


def _check_memory(dest: Path, need: int) -> None:
    """Refuses a build the memory cannot hold, in one line and before it starts, rather than be killed halfway."""
    from edge.offload.probe import free_bytes, memory_limit

    free = free_bytes()
    if free is None or need <= free:
        return
    where = "under this process's memory limit" if memory_limit() is not None else "in RAM"
    raise UserError(f"building {dest.name} needs about {need >> 20} MiB of memory and only {free >> 20} MiB is free "
                    f"{where}: close other programs or raise the limit, then run it again (the build happens once)")


def load_drafter(gguf: Path, options: OnnxOptions, head_ids: np.ndarray | None = None, report=None) -> OnnxDrafter:
    """The drafter with its own 4-bit KV cache."""
    arch = file_arch(gguf)
    session = open_session(prepare_graph(gguf, "drafter", head_ids, report, options.graph_dir, options.reserve,
                                         options.int4_block),
                           options.provider, options.threads, options.mem_reuse)
    kv = QuantSpecKV(arch.n_layers, arch.n_kv_heads, arch.head_dim, options.n_ctx, bits=4,
                     value_group=value_group(arch.n_kv_heads, arch.head_dim))
    drafter = OnnxDrafter(session, arch, kv, gguf)
    if head_ids is not None:
        drafter.trim_head(head_ids, arch.n_vocab)
    return drafter


def load_quantspec(target_gguf: Path, drafter_gguf: Path, options: OnnxOptions, tokenizer,
                   head_ids: np.ndarray | None = None, report=None) -> tuple[OnnxTarget, OnnxDrafter]:
    """A self-speculative pair on one hierarchical cache: the target writes it, the drafter reads nibbles.
    `tokenizer`: the target file's vocabulary (runtimes.llama_cpp.tokenizer), with its special tokens."""
    arch = file_arch(target_gguf)
    kv = QuantSpecKV(arch.n_layers, arch.n_kv_heads, arch.head_dim, options.n_ctx, bits=8,
                     value_group=value_group(arch.n_kv_heads, arch.head_dim))
    target_session = open_session(prepare_graph(target_gguf, "target", None, report, options.graph_dir,
                                                options.reserve), options.provider, options.threads,
                                  options.mem_reuse)
    drafter_session = open_session(prepare_graph(drafter_gguf, "shared-drafter", head_ids, report,
                                                 options.graph_dir, options.reserve), options.provider,
                                   options.threads, options.mem_reuse)
    target = OnnxTarget(target_session, arch, kv, tokenizer, options.n_ctx, target_gguf)
    drafter = OnnxDrafter(drafter_session, file_arch(drafter_gguf), kv, drafter_gguf, shared=True)
    if head_ids is not None:
        drafter.trim_head(head_ids, arch.n_vocab)
    return target, drafter


def _onnx_options(options: ModelOptions) -> OnnxOptions:
    return OnnxOptions(provider=options.provider, threads=options.threads, n_ctx=options.n_ctx,
                       graph_dir=options.derived_dir, reserve=options.reserve, int4_block=options.int4_block)


def open_target(path: Path, options: ModelOptions, max_tree: int) -> OnnxTarget:
    raise NotImplementedError("an onnx target shares its KV cache with its drafter: open_shared opens the two")


def open_drafter(path: Path, options: ModelOptions, max_tree: int, head_ids: np.ndarray | None = None,
                 report: Report | None = None) -> OnnxDrafter:
    """The Runtime interface's drafter; its room (MAX_EXPAND expansions a round) covers any tree. Its 4-bit cache
    holds a tree's slots past the context's tokens."""
    return load_drafter(path, replace(_onnx_options(options), n_ctx=options.n_ctx + MAX_TREE), head_ids, report)


def open_shared(target: Path, drafter: Path, options: ModelOptions, head_ids: np.ndarray | None = None,
                report: Report | None = None) -> tuple[OnnxTarget, OnnxDrafter]:
    """QuantSpec: the target and its drafter on one hierarchical KV cache."""
    from edge.runtimes import tools

    return load_quantspec(target, drafter, _onnx_options(options), tools().tokenizer(target), head_ids, report)


def lossless_guarantee(weight_types: frozenset[str], kv_type: str, fix: str) -> str | None:
    """The target graph computes attention in float64 and its int8 matmuls in integers (graph.py): a token's logits
    are the same alone and in any batch (tests/test_onnx.py checks it)."""
    return None
