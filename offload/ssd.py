"""The SSD regime: a target's weights mmap'd and streamed from the disk by the kernel.

On a machine whose RAM could hold the target, `--placement ssd` makes every target pass read the disk as it
would for a model bigger than RAM: after each pass the target's weight pages are evicted
(`madvise(MADV_DONTNEED)` unmaps them from llama.cpp's read-only mapping, then `posix_fadvise(DONTNEED)` drops
them from the page cache). The bytes the process really read from storage (/proc/self/io) prove it.

Overlap: while the drafter grows the next tree (run_round calls the target's `prefetch`), a thread
reads the weights ahead with `madvise(MADV_POPULATE_READ)` on the target's own mapping, in the order the
pass uses them (layer by layer; the embedding table as `readahead_order` says). That both reads the pages and
maps them, so the pass neither waits on the disk nor takes a fault per page, and no byte is copied into
Python. It does not run during plain decoding, where it would race the pass's own page faults. As a pass
starts, the embedding rows of its tokens are asked for all at once (`fetch_rows`), not one page fault after
another. The ways of evicting and reading that were tried, measured: docs/performance-log.md, "The SSD regime".
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from edge.offload import libc
from edge.offload.libc import MADV_DONTNEED, MADV_POPULATE_READ

from edge.protocols import Target, TargetWrapper
from edge.tree import TokenTree

READAHEAD_CHUNK = 16 << 20  # bytes per populate call: small enough to stop soon when cancelled
HEAD_FIRST_SHARE = 0.25  # a tied embedding table up to this share of the weights is read ahead first


def read_bytes() -> int | None:
    """Bytes this process has caused to be read from storage (all threads), None where the OS will not say."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def mapped_ranges(path: Path) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of this process's mappings of `path`, from /proc/self/maps."""
    real = str(Path(path).resolve())
    ranges = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == real:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end, int(fields[2], 16)))
    return ranges


def resident_fraction(path: Path) -> float:
    """Fraction of the file's pages in the page cache (mincore over a fresh read-only mapping); 0 where the OS
    will not say."""
    size = Path(path).stat().st_size
    if size == 0:
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        with libc.mapped(fd, size) as address:
            return float(libc.resident_pages(address, size).mean())
    except OSError:
        return 0.0
    finally:
        os.close(fd)


@dataclass(frozen=True)
class TensorRange:
    name: str
    offset: int  # bytes from the start of the file
    size: int
    rows: int = 1  # the tensor's rows (every dimension but the first, GGUF's ne[0]); each takes size // rows bytes


def pass_order(path: Path) -> list[TensorRange]:
    """The file's tensor byte ranges in the order a forward pass reads them: layers 0..N, then the head."""
    from edge.runtimes.gguf_file import open_reader

    reader = open_reader(path)  # the header alone: a 262k-token vocabulary's strings are skipped, not parsed
    ranges = [TensorRange(t.name, int(t.data_offset), int(t.n_bytes), int(np.prod(t.shape[1:], dtype=np.int64)))
              for t in reader.tensors]
    del reader

    def key(r: TensorRange) -> tuple[int, int]:
        match = re.match(r"blk\.(\d+)\.", r.name)
        return (int(match.group(1)), r.offset) if match else (1 << 30, r.offset)

    return sorted(ranges, key=key)


def embedding_table(order: list[TensorRange]) -> TensorRange | None:
    return next((t for t in order if t.name == "token_embd.weight"), None)


def readahead_order(order: list[TensorRange]) -> list[TensorRange]:
    """What the readahead reads for a pass, in order (`order`: pass_order's). A pass gathers its tokens' rows of
    the embedding table first; only a tied table (no output.weight) is read whole again, as the head, at its end:
    - untied: the table is left out (the pass reads just its rows; SsdStreamer.fetch_rows queues them);
    - tied and at most HEAD_FIRST_SHARE of the weights: read first, so the rows are in RAM when the pass starts
      and the head's short compute waits only for the last layer (SmolLM2-135M, 21%);
    - tied and larger: read last, so that the head's long compute overlaps its own reading (Gemma-3-270M, 62%).
    `benchmarks/ssd_timeline.py --table first|last` measures either order (docs/performance.md).
    """
    table = embedding_table(order)
    if table is None:
        return order
    rest = [t for t in order if t is not table]
    if any(t.name == "output.weight" for t in order):
        return rest
    if table.size <= HEAD_FIRST_SHARE * sum(t.size for t in order):
        return [table, *rest]
    return order


