"""Builds a decoder's ONNX graph from GGUF weights: the drafter (int4, 4-bit KV, trimmed head, top-k in the
graph), the QuantSpec target (int8, full head, ~8-bit KV reader) and a float32 reference graph for tests.

One run of the graph processes n new tokens against the cached ones. Inputs (T = Q + W + S + n):

    input_ids [n] int64, positions [n] int64
    mask [n, T] float32            additive (0 or -inf): which cached/new tokens each new token sees
    mask_swa [n, T] float32        the same with the sliding window applied (gemma3 only)
    output_rows [m] int64          rows whose head is computed (prefill needs only the last)
    top_k [1] int64                (topk outputs only)
    extra_ids [E] int64            (trimmed heads only) context tokens outside the kept vocabulary, scored too
    extra_mask [E] float32         0, or -inf for a padding entry (E >= 1)
    k_codes, k_scale, k_min        the quantized part (Q tokens), as quant.kv stores it   (quantized KV only)
    v_codes, v_scale, v_min
    k_win, v_win [W, L, kvh, d]    committed tokens in the FP16 window (float32 in the reference graph)
    k_tree, v_tree [S, L, kvh, d]  this round's earlier tree nodes
Outputs:
    k_new, v_new [n, L, kvh, d]    the new tokens' keys (after RoPE) and values
    logits [m, V']                 or  top_ids [m, k] (full-vocabulary ids) + top_log_probs [m, k] + top_logits [m, k]

Token-major caches ([tokens, layers, ...]) make every prefix a contiguous array, so Python passes views.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from edge.quant.grid import BlockGrid
from edge.quant.int4 import PackedWeight, StackedRows, pack_exact
from edge.runtimes.onnx.arch import GGUFWeights
from edge.runtimes.onnx.proto import GraphWriter
from onnx import TensorProto

NEG_INF = float("-inf")
ROWS_BYTES = 32 << 20  # float32 rows of a table dequantized at a time: a build holds a layer, not the vocabulary


@dataclass(frozen=True)
class GraphOptions:
    weights: str = "int4"  # "int4", "int8" (MatMulNBits) or "f32" (plain MatMul, the reference graph)
    block: int = 32  # quantization group of MatMulNBits
    # 0: a matmul keeps its file's own blocks (quant/grid.py: Q5_0, Q8_0 and Q6_K as 8-bit codes); N: every matmul
    # is requantized into blocks of N weights, 4-bit but for what the file stores at 8 bits or more (int4 weights)
    int4_block: int = 0
    accuracy_level: int = 4  # int8 compute in MatMulNBits: fastest here, and batch-invariant (docs/drafter.md)
    head_ids: np.ndarray | None = field(default=None, compare=False)  # kept vocabulary rows, None = full head
    kv: str = "upper4"  # "upper4" (draft-only 4-bit cache), "hier8" (shared hierarchical cache) or "f32"
    kv_reader: str = "draft"  # on "hier8": "draft" reads the upper nibble, "full" both nibbles
    kv_group: int = 128  # tokens per key group
    kv_value_group: int = 128  # channels per value group
    outputs: str = "topk"  # "topk" or "logits"
    # "gqa": onnxruntime's GroupQueryAttention (one fused op per layer: the fast drafter); "f64": scores, softmax and
    # the weighted sum as plain ops in float64, which makes a token's result independent of its batch (the target)
    attention: str = "gqa"

    @property
    def kv_float(self) -> int:
        return TensorProto.FLOAT if self.kv == "f32" else TensorProto.FLOAT16


@dataclass(frozen=True)
class _Table:
    """A table's initializers by name (an empty name: the input is absent)."""

    data: str
    scales: str = ""  # [V, K/block]
    zero_points: str = ""  # [V, K/block] 8-bit, [V, ceil(K/block/2)] 4-bit
    residual: str = ""  # float32 [V, K/block]: offsets the zero points cannot hold (pack_exact)
    bits: int = 0
    block: int = 0


@dataclass(frozen=True, eq=False)
class TensorRows:
    """Rows of one GGUF tensor: all of them, or `ids` in that order (a trimmed head). Packed a chunk of ROWS_BYTES
    at a time (DecoderBuilder.pack), never dequantized whole."""

    source: str
    ids: np.ndarray | None = None


