"""Thin owners of llama.cpp's native objects (model, context, batch).

With ggml_calls.py (ggml's calls the bindings leave out), where edge-spec calls llama.cpp's C API (through
llama-cpp-python's ctypes bindings). Each class frees what it allocates and turns llama.cpp's error codes into
exceptions; everything above works with ints, bytes and numpy arrays.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import llama_cpp.llama_cpp as ll
import numpy as np
from edge.offload import libc
from edge.runtimes import default_threads
from edge.runtimes.llama_cpp.ggml_calls import (
    LayerHook,
    Threadpool,
    keep_dropped_interrupts,
    layer_callback,
    raise_dropped_interrupt,
)
from edge.runtimes.llama_cpp.kernels import mark_ran, prefer_invariant_kernels

from edge.errors import UserError
from edge.protocols import SpecialTokens

prefer_invariant_kernels()  # before any model runs: ggml reads the switches at its first matmul

# The largest seq id llama.cpp accepts in one context (LLAMA_MAX_SEQ); a tree gets one seq per leaf.
MAX_SEQ = 256
SPECIAL_RUN = 64  # special tokens per llama_tokenize call (tokenize)

KV_TYPES = {
    "f32": ll.GGML_TYPE_F32,
    "f16": ll.GGML_TYPE_F16,
    "bf16": 30,  # GGML_TYPE_BF16
    "q8_0": ll.GGML_TYPE_Q8_0,
    "q4_0": ll.GGML_TYPE_Q4_0,
    "q4_1": ll.GGML_TYPE_Q4_1,
    "q5_0": ll.GGML_TYPE_Q5_0,
    "q5_1": ll.GGML_TYPE_Q5_1,
}

FTYPES = {
    "f32": ll.LLAMA_FTYPE_ALL_F32,
    "f16": ll.LLAMA_FTYPE_MOSTLY_F16,
    "bf16": ll.LLAMA_FTYPE_MOSTLY_BF16,
    "q8_0": ll.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_0": ll.LLAMA_FTYPE_MOSTLY_Q4_0,
    "q4_1": ll.LLAMA_FTYPE_MOSTLY_Q4_1,
    "q5_0": ll.LLAMA_FTYPE_MOSTLY_Q5_0,
    "q5_1": ll.LLAMA_FTYPE_MOSTLY_Q5_1,
    "q2_k": ll.LLAMA_FTYPE_MOSTLY_Q2_K,
    "q3_k_s": ll.LLAMA_FTYPE_MOSTLY_Q3_K_S,
    "q3_k_m": ll.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "q3_k_l": ll.LLAMA_FTYPE_MOSTLY_Q3_K_L,
    "q4_k_s": ll.LLAMA_FTYPE_MOSTLY_Q4_K_S,
    "q4_k_m": ll.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "q5_k_s": ll.LLAMA_FTYPE_MOSTLY_Q5_K_S,
    "q5_k_m": ll.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "q6_k": ll.LLAMA_FTYPE_MOSTLY_Q6_K,
}

_backend_ready = False


@ll.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp logs every load step to stderr; errors reach the user as exceptions instead.
    if os.environ.get("EDGE_SPEC_LLAMA_LOG"):
        os.write(2, text)


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        keep_dropped_interrupts()  # a Ctrl-C landing in _quiet_log or a layer callback: raised after the call
        ll.llama_log_set(_quiet_log, ctypes.c_void_p(0))
        ll.llama_backend_init()
        _backend_ready = True


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags ("avx2", "avx512f", "amx_int8"...): /proc/cpuinfo's first `flags` line, else none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            return frozenset(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    except OSError:
        return frozenset()


# llama.cpp's AMX weight buffers (Sapphire Rapids and later) crash in ggml_backend_amx_mul_mat on the first batch
# of more than one token (ggml-org/llama.cpp#20824, unfixed in the 0.3.36 build): on such CPUs the weights stay in
# plain CPU buffers. The same switch turns off the repacked Q4_0 kernels there, which only cost speed.
USE_EXTRA_BUFFERS = "amx_int8" not in cpu_flags()


# a new anonymous mapping this large, made while a model loads, holds its repacked weights; while a context is made,
# its KV cache
LARGE_REGION = 8 << 20


def large_regions_since(before: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """The anonymous memory mapped since `before` (libc.anonymous_regions()), in regions of LARGE_REGION or more."""
    return [(start, end) for start, end in libc.new_memory(before) if end - start >= LARGE_REGION]


def load_mode(use_mmap: bool, use_mlock: bool) -> int:
    """llama.cpp's load mode: the file mapped (its default, AUTO: mapped on the CPU) or read into its buffers, and
    the weights locked in RAM or not."""
    if use_mlock:
        return ll.LLAMA_LOAD_MODE_MMAP_MLOCK if use_mmap else ll.LLAMA_LOAD_MODE_MLOCK
    return ll.LLAMA_LOAD_MODE_AUTO if use_mmap else ll.LLAMA_LOAD_MODE_NONE


def _filled(params: ctypes.Structure, **values: object) -> ctypes.Structure:
    """llama.cpp's parameter struct with these fields set. A name the struct lacks is an error: ctypes would keep it
    as a Python attribute llama.cpp never sees (llama-cpp-python renames fields between versions: use_mmap and
    use_mlock became load_mode)."""
    fields = {field[0] for field in type(params)._fields_}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise RuntimeError(f"llama-cpp-python's {type(params).__name__} has no field {', '.join(unknown)}: "
                           "install the version edge-spec pins")
    for name, value in values.items():
        setattr(params, name, value)
    return params


class Model:
    """A loaded GGUF model: weights and vocabulary."""

    def __init__(self, path: Path, n_gpu_layers: int = 0, use_mmap: bool = True, use_mlock: bool = False,
                 repack: bool = True, vocab_only: bool = False):
        _init_backend()
        repacked = USE_EXTRA_BUFFERS and repack and not vocab_only
        params = _filled(ll.llama_model_default_params(),
                         vocab_only=vocab_only,  # a tokenizer: the vocabulary and its special tokens, no weights read
                         n_gpu_layers=n_gpu_layers, load_mode=load_mode(use_mmap, use_mlock),
                         use_extra_bufts=repacked)  # repacked weights are copies in RAM, not the mapping
        self.path = path
        with libc.collection_paused():
            before = libc.anonymous_regions() if repacked else set()
            self._ptr = ll.llama_model_load_from_file(str(path).encode(), params)
            new = large_regions_since(before) if repacked else []
        if not self._ptr:
            raise UserError(f"llama.cpp could not load {path} (unsupported architecture or damaged file); "
                            "set EDGE_SPEC_LLAMA_LOG=1 to see its log")
        # The repacked weights are read through on every pass from llama.cpp's own allocations, on small pages (the
        # file's mapping is on the page cache's large folios already): huge pages make a one-token pass of
        # Qwen2.5-Coder-1.5B ~5% faster here (docs/plan.md). Only regions the load made, of LARGE_REGION or more.
        self.huge_page_bytes = libc.collapse_to_huge_pages(new)
        self._vocab = ll.llama_model_get_vocab(self._ptr)
        self.n_vocab: int = ll.llama_vocab_n_tokens(self._vocab)
        self.bos: int = ll.llama_vocab_bos(self._vocab)
        self.eos: int = ll.llama_vocab_eos(self._vocab)
        self.add_bos: bool = bool(ll.llama_vocab_get_add_bos(self._vocab))
        self.add_eos: bool = bool(ll.llama_vocab_get_add_eos(self._vocab))
        self._specials: re.Pattern[str] | None = None  # the special tokens' texts, longest first (tokenize)
        self._attributed: list[int] | None = None  # _attributed_special's tokens
        self._pieces = threading.local()  # a buffer per thread: a server's lanes detokenize at once
        raise_dropped_interrupt()  # a Ctrl-C while it loaded (the model is freed with this object)

    @property
    def ptr(self) -> ll.llama_model_p:
        return self._ptr

    def close(self) -> None:
        if self._ptr:
            ll.llama_model_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        self.close()

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = ll.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):  # a long chat template: ask again with room for all of it
            buf = ctypes.create_string_buffer(n + 1)
            ll.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """The text's tokens. With parse_special, special tokens written in the text become those tokens; llama.cpp
        partitions a text on them in time quadratic in their count (16,000 `<|im_end|>` cost seconds), so a text
        with many is tokenized SPECIAL_RUN of them at a time, cut just after one: text between special tokens is
        tokenized on its own in any case, so the tokens are the same."""
        if parse_special and len(text) > SPECIAL_RUN:
            cuts = self._special_cuts(text)
            if cuts:
                ends = [*cuts, len(text)]
                tokens = [t for start, end in zip([0, *cuts], ends, strict=True)
                          for t in self._tokenize(text[start:end], False, True)]
                if add_special:  # BOS and EOS once, around the whole text, as llama.cpp adds them
                    tokens = [self.bos] * (self.add_bos and self.bos >= 0) + tokens + \
                        [self.eos] * (self.add_eos and self.eos >= 0)
                return tokens
        return self._tokenize(text, add_special, parse_special)

    def _special_cuts(self, text: str) -> list[int]:
        """Offsets just after every SPECIAL_RUN-th special token in `text` (none if it has fewer), skipping a cut
        followed by whitespace (a special token may strip the whitespace beside it)."""
        if self._specials is None:  # the tokens llama.cpp partitions on (less reserved ones: a subset cuts as well)
            texts = sorted({self.token_text(t).decode("utf-8", "replace") for t in self._attributed_special()} - {""},
                           key=len, reverse=True)
            self._specials = re.compile("|".join(map(re.escape, texts))) if texts else re.compile(r"(?!)")
        cuts, count = [], 0
        for match in self._specials.finditer(text):
            count += 1
            end = match.end()
            if count >= SPECIAL_RUN and end < len(text) and not text[end].isspace():
                cuts.append(end)
                count = 0
        return cuts

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        out = (ll.llama_token * capacity)()
        n = ll.llama_tokenize(self._vocab, data, len(data), out, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            out = (ll.llama_token * capacity)()
            n = ll.llama_tokenize(self._vocab, data, len(data), out, capacity, add_special, parse_special)
        return list(out[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        piece = getattr(self._pieces, "buffer", None)
        if piece is None:
            piece = self._pieces.buffer = ctypes.create_string_buffer(256)
        n = ll.llama_token_to_piece(self._vocab, token, piece, len(piece), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            return buf.raw[:n]
        return piece.raw[:n]

    def token_text(self, token: int) -> bytes:
        """The vocabulary entry itself (what tokenizers compare), not its rendering."""
        return ll.llama_vocab_get_text(self._vocab, token) or b""

    def special(self) -> SpecialTokens:
        """BOS, EOS, end of turn and their text; the end-of-generation tokens; and every special token: control,
        user-defined and unknown ones, those, BOS, EOS and EOT. Reserved slots (Gemma's 6242 `<unusedN>`, marked
        UNUSED) are left out: no model emits them."""
        vocab = self._vocab
        eot = ll.llama_vocab_eot(vocab)
        stop = frozenset(t for t in range(self.n_vocab) if ll.llama_vocab_is_eog(vocab, t))
        found = set(self._attributed_special())
        named = {t for t in (self.bos, self.eos, eot) if t >= 0}

        def text(token: int) -> str:
            return self.token_bytes(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

        return SpecialTokens(self.bos, self.eos, eot, stop, frozenset(found | stop | named), text(self.bos),
                             text(self.eos))

    def _attributed_special(self) -> list[int]:
        """The tokens marked control, user-defined or unknown (llama.cpp's special tokens), less reserved slots; asked
        once per model (a pass over the whole vocabulary: 65 ms for Qwen's 151,936 tokens)."""
        if self._attributed is not None:
            return self._attributed
        special = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_USER_DEFINED | ll.LLAMA_TOKEN_ATTR_UNKNOWN
        self._attributed = [t for t in range(self.n_vocab)
                            if (attr := ll.llama_vocab_get_attr(self._vocab, t)) & special
                            and not attr & ll.LLAMA_TOKEN_ATTR_UNUSED]
        return self._attributed

    def ranked_tokens(self) -> np.ndarray:
        """int64 ids of the ordinary (normal and byte) tokens, most frequent first by the tokenizer's own
        ranking: its scores (a unigram model's log-probabilities, or minus the merge rank) and then its ids
        (a BPE vocabulary numbers its merges in order). The tokenizer was trained on a far larger corpus than
        any calibration run, so this ranks the long tail a calibration never sees."""
        ordinary, unused = ll.LLAMA_TOKEN_ATTR_NORMAL | ll.LLAMA_TOKEN_ATTR_BYTE, ll.LLAMA_TOKEN_ATTR_UNUSED
        attrs = np.array([ll.llama_vocab_get_attr(self._vocab, t) for t in range(self.n_vocab)], np.int64)
        ids = np.flatnonzero((attrs & ordinary != 0) & (attrs & unused == 0)).astype(np.int64)
        scores = np.array([ll.llama_vocab_get_score(self._vocab, int(t)) for t in ids], np.float64)
        return ids[np.lexsort((ids, -scores))]


class Context:
    """A llama.cpp context: one unified KV cache shared by up to MAX_SEQ sequences."""

    def __init__(self, model: Model, n_ctx: int, n_batch: int, kv_type: str = "f16",
                 n_threads: int | None = None, flash_attn: bool | None = None, op_offload: bool = True,
                 n_outputs: int = 0, on_layer: LayerHook | None = None, sequences: int = MAX_SEQ,
                 threadpool: bool = False, unified: bool = True):
        threads = n_threads or default_threads()
        params = _filled(
            ll.llama_context_default_params(), n_ctx=n_ctx,
            # One tree must be one micro-batch, or an offloaded target streams its weights once per micro-batch.
            n_batch=n_batch, n_ubatch=n_batch,
            n_seq_max=sequences,  # a tree's branches (MAX_SEQ), or 1 for plain decoding alone
            # 0: n_batch rows of logits (a 262k vocabulary makes that large); never fewer than n_seq_max, which
            # llama.cpp reserves its output buffer for whatever is asked (and asserts on otherwise)
            n_outputs_max=max(n_outputs, sequences) if n_outputs else 0,
            # unified: tree branches share the committed prefix's cells; else each sequence has a KV stream of its
            # own (n_ctx cells each), as llama-server's slots: its cells stay in position order whatever the others do
            kv_unified=unified,
            swa_full=True,  # keep sliding-window layers' full history, so rejected branches can be removed
            n_threads=threads, n_threads_batch=threads, type_k=KV_TYPES[kv_type], type_v=KV_TYPES[kv_type],
            op_offload=op_offload, no_perf=True)
        # on_layer(i) as each layer of a pass is computed (layer_callback); kept referenced while the context lives
        self._callback = None if on_layer is None else layer_callback(on_layer, on_layer.active)
        if self._callback is not None:
            _filled(params, cb_eval=self._callback)
        if flash_attn is not None:
            enabled, disabled = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED, ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
            _filled(params, flash_attn_type=enabled if flash_attn else disabled)
        self.model = model
        self._settings = {"n_ctx": n_ctx, "n_batch": n_batch, "kv_type": kv_type, "n_threads": n_threads,
                          "flash_attn": flash_attn, "op_offload": op_offload, "n_outputs": n_outputs,
                          "on_layer": on_layer, "sequences": sequences, "threadpool": threadpool, "unified": unified}
        with libc.collection_paused():
            before = libc.anonymous_regions()
            self._ptr = ll.llama_init_from_model(model.ptr, params)
            new = large_regions_since(before)
        # llama.cpp clears the KV cache it allocates (zeros, against NaNs in cells no pass has written), which commits
        # all of it: 112 MiB for Qwen2.5-Coder-1.5B's 4096 f16 cells. Those pages are given back (they read as zeros
        # again), so the cache takes memory as cells are written: 28 KiB a token there, not the whole context at once.
        # A streamed target's plan counts on it (offload/plan.py, KV_RESERVE_CELLS). Only mappings of LARGE_REGION or
        # more that the context made; while another model loads beside it, once both are loaded (0 here).
        self.released_bytes = libc.release_new_zero_pages(new) if self._ptr else 0
        if not self._ptr:
            raise UserError(f"llama.cpp could not create a context of {n_ctx} tokens with a {kv_type} KV cache "
                            f"for {model.path.name}; lower ctx or use another KV type", "ctx")
        # `threadpool`: the passes keep their worker threads (a target decoding alone, as llama.cpp's programs run it;
        # beside a drafter, threads polling for the next pass would take the drafter's cores)
        self._threadpool = Threadpool(threads) if threadpool else None
        if self._threadpool is not None:
            self._threadpool.attach(self._ptr)
        self.n_ctx: int = ll.llama_n_ctx(self._ptr)
        self.n_batch: int = ll.llama_n_batch(self._ptr)  # llama.cpp clamps it to the context size
        self._mem = ll.llama_get_memory(self._ptr)
        raise_dropped_interrupt()

    @property
    def settings(self) -> dict:
        """What the context was made with (Context's arguments but the model)."""
        return dict(self._settings)

    def close(self) -> None:
        if self._ptr:
            ll.llama_free(self._ptr)
            self._ptr = None
        if getattr(self, "_threadpool", None) is not None:
            self._threadpool.close()
            self._threadpool = None

    def __del__(self) -> None:
        self.close()

    def resized(self, **changes: int) -> Context:
        """A new context over the same model with these settings changed (n_ctx, n_batch, n_outputs), its KV cache
        empty. This one is closed first, so its KV cache and logits are freed before the new ones are allocated."""
        settings = {**self._settings, **changes}
        self.close()
        return Context(self.model, **settings)

    def decode(self, batch: Batch) -> None:
        mark_ran()  # ggml reads its kernel switches now (kernels.py)
        rc = ll.llama_decode(self._ptr, batch.struct)
        raise_dropped_interrupt()
        if rc == 1:
            raise RuntimeError("llama_decode: no KV cache slot for the batch (context full)")
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")

    def logits(self, n_rows: int) -> np.ndarray:
        """A view of the last decode's output logits: [n_rows, n_vocab] float32, valid until the next decode."""
        ptr = ll.llama_get_logits(self._ptr)
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.model.n_vocab))

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        if not ll.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise RuntimeError(f"KV cache cannot remove positions [{p0}, {p1}) of seq {seq}")

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        ll.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        return ll.llama_memory_seq_pos_max(self._mem, seq)

    def seq_pos_min(self, seq: int) -> int:
        return ll.llama_memory_seq_pos_min(self._mem, seq)

    def save_seq(self, seq: int, path: Path, tokens: Sequence[int]) -> int:
        """Write `seq`'s cells, and the `tokens` they hold, to `path` (llama.cpp's sequence state file): its bytes."""
        held = (ctypes.c_int32 * len(tokens))(*tokens)
        written = ll.llama_state_seq_save_file(self._ptr, os.fsencode(path), seq, held, len(tokens))
        if written == 0:
            raise RuntimeError(f"llama.cpp could not write seq {seq}'s state to {path}")
        return int(written)

    def load_seq(self, seq: int, path: Path, capacity: int) -> list[int]:
        """Put the cells a save_seq file holds into `seq` (empty before), in the lowest free cells: the tokens they
        hold (at most `capacity`)."""
        tokens, count = (ctypes.c_int32 * capacity)(), ctypes.c_size_t(0)
        if ll.llama_state_seq_load_file(self._ptr, os.fsencode(path), seq, tokens, capacity, ctypes.byref(count)) == 0:
            raise RuntimeError(f"llama.cpp could not read a seq state from {path}")
        return list(tokens[: count.value])