class SsdStreamer:
    """Evicts a mapped target file after each pass and (optionally) reads it ahead for the next one."""

    def __init__(self, path: Path, readahead: bool = True):
        self.path = Path(path)
        self.readahead = readahead
        self.window: int | None = None  # the whole file is read ahead (offload/window.py: a window of it)
        self._fd = os.open(self.path, os.O_RDONLY)
        self._maps = mapped_ranges(self.path)  # the target is loaded: its mapping stays put from here on
        order = pass_order(self.path) if readahead else []
        self._ranges = self._address_ranges(readahead_order(order))
        embedding = embedding_table(order)
        self._embedding = None if embedding is None else (embedding.offset, embedding.size // embedding.rows,
                                                          embedding.rows)
        self._stop = threading.Event()
        self._go = threading.Event()
        self._evicted = threading.Event()
        self._evicted.set()
        self._thread: threading.Thread | None = None
        # perf_counter() stamps of the last few passes' eviction and readahead ("evicted", "evicted_end",
        # "prefetch", "read", "read_end"), newest last; benchmarks/ssd_timeline.py shows where a round's time goes
        self.timeline: deque[dict[str, float]] = deque(maxlen=4)

    def evict(self) -> None:
        """Drop the target's weight pages from RAM, so the next pass reads them from the disk."""
        self._cancel_readahead()
        self._drop_pages()

    def _drop_pages(self) -> None:
        for start, end, _ in self._maps:
            with contextlib.suppress(OSError):  # raised in the eviction thread, it would leave wait_evicted hanging
                libc.madvise(start, end - start, MADV_DONTNEED)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def after_pass(self, evict: bool = True) -> None:
        """From a thread: evict the weights now (unless told not to: the kernel keeps what it can), then read them
        ahead once `prefetch()` says a tree is being grown (plain decoding never waits on it: a pass racing its own
        readahead ran slower here)."""
        self._cancel_readahead()
        self._stop.clear()
        self._go.clear()
        self._evicted.clear()
        self.timeline.append({"evicted": time.perf_counter()})
        self._thread = threading.Thread(target=self._evict_then_read, args=(self.timeline[-1], evict),
                                        name="edge-spec-readahead", daemon=True)
        self._thread.start()

    def prefetch(self) -> None:
        """The drafter starts growing the next tree: start reading the weights for its pass."""
        if self.readahead:
            if self.timeline:
                self.timeline[-1]["prefetch"] = time.perf_counter()
            self._go.set()

    def fetch_rows(self, tokens: Sequence[int] | np.ndarray) -> None:
        """A pass over `tokens` starts by gathering their embedding rows. Where the readahead has not read
        them (a large tied table is read last, an untied one not at all), each row would be one page fault after
        the other (with a read of the pages around it). posix_fadvise(WILLNEED) per row queues just their reads,
        all at once."""
        if not self.readahead or self._embedding is None:
            return
        offset, row_bytes, rows = self._embedding
        for token in np.unique(np.asarray(tokens, np.int64)):
            if 0 <= token < rows:
                os.posix_fadvise(self._fd, offset + int(token) * row_bytes, row_bytes, os.POSIX_FADV_WILLNEED)

    def _evict_then_read(self, stamps: dict[str, float], evict: bool = True) -> None:
        if evict:
            self._drop_pages()
        stamps["evicted_end"] = time.perf_counter()
        self._evicted.set()
        self._go.wait()
        if not self._stop.is_set():
            stamps["read"] = time.perf_counter()
            self._read_ahead()
            if not self._stop.is_set():
                stamps["read_end"] = time.perf_counter()

    def wait_evicted(self) -> None:
        """Block until the last eviction is done: a pass must never start on the previous pass's pages."""
        self._evicted.wait()

    def read_ahead_now(self) -> None:
        """Evict, then read the whole file ahead before returning (a pass after it finds every weight in RAM)."""
        self.evict()
        self._read_all()

    def time_read_ahead(self) -> float:
        """Seconds to read the whole file ahead from the disk (evicted first and after), measured now."""
        self.evict()
        start = time.perf_counter()
        self._read_all()
        elapsed = time.perf_counter() - start
        self.evict()
        return elapsed

    def _read_all(self) -> None:
        self._stop.clear()
        self._read_ahead()

    def _read_ahead(self) -> None:
        for start, end in self._ranges:
            for address in range(start, end, READAHEAD_CHUNK):
                if self._stop.is_set():
                    return
                try:
                    libc.madvise(address, min(READAHEAD_CHUNK, end - address), MADV_POPULATE_READ)
                except OSError:
                    self.readahead = False  # an older kernel: the pass reads the disk itself
                    return

    def _address_ranges(self, order: list[TensorRange]) -> list[tuple[int, int]]:
        """The tensors' page-aligned address ranges in the target's mapping, in pass order."""
        import mmap

        ranges = []
        for tensor in order:
            for start, end, file_offset in self._maps:
                first = start + tensor.offset - file_offset
                if start <= first < end:
                    first -= first % mmap.PAGESIZE
                    ranges.append((first, min(end, start + tensor.offset + tensor.size - file_offset)))
                    break
        return ranges

    def _cancel_readahead(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._go.set()  # wakes a thread still waiting to read
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self._cancel_readahead()
        os.close(self._fd)


class SsdTarget(TargetWrapper):
    """A Target whose weights stream from the SSD: every pass starts with the weights out of RAM.

    Wraps a target whose runtime streams (mmap'd, not locked, not repacked); prefill and verify passes are followed
    by an eviction (from a thread; the next pass waits for it), and with readahead, `prefetch()` (called as a round
    starts growing its tree) reads the weights for the next pass while the drafter works.
    """

    def __init__(self, target: Target, path: Path, readahead: bool = True, streamer: SsdStreamer | None = None):
        super().__init__(target)
        self.ssd = streamer or SsdStreamer(path, readahead)
        self.ssd.evict()

    @property
    def streamer(self) -> SsdStreamer:
        return self.ssd

    def prefill(self, tokens: Sequence[int]) -> None:
        self.ssd.wait_evicted()
        self.ssd.fetch_rows(tokens)
        self.inner.prefill(tokens)
        self.ssd.after_pass()

    def verify(self, tree: TokenTree) -> np.ndarray:
        self.ssd.wait_evicted()
        self.ssd.fetch_rows(tree.tokens)
        logits = self._pass(tree)
        self.ssd.after_pass()
        return logits

    def _pass(self, tree: TokenTree) -> np.ndarray:
        """The inner target's pass over the tree, its weights fetched (a subclass times it)."""
        return self.inner.verify(tree)

    def prefetch(self) -> None:
        """A tree is about to be grown: read the weights for its pass meanwhile."""
        self.ssd.prefetch()

    def close(self) -> None:
        self.ssd.close()
        self.inner.close()