class DecoderBuilder:
    def __init__(self, weights: GGUFWeights, options: GraphOptions, data: BinaryIO | None = None,
                 location: str = ""):
        self.w, self.arch, self.opt = weights, weights.arch, options
        self.g = GraphWriter(data, location)
        self.tables: dict[str, _Table] = {}  # gather tables stored so far

    # --- pieces -------------------------------------------------------------------------------------------

    def linear(self, x: str, name: str, w: np.ndarray | TensorRows | None = None, source: str | None = None,
               grid: BlockGrid | None = None) -> str:
        """x: [n, in] -> [n, out] for the GGUF weight `name` ([out, in]); `source` names the GGUF tensor. A weight
        passed in (fused) comes with its rows' `grid`; one read here brings its own, and its bias. TensorRows (a
        head) are packed a chunk at a time with their own grid."""
        if w is None:
            return self.add_bias(self.linear(x, name, self.w.get(name), name, self.w.grid(name)), [name])
        g, opt = self.g, self.opt
        keep = opt.weights == "int4" and not opt.int4_block
        if isinstance(w, TensorRows):
            if opt.weights == "f32":
                return g.op("MatMul", x, g.weight(name, self.read(w).T), hint="mm")
            packed, residual = self.pack(w, exact=keep)
        elif opt.weights == "f32":
            return g.op("MatMul", x, g.weight(name, w.T), hint="mm")
        else:
            exact = pack_exact(w, grid) if keep and grid is not None else None
            packed, residual = exact if exact is not None else (self.quantize(w, source or name), None)
        inputs = [g.weight(name + ".q", packed.packed), g.weight(name + ".scales", packed.scales)]
        if packed.zero_points is not None:
            inputs.append(g.weight(name + ".zp", packed.zero_points))
        y = g.op("MatMulNBits", x, *inputs, hint="mm", domain="com.microsoft", K=packed.k, N=packed.n,
                 bits=packed.bits, block_size=packed.block, accuracy_level=opt.accuracy_level)
        if residual is None:
            return y
        # the offsets a zero point cannot hold (Q4_1, Q4_K): (x's block sums) [n, K/block] @ residual.T
        blocks = g.op("Reshape", x, g.const([-1, packed.k_blocks, packed.block]))
        sums = g.op("ReduceSum", blocks, g.const([-1]), keepdims=0)
        return g.op("Add", y, g.op("MatMul", sums, g.weight(name + ".residual", residual.T.copy())))

    def add_bias(self, y: str, names: list[str]) -> str:
        """y [n, out] plus the biases of the projections `names` ([out] together, zeros for one without), added
        after the product as llama.cpp adds qwen2's q, k and v biases; y itself when none has one."""
        biases = [name.removesuffix(".weight") + ".bias" for name in names]
        if not any(self.w.has(bias) for bias in biases):
            return y
        rows = [self.w.get(bias) if self.w.has(bias) else np.zeros(int(self.w.tensors[name].shape[1]), np.float32)
                for name, bias in zip(names, biases, strict=True)]
        return self.g.op("Add", y, self.g.weight(self.g.name(biases[0]), np.concatenate(rows)))

    def read(self, rows: TensorRows) -> np.ndarray:
        """The rows whole, as float32 (the float reference graph)."""
        return self.w.rows(rows.source, slice(None) if rows.ids is None else rows.ids)

    def pack(self, rows: TensorRows, exact: bool,
             symmetric_only: bool = False) -> tuple[PackedWeight, np.ndarray | None]:
        """The rows packed a chunk at a time: on the file's own grid where `exact` and every chunk lies on it
        (pack_exact; Q4_1 and Q4_K offsets come back as the residual), else requantized (self.quantize)."""
        source = rows.source
        total = self.w.n_rows(source) if rows.ids is None else len(rows.ids)
        step = max(1, ROWS_BYTES // (4 * self.w.row_floats(source)))
        picks = [slice(start, min(start + step, total)) if rows.ids is None else rows.ids[start : start + step]
                 for start in range(0, total, step)]
        if exact and self.w.grid(source, slice(0, 1)) is not None:
            stacked = StackedRows(total)
            for pick in picks:
                part = pack_exact(self.w.rows(source, pick), self.w.grid(source, pick))
                if part is None:
                    break
                stacked.add(*part)
            else:
                return stacked.result()
        stacked = StackedRows(total)
        for pick in picks:
            stacked.add(self.quantize(self.w.rows(source, pick), source, symmetric_only), None)
        return stacked.result()

    def quantize(self, w: np.ndarray, source: str, symmetric_only: bool = False):
        """Requantizes a dequantized GGUF tensor whose own grid is not kept (pack_exact), without adding error
        where the source's grid allows it.

        A Q4_0 (Q8_0) block is d * q with d = (value of largest magnitude) / -8 (/127): symmetric 4-bit
        (8-bit) MatMulNBits blocks of 32 hold it exactly, so a Q4_0 drafter keeps exactly its weights.
        Tensors stored at 8 bits or more (embeddings, the head) stay 8-bit in the int4 graph, as llama.cpp
        keeps them; everything else gets the graph's bits, asymmetric.
        """
        from edge.quant.int4 import quantize_weight

        kind = self.w.tensors[source].tensor_type.name
        bits = 4 if self.opt.weights == "int4" else 8
        if bits == 4 and kind in ("Q8_0", "F16", "BF16", "F32", "Q6_K"):
            bits = 8
        symmetric = symmetric_only or (kind == "Q4_0" and bits == 4) or (kind == "Q8_0" and bits == 8)
        return quantize_weight(w, bits=bits, block=self.opt.int4_block or self.opt.block, symmetric=symmetric)

    def rms_norm(self, x: str, name: str) -> str:
        return self.g.op("SimplifiedLayerNormalization", x, self.g.weight(name, self.w.get(name)), hint="norm",
                         axis=-1, epsilon=self.arch.rms_eps)

    def embed(self, ids: str) -> str:
        g = self.g
        x = self.gather_rows("token_embd", "token_embd.weight", ids)
        if self.arch.embed_scale != 1.0:
            x = g.op("Mul", x, g.const(self.arch.embed_scale, np.float32))
        return x

    def gather_rows(self, name: str, source: str, ids: str) -> str:
        """Rows `ids` of a [V, H] table (the embedding, or an untied head); the table is stored once however often its
        rows are gathered. The int4 graph keeps the file's own blocks where it can (quant/grid.py: Q5_0 as 8-bit codes,
        Q4_K as 4-bit ones with their offsets), as its matmuls do: requantizing Qwen2.5-Coder-0.5B's Q5_0 embedding to
        4 bits put the graph's log-probs 3.5x further from llama.cpp's (median 0.105 nats against 0.030)."""
        g, opt = self.g, self.opt
        if opt.weights == "f32":
            if name not in self.tables:
                self.tables[name] = _Table(g.weight(name, self.w.get(source)))
            return g.op("Gather", self.tables[name].data, ids, axis=0)
        if name not in self.tables:
            self.tables[name] = self.quantized_table(name, source)
        t = self.tables[name]
        x = g.op("GatherBlockQuantized", t.data, ids, t.scales, *[t.zero_points] if t.zero_points else [],
                 domain="com.microsoft", gather_axis=0, quantize_axis=1, block_size=t.block, bits=t.bits)
        if not t.residual:
            return x
        # each block's offset that its zero point cannot hold: [..., K/block] -> [..., K/block, block] -> x's shape
        offsets = g.op("Unsqueeze", g.op("Gather", t.residual, ids, axis=0), g.const([-1]))
        return g.op("Add", x, g.op("Reshape", g.op("Expand", offsets, g.const([1, t.block])), g.op("Shape", x)))

    def quantized_table(self, name: str, source: str) -> _Table:
        """The table `source` [V, H] as GatherBlockQuantized reads it: its own grid's codes, else (a float table, a
        type without a grid here) a symmetric requantization (self.quantize: 8 bits for floats, 4 for the rest)."""
        g, rows = self.g, self.w.n_rows(source)
        packed, residual = self.pack(TensorRows(source), exact=True, symmetric_only=True)
        zero_points = packed.zero_points
        return _Table(g.weight(name + ".q", packed.packed.reshape(rows, -1)),
                      g.weight(name + ".s", packed.scales.reshape(rows, -1)),
                      "" if zero_points is None else g.weight(name + ".zp", zero_points.reshape(rows, -1)),
                      "" if residual is None else g.weight(name + ".r", residual), packed.bits, packed.block)

    def context_rows(self, x: str, logits: str, head_name: str) -> tuple[str, str]:
        """A trimmed head's logits [m, K] joined by those of `extra_ids` [E]: tokens of the context outside the
        kept K (the drafter's runtime lists them; extra_mask is 0, or -inf for padding). A prompt's rare words
        come back in its reply, and a trimmed head could never propose them. Returns the joined logits
        [m, K + E] and the full-vocabulary id of each column [K + E]."""
        g = self.g
        extra = g.input("extra_ids", TensorProto.INT64, ["E"])
        extra_mask = g.input("extra_mask", TensorProto.FLOAT, ["E"])
        source = "token_embd" if head_name == "token_embd.weight" else "head_rows"  # tied heads read the embedding
        rows = self.gather_rows(source, head_name, extra)  # [E, H]
        extra_logits = g.op("Add", g.op("MatMul", x, g.op("Transpose", rows, perm=[1, 0])), extra_mask)  # [m, E]
        ids = g.op("Concat", g.const(np.asarray(self.opt.head_ids, np.int64)), extra, axis=0)
        return g.op("Concat", logits, extra_logits, axis=-1), ids

    def rope_tables(self, base: float, scale: float) -> tuple[str, str]:
        """cos, sin [T, d/2] for positions 0..T-1 (every position a token of this run can have)."""
        g, d = self.g, self.arch.head_dim
        inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        if self.w.has("rope_freqs.weight"):  # Llama 3.x long-context frequency factors
            inv_freq = inv_freq / self.w.get("rope_freqs.weight").astype(np.float64)
        pos = g.op("Unsqueeze", g.op("Cast", self.key_range, to=TensorProto.FLOAT), g.const([1]))  # [T, 1]
        angles = g.op("Mul", pos, g.const((inv_freq * scale).astype(np.float32)[None, :], np.float32))
        return g.op("Cos", angles), g.op("Sin", angles)

    def rope(self, x: str, tables: tuple[str, str], heads: int) -> str:
        """x: [1, n, heads * d] rotated by position (pairs (i, i + d/2) for NEOX, (2i, 2i + 1) otherwise)."""
        return self.g.op("RotaryEmbedding", x, self.position_ids, *tables, domain="com.microsoft",
                         interleaved=0 if self.arch.rope_neox else 1, num_heads=heads)

    def committed_kv(self, cache: dict[str, str], kind: str) -> str:
        """Every layer's cached keys or values at once, [L, kvh, T0, d] (T0 = Q + W + S), oldest first.

        Done once per run rather than per layer: a 30-layer drafter runs thousands of tiny ops otherwise, and
        onnxruntime's per-op overhead, not arithmetic, then dominates a drafter step.
        """
        g, opt, a = self.g, self.opt, self.arch
        pieces = []
        if opt.kv != "f32":
            codes = cache[f"{kind}_codes"]  # [Q, L, kvh, d'] or [Q, L, C']
            scale = g.op("Cast", cache[f"{kind}_scale"], to=TensorProto.FLOAT)
            low = g.op("Cast", cache[f"{kind}_min"], to=TensorProto.FLOAT)
            if opt.kv == "upper4":  # two channels per byte, the even channel in the low nibble
                even = g.op("Unsqueeze", g.op("BitwiseAnd", codes, g.const(15, np.uint8)), g.const([-1]))
                odd = g.op("Unsqueeze", g.op("BitShift", codes, g.const(4, np.uint8), direction="RIGHT"),
                           g.const([-1]))
                shape = [0, 0, a.n_kv_heads, a.head_dim] if kind == "k" else [0, 0, a.n_kv_heads * a.head_dim]
                level = g.op("Cast", g.op("Reshape", g.op("Concat", even, odd, axis=-1), g.const(shape)),
                             to=TensorProto.FLOAT)
            elif opt.kv_reader == "draft":  # the upper nibble of a hierarchical byte
                level = g.op("Cast", g.op("BitShift", codes, g.const(4, np.uint8), direction="RIGHT"),
                             to=TensorProto.FLOAT)
            else:  # u*s + (l-8)*s/16 + min == byte * s/16 + (min - s/2)
                level = g.op("Cast", codes, to=TensorProto.FLOAT)
                low = g.op("Sub", low, g.op("Mul", scale, g.const(0.5, np.float32)))
                scale = g.op("Mul", scale, g.const(1 / 16, np.float32))
            # Shapes from the inputs, not -1: Reshape cannot infer a dimension of an empty cache.
            tokens = g.op("Slice", g.op("Shape", codes), g.const([0]), g.const([1]))
            if kind == "k":  # per channel over groups of G tokens: scale [Q/G, L, kvh, d]
                groups = g.op("Slice", g.op("Shape", scale), g.const([0]), g.const([1]))
                dims = g.const([opt.kv_group, a.n_layers, a.n_kv_heads, a.head_dim])
                grouped = g.op("Reshape", level, g.op("Concat", groups, dims, axis=0))
                scale, low = (g.op("Unsqueeze", t, g.const([1])) for t in (scale, low))
            else:  # per token over groups of VG channels: scale [Q, L, C/VG]
                channels = a.n_kv_heads * a.head_dim
                grouped = g.op("Reshape", level, g.const([0, 0, channels // opt.kv_value_group, opt.kv_value_group]))
                scale, low = (g.op("Unsqueeze", t, g.const([-1])) for t in (scale, low))
            values = g.op("Add", g.op("Mul", grouped, scale), low)
            shape = g.op("Concat", tokens, g.const([a.n_layers, a.n_kv_heads, a.head_dim]), axis=0)
            pieces.append(g.op("Reshape", values, shape))
        for part in ("win", "tree"):
            piece = cache[f"{kind}_{part}"]
            pieces.append(piece if opt.kv == "f32" else g.op("Cast", piece, to=TensorProto.FLOAT))
        cached = g.op("Transpose", g.op("Concat", *pieces, axis=0), perm=[1, 2, 0, 3])
        return g.op("Cast", cached, to=TensorProto.DOUBLE) if opt.attention == "f64" else cached

    def linears(self, x: str, names: list[str], parts: list[int] | None = None) -> list[str]:
        """Several projections of the same input in one matmul (fewer, larger ops), split afterwards into
        `parts` consecutive groups of them (default: one output per projection)."""
        groups, start = [], 0
        for count in parts or [1] * len(names):
            groups.append(names[start : start + count])
            start += count
        keep = self.opt.weights == "int4" and not self.opt.int4_block
        grid = BlockGrid.concat([self.w.grid(name) for name in names]) if keep else None
        if grid is None and keep and len({self.w.tensors[name].tensor_type for name in names}) > 1:
            # mixed types keep their own grids (those of one width, e.g. Q5_0 and Q8_0 both 8-bit, fuse above)
            return [self.linear(x, group[0]) if len(group) == 1
                    else self.g.op("Concat", *(self.linear(x, name) for name in group), axis=-1) for group in groups]
        weights = {name: self.w.get(name) for name in names}
        fused = self.linear(x, names[0].replace(".weight", "") + "+.weight", np.concatenate(list(weights.values())),
                            names[0], grid)
        fused = self.add_bias(fused, names)
        if len(groups) == 1:
            return [fused]
        sizes = [sum(weights[name].shape[0] for name in group) for group in groups]
        return self.g.op("Split", fused, self.g.const(sizes), axis=-1, n_out=len(groups))

    def attention(self, layer: int, x: str, tables: tuple[str, str], mask: str, past: tuple[str, str]):
        """x: [1, n, H] normed; past: this layer's cached keys and values [1, kvh, T0, d].
        Returns the attention output [1, n, H] and this layer's new k, v [1, kvh, n, d] (k after RoPE)."""
        g, a, prefix = self.g, self.arch, f"blk.{layer}."
        nh, kvh, d = a.n_heads, a.n_kv_heads, a.head_dim
        names = [prefix + "attn_q.weight", prefix + "attn_k.weight", prefix + "attn_v.weight"]
        gqa = dict(domain="com.microsoft", n_out=3, num_heads=nh, kv_num_heads=kvh, scale=a.attn_scale)
        if self.opt.attention == "gqa" and a.name != "gemma3":  # one op: RoPE at the nodes' positions + attention
            (qkv,) = self.linears(x, names, parts=[3])
            out, present_k, present_v = g.op("GroupQueryAttention", qkv, "", "", *past, self.seqlens, self.total,
                                             *tables, self.position_ids, mask, do_rotary=1,
                                             rotary_interleaved=0 if a.rope_neox else 1, **gqa)
        else:
            qk, v = self.linears(x, names, parts=[2, 1])
            if a.name == "gemma3":  # RMS norm per head, q and k with their own weights
                heads = g.op("Reshape", qk, g.const([1, -1, nh + kvh, d]))
                weight = np.concatenate([np.tile(self.w.get(prefix + "attn_q_norm.weight"), (nh, 1)),
                                         np.tile(self.w.get(prefix + "attn_k_norm.weight"), (kvh, 1))])
                normed = g.op("SimplifiedLayerNormalization", heads, g.const(np.ones(d), np.float32), axis=-1,
                              epsilon=a.rms_eps)
                qk = g.op("Reshape", g.op("Mul", normed, g.weight(prefix + "qk_norm", weight.astype(np.float32))),
                          g.const([1, -1, (nh + kvh) * d]))
            q, k = g.op("Split", self.rope(qk, tables, nh + kvh), g.const([nh * d, kvh * d]), axis=-1, n_out=2)
            if self.opt.attention == "f64":
                out, k, v = self.attention_f64(q, k, v, mask, past)
                return self.linear(out, prefix + "attn_output.weight"), k, v
            out, present_k, present_v = g.op("GroupQueryAttention", q, k, v, *past, self.seqlens, self.total, "", "",
                                             "", mask, **gqa)
        new_k, new_v = (g.op("Slice", t, self.past_len, g.const([2**62]), g.const([2])) for t in (present_k, present_v))
        return self.linear(out, prefix + "attn_output.weight"), new_k, new_v

    def attention_f64(self, q: str, k: str, v: str, mask: str, past: tuple[str, str]) -> tuple[str, str, str]:
        """Scores, softmax and weighted sum in float64: a token's result then rounds to the same float32 in any
        batch. q [1, n, nh*d], k and v [1, n, kvh*d] -> output [1, n, nh*d], new k and v [1, kvh, n, d]."""
        g, a = self.g, self.arch
        kvh, d = a.n_kv_heads, a.head_dim
        k, v = (g.op("Cast", g.op("Cast", t, to=TensorProto.FLOAT16), to=TensorProto.FLOAT) for t in (k, v))
        q = g.op("Mul", q, g.const(a.attn_scale, np.float32))
        q = g.op("Transpose", g.op("Reshape", q, g.const([-1, kvh, a.group, d])), perm=[1, 2, 0, 3])  # [kvh, grp, n, d]
        k, v = (g.op("Transpose", g.op("Reshape", t, g.const([1, -1, kvh, d])), perm=[0, 2, 1, 3]) for t in (k, v))
        keys, values = (g.op("Concat", cached, g.op("Cast", t, to=TensorProto.DOUBLE), axis=2)  # [1, kvh, T, d]
                        for cached, t in zip(past, (k, v), strict=True))
        keys = g.op("Transpose", keys, perm=[1, 0, 3, 2])  # [kvh, 1, d, T]
        values = g.op("Transpose", values, perm=[1, 0, 2, 3])  # [kvh, 1, T, d]
        scores = g.op("Add", g.op("MatMul", g.op("Cast", q, to=TensorProto.DOUBLE), keys), mask)  # [kvh, grp, n, T]
        out = g.op("Cast", g.op("MatMul", g.op("Softmax", scores, axis=-1), values), to=TensorProto.FLOAT)
        return g.op("Reshape", g.op("Transpose", out, perm=[2, 0, 1, 3]), g.const([1, -1, a.n_heads * d])), k, v

    def ffn(self, layer: int, x: str) -> str:
        g, prefix = self.g, f"blk.{layer}."
        gate, up = self.linears(x, [prefix + "ffn_gate.weight", prefix + "ffn_up.weight"])
        if self.arch.name == "gemma3":
            act = g.op("Gelu", gate, approximate="tanh")
        else:
            act = g.op("Mul", gate, g.op("Sigmoid", gate))  # SiLU
        return self.linear(g.op("Mul", act, up), prefix + "ffn_down.weight")

    # --- the whole graph ----------------------------------------------------------------------------------

    def build(self) -> onnx.ModelProto:
        g, a, opt = self.g, self.arch, self.opt
        F, U8, F16, I64 = TensorProto.FLOAT, TensorProto.UINT8, TensorProto.FLOAT16, TensorProto.INT64
        L, kvh, d = a.n_layers, a.n_kv_heads, a.head_dim
        ids = g.input("input_ids", I64, ["n"])
        positions = g.input("positions", I64, ["n"])
        mask = g.input("mask", F, ["n", "T"])
        mask_swa = g.input("mask_swa", F, ["n", "T"]) if a.has_swa else mask
        rows = g.input("output_rows", I64, ["m"])
        top_k = g.input("top_k", I64, [1]) if opt.outputs == "topk" else None
        cache: dict[str, str] = {}
        if opt.kv != "f32":
            width = d // 2 if opt.kv == "upper4" else d
            cache["k_codes"] = g.input("k_codes", U8, ["Q", L, kvh, width])
            cache["k_scale"] = g.input("k_scale", F16, ["QG", L, kvh, d])
            cache["k_min"] = g.input("k_min", F16, ["QG", L, kvh, d])
            cache["v_codes"] = g.input("v_codes", U8, ["Q", L, kvh * width])
            cache["v_scale"] = g.input("v_scale", F16, ["Q", L, kvh * d // opt.kv_value_group])
            cache["v_min"] = g.input("v_min", F16, ["Q", L, kvh * d // opt.kv_value_group])
        for kind in ("k", "v"):
            for part, dim in (("win", "W"), ("tree", "S")):
                cache[f"{kind}_{part}"] = g.input(f"{kind}_{part}", opt.kv_float, [dim, L, kvh, d])

        # once per run: the key count T, RoPE tables for positions 0..T-1 (a token's position is below T)
        total = g.op("Slice", g.op("Shape", mask), g.const([1]), g.const([2]))  # [1]
        keys = g.op("Squeeze", total, g.const([0]))  # T, a scalar
        self.key_range = g.op("Range", g.const(0), keys, g.const(1))
        self.position_ids = g.op("Unsqueeze", positions, g.const([0]))  # [1, n]
        if opt.attention == "gqa":  # GroupQueryAttention's lengths: per sequence the last key's index, and T
            self.seqlens = g.op("Cast", g.op("Sub", total, g.const([1])), to=TensorProto.INT32)
            self.total = g.op("Cast", keys, to=TensorProto.INT32)
            mask, mask_swa = (g.op("Unsqueeze", m, g.const([0, 1])) for m in (mask, mask_swa))  # [1, 1, n, T]
        else:
            mask, mask_swa = (g.op("Cast", m, to=TensorProto.DOUBLE) for m in (mask, mask_swa))
        tables = self.rope_tables(a.rope_base, a.rope_scale)
        tables_swa = self.rope_tables(a.rope_base_swa, 1.0) if a.has_swa else tables
        x = self.embed(g.op("Unsqueeze", ids, g.const([0])))  # [1, n, H]
        # every layer's cached K and V, split into per-layer [1, kvh, T0, d] with one op each
        cached = [self.committed_kv(cache, kind) for kind in ("k", "v")]
        self.past_len = g.op("Slice", g.op("Shape", cached[0]), g.const([2]), g.const([3]))
        past_k, past_v = ([t] if L == 1 else g.op("Split", t, g.const([1] * L), axis=0, n_out=L) for t in cached)
        new_k, new_v = [], []
        for layer in range(L):
            swa = a.swa_layers[layer]
            h = self.rms_norm(x, f"blk.{layer}.attn_norm.weight")
            h, k, v = self.attention(layer, h, tables_swa if swa else tables, mask_swa if swa else mask,
                                     (past_k[layer], past_v[layer]))
            if a.name == "gemma3":
                h = self.rms_norm(h, f"blk.{layer}.post_attention_norm.weight")
            x = g.op("Add", x, h)
            h = self.ffn(layer, self.rms_norm(x, f"blk.{layer}.ffn_norm.weight"))
            if a.name == "gemma3":
                h = self.rms_norm(h, f"blk.{layer}.post_ffw_norm.weight")
            x = g.op("Add", x, h)
            new_k.append(k)
            new_v.append(v)
        for kind, parts in (("k", new_k), ("v", new_v)):  # [1, kvh, n, d] per layer -> [n, L, kvh, d]
            stacked = g.op("Transpose", g.op("Concat", *parts, axis=0), perm=[2, 0, 1, 3])
            if opt.kv != "f32":
                stacked = g.op("Cast", stacked, to=TensorProto.FLOAT16)
            g.output(stacked, f"{kind}_new", opt.kv_float, ["n", L, kvh, d])

        x = g.op("Gather", g.op("Squeeze", x, g.const([0])), rows, axis=0)  # [m, H]
        x = self.rms_norm(x, "output_norm.weight")
        head_name = "output.weight" if self.w.has("output.weight") else "token_embd.weight"
        head = TensorRows(head_name, None if opt.head_ids is None else np.asarray(opt.head_ids))  # [V', H]
        if opt.weights == "f32" and opt.head_ids is None and head_name == "token_embd.weight":
            logits = g.op("Gemm", x, "token_embd", transB=1)  # tied: share the table instead of a second copy
        else:
            logits = self.linear(x, "head", head, source=head_name)  # [m, V']
        if opt.outputs == "logits":
            columns = self.w.n_rows(head_name) if head.ids is None else len(head.ids)
            g.output(logits, "logits", F, ["m", columns])
        else:
            column_ids = None
            if opt.head_ids is not None:
                logits, column_ids = self.context_rows(x, logits, head_name)
            log_probs = g.op("LogSoftmax", logits, axis=-1)
            values, index = g.op("TopK", log_probs, top_k, axis=-1, largest=1, sorted=1, n_out=2)
            raw = g.op("GatherElements", logits, index, axis=-1)  # the same tokens' logits, for penalties on them
            if column_ids is not None:
                index = g.op("Gather", column_ids, index, axis=0)
            g.output(index, "top_ids", I64, ["m", "k"])
            g.output(values, "top_log_probs", F, ["m", "k"])
            g.output(raw, "top_logits", F, ["m", "k"])
        return g.model()


def build_bytes(weights: GGUFWeights) -> int:
    """The memory a build of this file's int4/int8 graph takes beyond the process itself: its largest table packed
    (up to a byte and a quarter a weight: 8-bit codes and a float scale per 16) and a few chunks of rows in float32.
    Measured on Qwen2.5-Coder-0.5B (a 136M-weight embedding): 259-278 MiB anonymous at its peak, some 70 MiB of
    interpreter and onnxruntime included, against this estimate's 290 MiB (benchmarks/graph_memory.py)."""
    tables = [name for name in ("token_embd.weight", "output.weight") if weights.has(name)]
    largest = max((weights.n_rows(name) * weights.row_floats(name) for name in tables), default=0)
    return int(largest * 1.25) + 4 * ROWS_BYTES


def build_graph(gguf_path: Path, options: GraphOptions, out_path: Path) -> Path:
    """Writes out_path (+ out_path.data with the weights) and returns out_path. The weights go to the file tensor
    by tensor as they are packed, and the tables a chunk of rows at a time: the build holds about one tensor's
    worth (benchmarks/graph_memory.py measures it), and a model's graph builds within the memory that runs it."""
    weights = GGUFWeights(gguf_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    location = out_path.name + ".data"
    with open(out_path.with_name(location), "wb") as data:
        model = DecoderBuilder(weights, options, data, location).build()
    out_path.write_bytes(model.SerializeToString())
    return out_path
