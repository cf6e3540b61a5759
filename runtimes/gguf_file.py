"""Check a GGUF model file before llama.cpp sees it, and read the metadata edge-spec needs."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import struct
import sys
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, LlamaFileType, ReaderField

from edge.errors import Remedy, UserError

GGUF_MAGIC = b"GGUF"
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    architecture: str  # general.architecture
    name: str | None  # general.name
    n_vocab: int  # len(tokenizer.ggml.tokens)
    chat_template: str | None  # tokenizer.chat_template
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool | None  # tokenizer.ggml.add_bos_token
    weight_types: frozenset[str]  # types of the 2-D+ tensors (matmul weights), e.g. "Q4_0", "Q6_K"
    file_type: str | None  # general.file_type as a name, e.g. "MOSTLY_Q4_1"
    n_params: int
    file_size: int
    vocab_digest: str  # sha256 of tokenizer.ggml.tokens as stored: two files with the same digest share a vocabulary


class _Truncated(Exception):
    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


class _HeaderReader(GGUFReader):
    """GGUFReader that keeps each metadata array as one view instead of one numpy view per element.

    The stock reader takes 2.6 s on SmolLM2's 49k-token vocabulary and 11.5 s on Gemma-3's 262k one;
    string arrays are only skipped here (`contents()` of one is empty; its length is `parts[-2]`).
    Every read is bounds-checked so a cut file reports how long the header says it must be.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        end = offset + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _Truncated(end)
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        offs = orig_offs + 12
        itype = GGUFValueType(raw_itype[0])
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, int(length[0]))
            return 12 + int(values.nbytes), [raw_itype, length, values], [2], [GGUFValueType.ARRAY, itype]
        if itype != GGUFValueType.STRING:
            raise ValueError(f"nested or unknown array type {itype!r}")
        end = self._skip_strings(offs, int(length[0]))
        blob = self._get(offs, np.uint8, end - offs)
        return end - orig_offs, [raw_itype, length, blob], [], [GGUFValueType.ARRAY, itype]

    def _skip_strings(self, offs: int, count: int) -> int:
        # Each string is a uint64 length then its bytes: walking the lengths is the only way past them.
        swapped = self.byte_order == "S"
        fmt = ("<Q" if sys.byteorder == "big" else ">Q") if swapped else "=Q"
        unpack = struct.Struct(fmt).unpack_from
        buffer = memoryview(self.data)
        size = len(buffer)
        for _ in range(count):
            if offs + 8 > size:
                raise _Truncated(offs + 8)
            offs += 8 + unpack(buffer, offs)[0]
        if offs > size:
            raise _Truncated(offs)
        return offs

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        end = start_offs
        alignment = self.alignment  # general.alignment, 32 by default: every tensor's data starts on a multiple
        for field in fields:
            _name_len, name, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            if int(offset_tensor[0]) % alignment:
                raise ValueError(f"tensor {bytes(name).decode('utf-8', 'replace')!r} starts at offset "
                                 f"{int(offset_tensor[0])}, not a multiple of the file's alignment {alignment}")
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_dtype[0])]
            n_bytes = int(np.prod(dims, dtype=np.uint64)) * type_size // block_size
            end = max(end, start_offs + int(offset_tensor[0]) + n_bytes)
        if end > len(self.data):
            raise _Truncated(end)
        super()._build_tensors(start_offs, fields)


def check_gguf(path: str | Path) -> GGUFInfo:
    """Fail with one clear line if `path` is not a complete GGUF file; else return its metadata."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(f"model file {path} not found; check the path, or fetch the pair's files",
                        remedy=Remedy("pull", "PAIR"))
    if path.is_dir():
        raise UserError(f"{path} is a directory, not a model file; give the path of the .gguf file inside it")
    try:
        with path.open("rb") as file:
            head = file.read(4)
    except PermissionError:
        raise UserError(f"cannot read {path}: permission denied; check the file's permissions") from None
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror}") from None
    if head != GGUF_MAGIC:
        if not head:
            raise UserError(f"{path} is empty (0 bytes); download it again, or give the path of a .gguf model")
        if GGUF_MAGIC.startswith(head):
            raise UserError(
                f"{path} is truncated: {len(head)} bytes; download it again", remedy=Remedy("pull", "PAIR"))
        raise UserError(
            f"{path} is not a GGUF file (starts with {head!r}); edge-spec runs GGUF models - "
            "convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    stat = path.stat()
    return _read_info(path.resolve(), stat.st_size, stat.st_mtime_ns)


def open_reader(path: str | Path) -> GGUFReader:
    """A GGUFReader over the file that skips the vocabulary's strings (string arrays read as empty): the header in a
    fraction of the stock reader's time, tensors and every scalar as usual; one clear line for a cut or bad file."""
    info = check_gguf(path)
    try:
        return _HeaderReader(info.path)
    except (_Truncated, ValueError, KeyError):
        raise UserError(f"{info.path} is not a valid GGUF file; download or convert it again") from None


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: the row length first
    type_name: str  # e.g. "Q4_0"
    n_elements: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """One parse of a file's header, kept per file (size and mtime) so that everything start-up asks of it, the
    metadata, the shape for the plan and the architecture for the drafter's graph, costs one read."""

    scalars: dict[str, Any]  # every key that is not an array: numbers, booleans, strings
    array_max: dict[str, int]  # numeric arrays (per-layer values): their largest element
    tensors: tuple[HeaderTensor, ...]
    n_vocab: int  # len(tokenizer.ggml.tokens)
    vocab_digest: str  # sha256 of tokenizer.ggml.tokens as stored

    def field(self, key: str, default: Any = None) -> Any:
        return self.scalars.get(key, default)


