"""What a GGUF model's graph needs: its hyperparameters and its weights as float32, read with `gguf`.

Three architectures: `llama` (SmolLM2, Llama 3.x: dense decoders, RoPE on adjacent pairs), `qwen2` (Qwen2 and
Qwen2.5: llama's layout plus q/k/v biases, NEOX RoPE) and `gemma3` (sliding-window layers, QK-norm, sandwich norms,
GELU, scaled embeddings). The conventions follow llama.cpp's, so a graph built from these weights computes what
llama.cpp computes on the same file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from edge.quant.grid import BlockGrid, block_grid
from edge.runtimes import TRAITS

from edge.errors import UserError

ARCHITECTURES = tuple(sorted(TRAITS["onnx"].architectures))  # what runtimes' traits say the builder covers
# llama.cpp's llama_model_rope_type: these rotate the pairs (i, i + d/2) of a head (LLAMA_ROPE_TYPE_NEOX), llama
# the adjacent pairs (2i, 2i + 1) (LLAMA_ROPE_TYPE_NORM)
NEOX_ROPE = ("qwen2", "gemma3")
# tensors llama.cpp reads in these architectures that the builder has no op for
UNSUPPORTED_TENSORS = {"blk.0.attn_qkv.weight": "a fused q+k+v projection", "output.bias": "a bias on the head"}


@dataclass(frozen=True)
class Arch:
    name: str  # one of ARCHITECTURES
    n_layers: int
    n_embd: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_ff: int
    n_vocab: int
    rms_eps: float
    rope_base: float
    rope_scale: float  # multiplies positions (llama.cpp's freq_scale) on full-attention layers
    rope_neox: bool  # rotate halves (NEOX) rather than adjacent pairs (llama.cpp's NORM)
    attn_scale: float
    embed_scale: float  # gemma multiplies embeddings by sqrt(n_embd)
    swa_window: int  # 0: no sliding-window layers
    swa_layers: tuple[bool, ...]
    rope_base_swa: float
    n_ctx_train: int

    @property
    def has_swa(self) -> bool:
        return any(self.swa_layers)

    @property
    def group(self) -> int:  # query heads per KV head
        return self.n_heads // self.n_kv_heads


class GGUFWeights:
    """Lazily dequantized float32 tensors of one GGUF file, in [out_features, in_features] layout."""

    def __init__(self, path: Path):
        from edge.runtimes.gguf_file import open_reader

        self.path = path
        self.reader = open_reader(path)  # skips the vocabulary's strings: nothing here reads them
        self.tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        return self.rows(name, slice(None))

    def rows(self, name: str, rows: slice | np.ndarray) -> np.ndarray:
        """Some rows of a 2-D tensor (a range, or ids in any order) dequantized: only their blocks are read, so a
        152k-row table never stands whole in memory as float32."""
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        return np.ascontiguousarray(dequantize(np.asarray(tensor.data[rows]), tensor.tensor_type), dtype=np.float32)

    def n_rows(self, name: str) -> int:
        return int(self.tensors[name].data.shape[0])

    def row_floats(self, name: str) -> int:
        """Weights a row holds (the tensor's innermost dimension)."""
        return int(self.tensors[name].shape[0])

    def grid(self, name: str, rows: slice | np.ndarray = slice(None)) -> BlockGrid | None:
        """The tensor's own quantization grid (quant/grid.py) over `rows`, None for float tensors and other types."""
        tensor = self.tensors[name]
        return block_grid(np.asarray(tensor.data[rows]), tensor.tensor_type.name)

    @cached_property
    def arch(self) -> Arch:
        return read_arch(self)


class _HeaderOnly:
    """What read_arch reads of a file (its path, header keys, the embedding's shape), from the cached header."""

    def __init__(self, path: Path):
        from edge.runtimes.gguf_file import gguf_header

        self.path = path
        self.header = gguf_header(path)
        self.tensors = {t.name: t for t in self.header.tensors}

    def field(self, key: str, default=None):
        return self.header.field(key, default)


def file_arch(path: Path) -> Arch:
    """A GGUF file's architecture from its header alone: what a drafter needs to load once its graph is built."""
    return read_arch(_HeaderOnly(path))


def read_arch(weights: GGUFWeights | _HeaderOnly) -> Arch:
    name = weights.field("general.architecture")
    if name not in ARCHITECTURES:
        raise UserError(f"{weights.path.name}: architecture {name!r} has no ONNX graph builder "
                        f"(supported: {', '.join(ARCHITECTURES)}); use the llama_cpp drafter runtime")

    for tensor, what in UNSUPPORTED_TENSORS.items():
        if tensor in weights.tensors:
            raise UserError(f"{weights.path.name}: {what} ({tensor}) has no ONNX graph builder; use the llama_cpp "
                            "drafter runtime")

    def key(suffix: str, default=None):
        value = weights.field(f"{name}.{suffix}", default)
        if value is None:
            raise UserError(f"{weights.path.name}: GGUF key {name}.{suffix} is missing")
        return value

    n_layers, n_embd, n_heads = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
    n_kv_heads = int(key("attention.head_count_kv", n_heads))
    head_dim = int(key("attention.key_length", n_embd // n_heads))
    embd = weights.tensors["token_embd.weight"]
    n_vocab = int(embd.shape[1])
    swa_window, swa_layers = 0, (False,) * n_layers
    if name == "gemma3":
        swa_window = int(key("attention.sliding_window", 0))
        if swa_window:  # llama.cpp's pattern: every 6th layer attends globally
            swa_layers = tuple(i % 6 < 5 for i in range(n_layers))
        # llama.cpp: 27B scales queries by n_embd / n_heads, the others by the head size
        attn_scale = 1.0 / math.sqrt(n_embd / n_heads if n_layers == 62 else head_dim)
        embed_scale = math.sqrt(n_embd)
    else:
        attn_scale, embed_scale = 1.0 / math.sqrt(head_dim), 1.0
    scaling = weights.field(f"{name}.rope.scaling.type")
    factor = float(weights.field(f"{name}.rope.scaling.factor", 1.0) or 1.0)
    if scaling not in (None, "none", "linear") and factor != 1.0:
        raise UserError(f"{weights.path.name}: rope scaling {scaling!r} is not supported by the ONNX builder")
    return Arch(
        name=name, n_layers=n_layers, n_embd=n_embd, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        n_ff=int(key("feed_forward_length")), n_vocab=n_vocab, rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_base=float(key("rope.freq_base", 10000.0)), rope_scale=1.0 / factor, rope_neox=name in NEOX_ROPE,
        attn_scale=attn_scale, embed_scale=embed_scale, swa_window=swa_window, swa_layers=swa_layers,
        rope_base_swa=float(weights.field(f"{name}.rope.freq_base_swa", 10000.0)),
        n_ctx_train=int(key("context_length", 4096)),
    )