class Batch:
    """A llama_batch whose arrays are numpy buffers we own (so filling it is whole-array numpy)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.zeros(capacity, np.int32)
        self.seq_id = np.zeros((capacity, MAX_SEQ), np.int32)  # [capacity, MAX_SEQ]: row i lists token i's seqs
        self.output = np.zeros(capacity, np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        row_bytes = self.seq_id.strides[0]
        self._rows = (i32p * capacity)(
            *[ctypes.cast(self.seq_id.ctypes.data + i * row_bytes, i32p) for i in range(capacity)])
        self.struct = ll.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(i32p),
            embd=None,
            pos=self.pos.ctypes.data_as(i32p),
            n_seq_id=self.n_seq_id.ctypes.data_as(i32p),
            seq_id=ctypes.cast(self._rows, ctypes.POINTER(i32p)),
            logits=self.output.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def fill(self, tokens: Sequence[int] | np.ndarray, pos: np.ndarray | int, seq: int = 0,
             outputs: np.ndarray | bool = False) -> None:
        """Tokens that all belong to one seq; `pos` is an array or the first position of a run."""
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"batch of {n} tokens exceeds capacity {self.capacity}")
        self.token[:n] = tokens
        self.pos[:n] = pos if isinstance(pos, np.ndarray) else np.arange(pos, pos + n)
        self.n_seq_id[:n] = 1
        self.seq_id[:n, 0] = seq
        self.output[:n] = outputs
        self.struct.n_tokens = n

    def pad(self, rows: int, seq: int, outputs: int | None = None) -> None:
        """Rows past the batch's tokens up to `rows`, in `seq` (an empty sequence of their own, from position 0), for
        kernels that change with a pass's rows (kernels.lane_padding). The first `outputs` of them output (None:
        each), after the batch's own outputs: the last layer and the head run on the output rows alone."""
        n = self.struct.n_tokens
        self.token[n:rows] = self.token[0]
        self.pos[n:rows] = np.arange(rows - n)
        self.n_seq_id[n:rows] = 1
        self.seq_id[n:rows, 0] = seq
        self.output[n:rows] = 0
        self.output[n: n + (rows - n if outputs is None else outputs)] = 1
        self.struct.n_tokens = rows

    def take(self, other: Batch, rows: np.ndarray) -> None:
        """This batch made of `other`'s rows `rows` (indices, in order): tokens, positions, seqs and outputs."""
        n = len(rows)
        self.token[:n], self.pos[:n], self.output[:n] = other.token[rows], other.pos[rows], other.output[rows]
        self.n_seq_id[:n], self.seq_id[:n] = other.n_seq_id[rows], other.seq_id[rows]
        self.struct.n_tokens = n

    def set_seqs(self, membership: np.ndarray, at: int = 0, first_seq: int = 0) -> None:
        """membership: [n_tokens, n_seqs] bool; token at + i belongs to every seq first_seq + j where
        membership[i, j]."""
        rows, cols = np.nonzero(membership)
        counts = membership.sum(axis=1)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        self.n_seq_id[at: at + len(counts)] = counts
        self.seq_id[at + rows, np.arange(len(rows)) - starts[rows]] = first_seq + cols


def quantize(src: Path, dest: Path, ftype: str, n_threads: int | None = None) -> None:
    """Requantize a GGUF file with llama.cpp's own quantizer (llama_model_quantize)."""
    _init_backend()
    params = _filled(ll.llama_model_quantize_default_params(), ftype=FTYPES[ftype], allow_requantize=True,
                     nthread=n_threads or default_threads())
    rc = ll.llama_model_quantize(str(src).encode(), str(dest).encode(), ctypes.byref(params))
    raise_dropped_interrupt()
    if rc != 0:
        raise UserError(f"llama.cpp could not quantize {src} to {ftype} (code {rc})")