def gguf_header(path: str | Path) -> GGUFHeader:
    """The file's parsed header (cached; one clear line if it is not a complete GGUF file)."""
    info = check_gguf(path)
    stat = info.path.stat()
    return _read_header(info.path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _read_header(path: Path, size: int, mtime_ns: int) -> GGUFHeader:
    # Keyed on size and mtime so a file replaced on disk is read again. Raises _Truncated, ValueError, KeyError.
    kept = _kept_header(path, size, mtime_ns)
    if kept is not None:
        return kept
    header = _parse_header(path)
    _keep_header(path, size, mtime_ns, header)
    return header


HEADER_FORMAT = 1  # of the kept headers' JSON; another value is parsed again


def _kept_path(path: Path) -> Path:
    """Where a file's parsed header is kept between runs: a start reads both models' headers for the plan, 0.15 s of
    the default pair's start (docs/performance.md, "Start-up"), a few milliseconds from this JSON."""
    from edge.models.cache import cache_dir

    return cache_dir() / "headers" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"


def _kept_header(path: Path, size: int, mtime_ns: int) -> GGUFHeader | None:
    """The header kept for this file as it is now (path, size, mtime and inode), else None: parse it."""
    from edge.models.cache import read_json

    try:
        kept = read_json(_kept_path(path))  # {} when missing or damaged
        if kept.get("format") != HEADER_FORMAT or [kept["path"], kept["size"], kept["mtime_ns"], kept["inode"]] != \
                [str(path), size, mtime_ns, path.stat().st_ino]:
            return None
        header = kept["header"]
        tensors = tuple(HeaderTensor(t["name"], tuple(t["shape"]), t["type_name"], t["n_elements"], t["n_bytes"])
                        for t in header["tensors"])
        return GGUFHeader(dict(header["scalars"]), dict(header["array_max"]), tensors, int(header["n_vocab"]),
                          str(header["vocab_digest"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UserError):
        return None  # damaged: parsed again (and kept anew)


def _keep_header(path: Path, size: int, mtime_ns: int, header: GGUFHeader) -> None:
    """Keep the parsed header for the next run; a cache that cannot be written costs that saving only."""
    from edge.models.cache import write_json

    with suppress(OSError, ValueError, TypeError, UserError):
        write_json(_kept_path(path), {"format": HEADER_FORMAT, "path": str(path), "size": size, "mtime_ns": mtime_ns,
                                      "inode": path.stat().st_ino, "header": dataclasses.asdict(header)})


def _parse_header(path: Path) -> GGUFHeader:
    reader = _HeaderReader(path)
    scalars, array_max = {}, {}
    for key, field in reader.fields.items():
        if field.types[0] != GGUFValueType.ARRAY:
            scalars[key] = field.contents()
        elif len(field.types) > 1 and field.types[1] != GGUFValueType.STRING and field.parts[-1].size:
            array_max[key] = int(np.max(field.parts[-1]))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    tensors = tuple(HeaderTensor(t.name, tuple(int(d) for d in t.shape), t.tensor_type.name, int(t.n_elements),
                                 int(t.n_bytes)) for t in reader.tensors)
    return GGUFHeader(scalars, array_max, tensors, int(tokens.parts[-2][0]) if tokens is not None else 0,
                      hashlib.sha256(tokens.parts[-1].tobytes() if tokens is not None else b"").hexdigest())


@functools.lru_cache(maxsize=16)
def _read_info(path: Path, size: int, mtime_ns: int) -> GGUFInfo:
    # Keyed on size and mtime so a file replaced on disk is read again.
    try:
        header = _read_header(path, size, mtime_ns)
    except _Truncated as cut:
        raise UserError(
            f"{path} is truncated: {size} bytes, the header says at least {cut.needed}; download it again",
            remedy=Remedy("pull", "PAIR")) from None
    except (ValueError, KeyError) as error:
        raise UserError(f"{path} is not a valid GGUF file ({error}); download or convert it again") from None
    fields = header.scalars
    architecture = fields.get("general.architecture")
    if not isinstance(architecture, str):
        raise UserError(f"{path} has no general.architecture in its header; convert it again with llama.cpp")
    return GGUFInfo(
        path=path,
        architecture=architecture,
        name=_string(fields, "general.name"),
        n_vocab=header.n_vocab,
        chat_template=_string(fields, "tokenizer.chat_template"),
        bos_token_id=_scalar(fields, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_scalar(fields, "tokenizer.ggml.eos_token_id"),
        add_bos=_scalar(fields, "tokenizer.ggml.add_bos_token"),
        weight_types=_matmul_weight_types(header.tensors),
        file_type=_file_type_name(_scalar(fields, "general.file_type")),
        n_params=sum(t.n_elements for t in header.tensors),
        file_size=size,
        vocab_digest=header.vocab_digest,
    )


@dataclass(frozen=True)
class GGUFShape:
    """What sizing a model needs (offload/plan.py): its dimensions and where its bytes are."""

    n_layers: int  # {arch}.block_count, the keys runtimes/onnx/arch.py reads too
    n_embd: int
    n_kv_heads: int
    head_dim: int  # {arch}.attention.key_length, else n_embd / n_heads
    n_params: int
    lookup_params: int  # elements of the looked-up token_embd (below), 0 when it is also the output head
    tensor_bytes: int  # all tensors
    layer_bytes: int  # the blk.N tensors, all layers together
    lookup_bytes: int  # token_embd when a separate output head exists: rows are looked up, never streamed whole
    n_vocab: int = 0  # rows of token_embd (0: the file has none)


def gguf_shape(path: str | Path) -> GGUFShape:
    """The dimensions and tensor bytes of a GGUF file (header only; one clear line if it is not one)."""
    info = check_gguf(path)
    # The path as given, not resolved: the Hugging Face cache links split parts' names to blobs named by hash.
    given = Path(path).expanduser().absolute()
    parts = (given, *_later_parts(given))
    stamps = tuple((part.stat().st_size, part.stat().st_mtime_ns) for part in parts)
    return _read_shape(parts, stamps, info.architecture)


@functools.lru_cache(maxsize=16)
def _read_shape(parts: tuple[Path, ...], stamps: tuple[tuple[int, int], ...], arch: str) -> GGUFShape:
    # Keyed on every part's size and mtime, like _read_info.
    path = parts[0]
    header = _read_header(path.resolve(), *stamps[0])  # check_gguf has already read this header without error
    tensors = list(header.tensors)
    for part, stamp in zip(parts[1:], stamps[1:], strict=True):  # split: the keys are in part 1, tensors in all
        try:
            tensors += _read_header(part.resolve(), *stamp).tensors
        except (_Truncated, ValueError, KeyError, OSError):
            raise UserError(f"{part} is not a complete GGUF part; download the model again") from None

    def key(suffix: str, default: int | None = None) -> int:
        value = _scalar(header.scalars, f"{arch}.{suffix}")
        if value is None:
            value = header.array_max.get(f"{arch}.{suffix}")  # per-layer arrays (some archs vary kv heads by layer)
        if value is None and default is None:
            raise UserError(f"{path.name}: GGUF key {arch}.{suffix} is missing; convert it again with llama.cpp")
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1 << 40:
            raise UserError(f"{path.name}: GGUF key {arch}.{suffix} is {value!r}, not a positive count; this is not a "
                            "model llama.cpp wrote: get the file from its publisher again")
        return int(value)

    n_embd, n_heads = key("embedding_length"), key("attention.head_count")
    names = {tensor.name for tensor in tensors}
    lookup = "token_embd.weight" if "output.weight" in names else None
    return GGUFShape(
        n_layers=key("block_count"),
        n_embd=n_embd,
        n_kv_heads=key("attention.head_count_kv", n_heads),
        head_dim=key("attention.key_length", n_embd // n_heads),
        n_params=sum(int(t.n_elements) for t in tensors),
        lookup_params=sum(int(t.n_elements) for t in tensors if t.name == lookup),
        tensor_bytes=sum(int(t.n_bytes) for t in tensors),
        layer_bytes=sum(int(t.n_bytes) for t in tensors if t.name.startswith("blk.")),
        lookup_bytes=sum(int(t.n_bytes) for t in tensors if t.name == lookup),
        n_vocab=sum(int(t.n_elements) for t in tensors if t.name == "token_embd.weight") // n_embd,
    )


def _later_parts(path: Path) -> list[Path]:
    """Parts 2..N beside part 1 of a split GGUF ("x-00001-of-00003.gguf"); [] for a single file."""
    split = _SPLIT_RE.match(path.name)
    if split is None or int(split["part"]) != 1:
        return []
    total = int(split["total"])
    parts = [path.with_name(f"{split['stem']}-{i:05d}-of-{total:05d}.gguf") for i in range(2, total + 1)]
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise UserError(f"{path.name} is part 1 of {total}; missing {', '.join(missing)}: download the model again")
    return parts


def vocab_tokens(path: Path) -> list[bytes]:
    """The vocabulary's token strings as stored (tokenizer.ggml.tokens), read from the header."""
    reader = _HeaderReader(Path(path))
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return []
    blob, count = field.parts[-1].tobytes(), int(field.parts[-2][0])
    host_big = sys.byteorder == "big"
    order = "big" if (reader.byte_order == "S") != host_big else "little"  # "S": the file's order is not the host's
    tokens, offset = [], 0
    for _ in range(count):
        length = int.from_bytes(blob[offset : offset + 8], order)
        tokens.append(blob[offset + 8 : offset + 8 + length])
        offset += 8 + length
    return tokens


def check_same_vocab(target: Path, drafter: Path) -> None:
    """The drafter must speak the target's token ids; padding past the shorter vocabulary is tolerated.

    Two files whose stored vocabularies are byte for byte the same (a drafter made from its target, a model family's
    sizes) pass on their header digests alone; only files that differ are compared token by token."""
    if check_gguf(target).vocab_digest == check_gguf(drafter).vocab_digest:
        return
    t, d = vocab_tokens(target), vocab_tokens(drafter)
    common = min(len(t), len(d))
    differing = [i for i in range(common) if t[i] != d[i]]
    extra = t if len(t) > len(d) else d
    unused = [i for i in range(common, len(extra)) if not _is_padding(extra[i])]
    if differing or unused:
        shown = ", ".join(f"{i} ({t[i]!r} vs {d[i]!r})" for i in differing[:3])
        detail = f"{len(differing)} tokens differ, first {shown}" if differing else (
            f"sizes differ ({len(t)} vs {len(d)}) beyond padding")
        raise UserError(f"drafter {Path(drafter).name} does not share the target's vocabulary ({detail}); "
                        "pick a drafter from the same model family")


def _is_padding(text: bytes) -> bool:
    return text.startswith((b"[PAD", b"<pad", b"<|reserved", b"<unused", b"<|PAD"))


def _matmul_weight_types(tensors: tuple[HeaderTensor, ...]) -> frozenset[str]:
    # 1-D tensors (norms, biases) are not matmuls; nor is the token embedding when a separate output head
    # exists (then it is only a row lookup). Tied, it is the LM head and counts.
    names = {tensor.name for tensor in tensors}
    lookup_only = {"token_embd.weight"} if "output.weight" in names else set()
    return frozenset(t.type_name for t in tensors if len(t.shape) >= 2 and t.name not in lookup_only)


def _string(fields: dict[str, Any], key: str) -> str | None:
    value = fields.get(key)
    return value if isinstance(value, str) else None


def _scalar(fields: dict[str, Any], key: str) -> Any:
    value = fields.get(key)
    return None if isinstance(value, str) else value


def _file_type_name(value: int | None) -> str | None:
    try:
        return None if value is None else LlamaFileType(value).name
    except ValueError:
        return None


# The sampling a model's authors recommend, as llama.cpp reads it from general.sampling.*: key -> SamplingConfig field.
RECOMMENDED_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                        "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                        "general.sampling.penalty_repeat": "repeat_penalty",
                        "general.sampling.penalty_last_n": "repeat_last_n"}


def recommended_sampling(path: str | Path) -> dict[str, float | int]:
    """The file's general.sampling.* values that are numbers, by SamplingConfig field (empty when it has none)."""
    scalars = gguf_header(path).scalars
    found: dict[str, float | int] = {}
    for key, name in RECOMMENDED_SAMPLING.items():
        value = scalars.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            found[name] = int(value) if name in ("top_k", "repeat_last_n") else float(value)
    return found
