"""Write a GGUF target with a real architecture's shape and RANDOM weights: its pass times and memory are real, its
text is meaningless. Every figure measured on such a file must say that it comes from random weights.

    python benchmarks/synthetic_gguf.py --shape llama3.1-70b --type q4_0 --out /data/llama3.1-70b-random.q4_0.gguf
    python benchmarks/synthetic_gguf.py --shape tiny-70b --out /tmp/tiny-70b.gguf     # 2 layers, 1/64 wide: 9 MB
    python benchmarks/synthetic_gguf.py --shape llama3.1-70b --dry-run                # the size and the disk check
    python benchmarks/synthetic_gguf.py --shape llama3.1-70b --sparse --out x.gguf   # header + hole, for the plan

The tokenizer (vocabulary, merges, special tokens, chat template) is copied from a real small model of the family:
SmolLM2-135M (llama architecture, the offline pair's target; `--tokenizer-from FILE` for another GGUF). Llama 3.1's
own 128256-token vocabulary and Qwen2.5's 152064 are not at hand offline, so every shape takes the copied
vocabulary (SmolLM2: 49152 tokens) and keeps every other dimension of the published config: the 70B's embedding
and output tables then hold 1.3 billion parameters fewer than the real model's (0.73 GB in Q4_0: a 38.96 GB file
instead of 39.69 GB); the 80 layers are the same bytes.

Tensors stream to disk 32 MB at a time (gguf's GGUFWriter writes the header and tensor infos; the data follows
chunk by chunk), so a 40 GB file needs no more memory than a small one (215 MB peak RSS writing a 2.4 GB one).
Quantized blocks are valid blocks (a finite positive fp16 scale sized so that a row's dot products stay near 1, then
random quants), norms are ones and biases zeros, so llama.cpp computes finite numbers. The file is written as
FILE.partial and renamed when complete.

Q4_0 on x86: llama.cpp copies Q4_0 weights into repacked buffers at load (anonymous memory, here too: a 2.4 GB
4-layer cut took 2.1 GB of RSS), so a Q4_0 file larger than RAM streams only with llama.cpp's extra buffer types off
(runtimes/llama_cpp/_native.py, USE_EXTRA_BUFFERS); Q8_0 and F16 are read from the mapping.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

from edge.errors import UserError

GIB = 1024**3
DISK_MARGIN = 10**9  # past the tensors: the header (a few MB), and room the filesystem and other writers need
CHUNK_BYTES = 32 << 20  # random bytes made and written per step
RANDOM_WEIGHTS = "random weights: pass times and memory are real, the text is meaningless"


@dataclass(frozen=True)
class ArchShape:
    arch: str  # general.architecture: "llama" or "qwen2"
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    context: int
    llama3_rope: bool  # Llama 3.1's frequency scaling (factor 8, low/high 1/4, 8192 original): a rope_freqs tensor
    qkv_bias: bool  # Qwen2 has biases on q, k and v
    source: str  # where the figures come from


# The published configs (config.json of each model on Hugging Face); the vocabulary is the copied tokenizer's.
SHAPES = {
    "llama3.1-70b": ArchShape("llama", 80, 8192, 28672, 64, 8, 128, 500000.0, 1e-5, 131072, True, False,
                              "meta-llama/Llama-3.1-70B config.json"),
    "llama3.1-8b": ArchShape("llama", 32, 4096, 14336, 32, 8, 128, 500000.0, 1e-5, 131072, True, False,
                             "meta-llama/Llama-3.1-8B config.json"),
    "qwen2.5-32b": ArchShape("qwen2", 64, 5120, 27648, 40, 8, 128, 1000000.0, 1e-6, 32768, False, True,
                             "Qwen/Qwen2.5-32B-Instruct config.json"),
}
# Cut-down presets for tests: (shape, layers, width divisor).
PRESETS = {"tiny-70b": ("llama3.1-70b", 2, 64)}
TYPES = {"q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
         "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
         "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16)}


class Refused(Exception):
    """The output cannot be written (no room, exists, bad cut): one line for the user."""


def cut(shape: ArchShape, layers: int | None, width_divisor: int) -> ArchShape:
    """The shape with fewer layers and its widths (embedding, FFN, heads) divided, head size kept: a small file of the
    same layout for tests. KV heads go down to 1 at least."""
    if layers is not None and not 1 <= layers <= shape.n_layers:
        raise Refused(f"--layers must be 1..{shape.n_layers}, got {layers}")
    d = width_divisor
    if d < 1 or shape.n_heads % d or shape.n_ff % d:
        raise Refused(f"--width-divisor {d} must divide the {shape.n_heads} heads and the FFN's {shape.n_ff}")
    n_heads = shape.n_heads // d
    n_kv = max(1, shape.n_kv_heads // d)
    if n_heads % n_kv or (shape.n_ff // d) % 32:
        raise Refused(f"--width-divisor {d} leaves {n_heads} heads over {n_kv} KV heads and an FFN of "
                      f"{shape.n_ff // d} (must be a multiple of 32, one quant block)")
    return replace(shape, n_layers=layers or shape.n_layers, n_embd=n_heads * shape.head_dim, n_ff=shape.n_ff // d,
                   n_heads=n_heads, n_kv_heads=n_kv)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: tuple[int, ...]  # GGUF order: the row length first
    qtype: GGMLQuantizationType
    fill: str  # "weights" (random), "ones", "zeros", "rope_freqs"

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.dims) // block * size

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """numpy order, a row as its bytes: what GGUFWriter.add_tensor_info takes for raw data."""
        block, size = GGML_QUANT_SIZES[self.qtype]
        return (*self.dims[:0:-1], self.dims[0] // block * size)


def tensor_specs(shape: ArchShape, n_vocab: int, qtype: GGMLQuantizationType) -> list[TensorSpec]:
    """Every tensor of the file, in the order llama.cpp's converter writes them: embedding, layers, norm, head."""
    f32 = GGMLQuantizationType.F32
    embd, q_dim, kv_dim = shape.n_embd, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    specs = [TensorSpec("token_embd.weight", (embd, n_vocab), qtype, "weights")]
    if shape.llama3_rope:
        specs.append(TensorSpec("rope_freqs.weight", (shape.head_dim // 2,), f32, "rope_freqs"))
    for i in range(shape.n_layers):
        blk = f"blk.{i}."
        specs += [TensorSpec(blk + "attn_norm.weight", (embd,), f32, "ones"),
                  TensorSpec(blk + "attn_q.weight", (embd, q_dim), qtype, "weights"),
                  TensorSpec(blk + "attn_k.weight", (embd, kv_dim), qtype, "weights"),
                  TensorSpec(blk + "attn_v.weight", (embd, kv_dim), qtype, "weights")]
        if shape.qkv_bias:
            specs += [TensorSpec(blk + f"attn_{x}.bias", (dim,), f32, "zeros")
                      for x, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))]
        specs += [TensorSpec(blk + "attn_output.weight", (q_dim, embd), qtype, "weights"),
                  TensorSpec(blk + "ffn_norm.weight", (embd,), f32, "ones"),
                  TensorSpec(blk + "ffn_gate.weight", (embd, shape.n_ff), qtype, "weights"),
                  TensorSpec(blk + "ffn_up.weight", (embd, shape.n_ff), qtype, "weights"),
                  TensorSpec(blk + "ffn_down.weight", (shape.n_ff, embd), qtype, "weights")]
    specs += [TensorSpec("output_norm.weight", (embd,), f32, "ones"),
              TensorSpec("output.weight", (embd, n_vocab), qtype, "weights")]
    return specs


def data_bytes(specs: list[TensorSpec], alignment: int = 32) -> int:
    """The tensor data section: every tensor padded to the alignment."""
    return sum(-(-spec.n_bytes // alignment) * alignment for spec in specs)


def llama3_rope_factors(shape: ArchShape) -> np.ndarray:
    """rope_freqs for Llama 3.1's scaling (factor 8, low 1, high 4, 8192 original positions), as llama.cpp's
    converter computes it: [head_dim / 2] float32."""
    factor, low, high, original = 8.0, 1.0, 4.0, 8192
    freqs = 1.0 / shape.rope_theta ** (np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    factors = np.where(wavelen < original / high, 1.0,
                       np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    return factors.astype(np.float32)


@functools.lru_cache(maxsize=4)
def tokenizer_fields(path: Path) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """The tokenizer.* keys of a GGUF file as (key, value, type, array item type), strings as raw bytes."""
    reader = GGUFReader(path)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            item = field.types[1]
            if item == GGUFValueType.STRING:
                value: object = [bytes(field.parts[i]) for i in field.data]
            else:
                value = [field.parts[i][0].item() for i in field.data]
            fields.append((key, value, vtype, item))
        elif vtype == GGUFValueType.STRING:
            fields.append((key, bytes(field.parts[field.data[0]]), vtype, None))
        else:
            fields.append((key, field.parts[field.data[0]][0].item(), vtype, None))
    if not any(key == "tokenizer.ggml.tokens" for key, *_ in fields):
        raise Refused(f"{path} has no tokenizer.ggml.tokens to copy; give --tokenizer-from a model's GGUF file")
    return fields


def default_tokenizer_file() -> Path:
    """The offline pair's SmolLM2-135M target (llama architecture), fetched by `edge-spec pull smollm2-135m`."""
    from edge.models.registry import load_registry
    from edge.models.sources import model_path

    path = model_path(load_registry().pair("smollm2-135m").target)
    if path is None or not path.is_file():
        raise Refused("SmolLM2-135M's file is not here to copy the tokenizer from; run `edge-spec pull smollm2-135m` "
                      "or give --tokenizer-from FILE")
    return path


def check_room(out: Path, needed: int, force: bool) -> None:
    """Refuse when `out` exists (without force) or its folder's disk lacks `needed` bytes (an existing `out` that
    force replaces counts as free)."""
    check_new(out, force)
    replaced = out.stat().st_size if out.is_file() else 0
    free = shutil.disk_usage(out.parent).free + replaced
    if free < needed:
        raise Refused(f"not enough disk for {out}: it needs {_size(needed)} (the file and a {_size(DISK_MARGIN)} "
                      f"margin), {out.parent} has {_size(free)} free")


def check_new(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise Refused(f"{out} exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise Refused(f"folder {out.parent} does not exist; create it first")


def _size(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.1f} MB"


def random_weights(qtype: GGMLQuantizationType, row_length: int, n_bytes: int,
                   bits: np.random.BitGenerator) -> np.ndarray:
    """n_bytes (whole blocks or f16 values) of random weights for rows of `row_length`: a value's spread is about
    1/sqrt(row_length), so each output of a matmul has a spread near 1 whatever the width."""
    raw = bits.random_raw(-(-n_bytes // 8)).view(np.uint8)[:n_bytes]  # SFC64: ~2 GB/s here, 10x rng.bytes
    sigma = 1 / math.sqrt(row_length)
    if qtype == GGMLQuantizationType.F16:
        # sign and mantissa random, exponent fixed: magnitudes in [2^e, 2^(e+1)), finite and not subnormal
        values = raw.view("<u2")
        values &= 0x83FF
        values |= np.uint16((_f16_exponent(sigma / 1.5) + 15) << 10)
        return raw
    size = GGML_QUANT_SIZES[qtype][1]
    quant_spread = 4.61 if qtype == GGMLQuantizationType.Q4_0 else 73.9  # std of (nibble - 8), of an int8
    scales = raw.reshape(-1, size)[:, :2].view("<u2")  # each block starts with its fp16 scale d
    scales &= 0x03FF  # positive, random mantissa
    scales |= np.uint16((_f16_exponent(sigma / quant_spread) + 15) << 10)
    return raw


def _f16_exponent(value: float) -> int:
    """The fp16 exponent e with 2^e <= value (clamped to fp16's normal range)."""
    return min(15, max(-14, math.floor(math.log2(value))))


def tensor_chunks(spec: TensorSpec, shape: ArchShape, bits: np.random.BitGenerator):
    """The tensor's bytes, CHUNK_BYTES or so at a time (whole rows)."""
    if spec.fill != "weights":
        n = math.prod(spec.dims)
        values = {"ones": np.ones(n, np.float32), "zeros": np.zeros(n, np.float32)}.get(spec.fill)
        yield (llama3_rope_factors(shape) if values is None else values).view(np.uint8)
        return
    row_bytes = spec.n_bytes // math.prod(spec.dims[1:])
    rows_per_chunk = max(1, CHUNK_BYTES // row_bytes)
    n_rows = math.prod(spec.dims[1:])
    for start in range(0, n_rows, rows_per_chunk):
        rows = min(rows_per_chunk, n_rows - start)
        yield random_weights(spec.qtype, spec.dims[0], rows * row_bytes, bits)


def write_synthetic(name: str, shape: ArchShape, type_name: str, out: Path, tokenizer: Path, force: bool = False,
                    seed: int = 0, dry_run: bool = False, sparse: bool = False) -> tuple[int, float]:
    """Write the file (as out.partial, renamed when complete); (its size in bytes, seconds taken). With dry_run,
    only the checks and the size the data section will take; sparse, the header alone and the data a hole (a file
    of the full size that takes a few MB: the plan reads its header; passes over it would read zeros and no disk)."""
    start = time.perf_counter()
    qtype, file_type = TYPES[type_name]
    check_new(out, force)  # before the tokenizer's second or two
    fields = tokenizer_fields(tokenizer)
    n_vocab = len(next(value for key, value, *_ in fields if key == "tokenizer.ggml.tokens"))
    if qtype != GGMLQuantizationType.F16 and shape.n_embd % 32:
        raise Refused(f"{type_name} needs rows of a multiple of 32 values; the embedding is {shape.n_embd} wide")
    specs = tensor_specs(shape, n_vocab, qtype)
    check_room(out, (0 if sparse else data_bytes(specs)) + DISK_MARGIN, force)
    if dry_run:
        return data_bytes(specs), time.perf_counter() - start
    writer = _writer(name + (" sparse, no weights: for planning only" if sparse else ""), shape, n_vocab, file_type,
                     fields)
    for spec in specs:
        writer.add_tensor_info(spec.name, spec.byte_shape, np.dtype(np.uint8), spec.n_bytes, raw_dtype=spec.qtype)
    partial = out.with_name(out.name + ".partial")
    bits = np.random.SFC64(seed)
    try:
        writer.write_header_to_file(partial)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        file = writer.fout[0]
        if sparse:
            _pad(file, writer.data_alignment)
            file.truncate(file.tell() + data_bytes(specs, writer.data_alignment))
        for spec in [] if sparse else specs:
            _pad(file, writer.data_alignment)  # each tensor's data starts aligned, as write_tensor_data does
            for chunk in tensor_chunks(spec, shape, bits):
                file.write(chunk.data)
        _pad(file, writer.data_alignment)
        file.flush()
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # leave the page cache as it was: start cold
        writer.close()
        partial.replace(out)
    except BaseException:  # Ctrl-C included: no half-written file is left behind
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return out.stat().st_size, time.perf_counter() - start


def _writer(name: str, shape: ArchShape, n_vocab: int, file_type: LlamaFileType, fields: list) -> GGUFWriter:
    # path None: the header goes to the file named at write_header_to_file
    writer = GGUFWriter(None, shape.arch)
    writer.add_name(f"synthetic {name} (random weights)")
    writer.add_description(f"{RANDOM_WEIGHTS}; shape of {shape.source}, vocabulary copied from another model")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layers)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(2)
    for key, value, vtype, item in fields:
        writer.add_key_value(key, value, vtype, sub_type=item)
    return writer


def _pad(file, alignment: int) -> None:
    file.write(b"\0" * (-file.tell() % alignment))


def resolve_shape(name: str, layers: int | None, width_divisor: int) -> ArchShape:
    if name in PRESETS:
        base, preset_layers, preset_divisor = PRESETS[name]
        return cut(SHAPES[base], layers or preset_layers, preset_divisor * width_divisor)
    return cut(SHAPES[name], layers, width_divisor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[*SHAPES, *PRESETS], required=True,
                        help="tiny-70b: the 70B's layout with 2 layers at 1/64 of its width (a few MB)")
    parser.add_argument("--type", choices=list(TYPES), default="q4_0", help="weight type (norms are f32)")
    parser.add_argument("--out", type=Path, help="the GGUF file to write (required unless --dry-run)")
    parser.add_argument("--layers", type=int, help="keep only this many layers")
    parser.add_argument("--width-divisor", type=int, default=1,
                        help="divide the embedding, FFN and head counts by N (head size kept)")
    parser.add_argument("--tokenizer-from", type=Path, help="GGUF to copy the tokenizer from (default: SmolLM2-135M)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--dry-run", action="store_true", help="print the size and check the disk; write nothing")
    parser.add_argument("--sparse", action="store_true",
                        help="the header alone, the weights a hole (a few MB on disk): for `edge-spec plan`, never for "
                             "timing (a pass would read zeros, not the disk)")
    args = parser.parse_args()
    if args.out is None and not args.dry_run:
        parser.error("--out is required (or --dry-run)")
    shape = resolve_shape(args.shape, args.layers, args.width_divisor)
    out = (args.out or Path.cwd() / f"{args.shape}.{args.type}.gguf").expanduser().absolute()
    tokenizer = args.tokenizer_from or default_tokenizer_file()
    n_bytes, seconds = write_synthetic(args.shape, shape, args.type, out, tokenizer, args.force, args.seed,
                                       args.dry_run, args.sparse)
    layout = (f"{args.shape} ({shape.arch}, {shape.n_layers} layers, embd {shape.n_embd}, FFN {shape.n_ff}, "
              f"{shape.n_heads} heads / {shape.n_kv_heads} KV heads of {shape.head_dim}), {args.type}, "
              f"tokenizer of {tokenizer.name}")
    if args.dry_run:
        print(f"would write {out}: {_size(n_bytes)} of tensors ({n_bytes / GIB:.2f} GiB), {layout}; the disk has room")
    elif args.sparse:
        print(f"wrote {out}: {_size(n_bytes)} apparent, {_size(out.stat().st_blocks * 512)} on disk, {layout}")
        print("SPARSE: no weights (a hole of zeros); for `edge-spec plan` and header checks, never for timing")
        return
    else:
        print(f"wrote {out}: {_size(n_bytes)} ({n_bytes / GIB:.2f} GiB) in {seconds:.1f} s "
              f"({n_bytes / 1e6 / max(seconds, 1e-9):.0f} MB/s), {layout}")
    print(f"RANDOM WEIGHTS ({RANDOM_WEIGHTS}): say so with every figure measured on this file")


if __name__ == "__main__":
    try:
        main()
    except Refused as error:
        sys.exit(f"error: {error}")
    except UserError as error:
        from edge.cli.render import worded

        sys.exit(f"error: {worded(error)}")
