"""A target larger than the memory it may use (a memory limit's room, or the machine's RAM): its weights read ahead in
a window that follows the pass.

Where the plan streams a target, the kernel reads its weights by page faults on every pass, one fault after another
in the computing threads: about half the drive's speed (docs/performance-log.md, "under a memory cap"). The SSD regime's
read-ahead (offload/ssd.py) reads the whole file ahead while the drafter grows a tree; with less room than the file,
that reading evicts its own first pages before the pass gets to them. Here the read-ahead holds at most `window`
bytes past the layer the pass has computed last:

- the target's runtime says as each layer of a pass is computed (Target.follow_layers; llama.cpp: an eval callback
  on each layer's output), and that layer's pages are dropped at once (the pass is done with them);
- while the drafter grows a tree (`prefetch`), a thread reads the weights in pass order up to the window; once the
  pass starts it goes on, a window ahead of the layers done, so the pass computes on read weights while the drive
  reads the next ones;
- a plain pass (no tree grown, no prefetch) is left to the kernel, as in the SSD regime.

A pass that was read ahead ends with its weights dropped (the next pass reads them again whatever happens: the file
does not fit); a plain pass leaves them to the kernel, which keeps what the memory holds for the next one.

Partial residency: where the memory holds part of the target beside everything else (the plan's `resident_bytes`),
the first tensors in pass order, that many bytes, stay resident: locked (mlock) where the system allows, else read
once and never dropped. Only the rest is streamed: read ahead, followed and dropped behind on every pass, plain ones
too, so the kernel never has to reclaim anything to make room for it. The kernel's own LRU cannot do this: a pass
reads the weights in the same order every time, so the page it needs next is always the one it evicted longest ago.
The resident part comes first so that the pass computes on it while the drive reads the streamed part ahead.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from edge.offload import libc
from edge.offload.libc import MADV_DONTNEED, MADV_POPULATE_READ
from edge.offload.ssd import READAHEAD_CHUNK, SsdStreamer, SsdTarget, pass_order, readahead_order

from edge.protocols import Target

WINDOW_SHARE = 0.5  # of the memory free for the target's pages, what the read-ahead may hold past the pass
PASS_MARGIN = 96 << 20  # bytes a pass still allocates after loading (logits rows, compute buffers): not for pages
# ... for a target decoding plainly (one row of logits): measured, 10.6 MiB more after 32 tokens than once loaded
# (Qwen2.5-Coder-1.5B, benchmarks/load_memory.py)
PLAIN_PASS_MARGIN = 16 << 20


@dataclass(frozen=True)
class Span:
    """One tensor's bytes: its range in the target's mapping and in the file, and the last layer that uses it."""

    start: int
    end: int
    offset: int  # the file offset of `start` (page-aligned, as the mapping is)
    size: int  # the tensor's bytes
    layer: int  # dropped once this layer is computed; the head and a tied token table: n_layers (at the pass's end)


class WindowedStreamer(SsdStreamer):
    """An SsdStreamer whose read-ahead stays `window` bytes ahead of the pass (on_layer says where the pass is); with
    `resident` bytes, the first tensors in pass order stay in RAM (never dropped) and only the rest streams."""

    def __init__(self, path: Path, window: int, resident: int = 0):
        super().__init__(path, readahead=True)
        self.window = window
        self.spans = _split_at(self._spans(), resident)
        self.resident = _resident_prefix(self.spans, resident)  # indices of the spans that stay
        streamed = [span for index, span in enumerate(self.spans) if index not in self.resident]
        self._ranges = [(span.start, span.end) for span in streamed]  # what a whole read-ahead reads
        self.resident_bytes = sum(self.spans[index].size for index in self.resident)
        self.streamed_bytes = sum(span.size for span in streamed)  # what a pass reads from the drive
        # the resident set's whole pages (a page it shares with a streamed tensor streams); each layer's streamed bytes
        # as contiguous runs past them (dropped once the layer is done), and all of them in file order (after a pass)
        self._kept = _whole_pages(_runs([self.spans[index] for index in sorted(self.resident)]))
        self._regions = {layer: [_outside(run, self._kept) for run in runs]
                         for layer, runs in _regions(streamed).items()}
        self._streamed_runs = [_outside(run, self._kept) for run in _runs(streamed)]
        self.locked = self._keep_resident()
        self._moved = threading.Condition()
        self._done = -1  # the last layer of the running pass computed (-1: none yet)
        self._read: set[int] = set()  # the spans asked for this pass and not dropped yet
        self._asked = 0  # spans asked for so far, in pass order (skipped ones included)
        self._following = False  # a read-ahead runs for this pass: its layers are dropped as it computes them

    def _spans(self) -> list[Span]:
        order = readahead_order(pass_order(self.path))
        layers = [_layer(t.name) for t in order]
        n_layers = 1 + max((layer for layer in layers if layer is not None), default=-1)
        spans = []
        for tensor, layer, (start, end) in zip(order, layers, self._address_ranges(order), strict=True):
            offset = tensor.offset - tensor.offset % mmap.PAGESIZE
            spans.append(Span(start, end, offset, tensor.size, n_layers if layer is None else layer))
        return spans

    def _keep_resident(self) -> bool:
        """Read the resident set into RAM, locked where the system allows (mlock needs CAP_IPC_LOCK or a large
        enough RLIMIT_MEMLOCK); True when locked. Unlocked, it is only ever dropped by the kernel under pressure,
        which the streamed part, dropped behind each pass, leaves none of."""
        locked = bool(self._kept)
        for start, end in self._kept:
            if locked:
                try:
                    libc.mlock(start, end - start)
                    continue
                except OSError:
                    locked = False
            with contextlib.suppress(OSError):  # an older kernel: the first pass reads it
                libc.madvise(start, end - start, MADV_POPULATE_READ)
        return locked

    def _drop_pages(self) -> None:
        """Drop the streamed part's pages (the resident set stays): from the mapping, all of it, then from the page
        cache, run by run in file order (a folio of the page cache that straddles two layers' runs is dropped only
        once neither is mapped)."""
        if not self.resident:
            super()._drop_pages()
            return
        for runs in self._regions.values():
            for start, end, _ in runs:
                if end > start:
                    with contextlib.suppress(OSError):
                        libc.madvise(start, end - start, MADV_DONTNEED)
        for start, end, offset in self._streamed_runs:
            if end > start:
                os.posix_fadvise(self._fd, offset, end - start, os.POSIX_FADV_DONTNEED)

    def prefetch(self) -> None:
        """A tree is about to be grown: read the next pass's weights, the window's worth, and follow that pass."""
        with self._moved:
            self._following = True
        super().prefetch()

    def following(self) -> bool:
        """Whether the pass about to run (or running) is followed layer by layer: one read ahead, and with a
        resident set every pass (its streamed part is dropped behind it, plain passes too)."""
        return self._following or bool(self.resident)

    def on_layer(self, layer: int) -> None:
        """From the pass (the target's runtime): `layer` is computed. Its pages go, and the read-ahead moves on."""
        with self._moved:
            if not self.following():
                return
            self._done = layer
            self._read = {index for index in self._read if self.spans[index].layer != layer}
            for start, end, offset in self._regions.get(layer, ()):
                self._drop(start, end, offset)
            self._ask_ahead()
            self._moved.notify_all()

    def after_pass(self, evict: bool = True) -> None:
        """After a pass that was read ahead, its pages go (as in the SSD regime); after a plain one the kernel keeps
        what the memory holds of them, as it would without edge-spec (the next plain pass finds some). With a
        resident set, the next pass's streamed part is read ahead at once, plain pass or not: that pass starts on
        the resident layers, which need no reading, while the drive reads the window past them (Qwen2.5-Coder-1.5B
        under 900 MiB, plain: 2.3 tokens/s without, 2.8 with it and a core left to it, benchmarks/peer_llama_cpp.py)."""
        self._cancel_readahead()
        with self._moved:
            followed = self.following()
            self._reset()
            self._following = False
        super().after_pass(evict and followed)
        if self.resident:
            self.prefetch()

    def read_ahead_now(self) -> None:
        """Drop the weights, then read what a long growth reads before its pass (the window's worth), and follow the
        next pass as after a growth (its layers ask for the rest as they are done)."""
        self.evict()
        with self._moved:
            self._reset()
            self._following = True
        self._stop.clear()
        self._read_ahead(wait=False)

    def _read_all(self) -> None:
        """The whole file, in pass order, window or not (how long reading it takes: Costs.read_ahead_ms)."""
        self._stop.clear()
        super()._read_ahead()

    def _reset(self) -> None:
        self._done, self._read, self._asked = -1, set(), 0

    def _held(self) -> int:
        """Bytes asked for ahead of the pass: for layers it has not computed yet (the caller holds _moved)."""
        return sum(self.spans[index].size for index in self._read if self.spans[index].layer > self._done)

    def _ask_ahead(self) -> None:
        """Ask the drive for the next spans in pass order (posix_fadvise WILLNEED: large reads, queued at once, no
        waiting) while the window has room; the next layer the pass needs is asked for whatever the window (the pass
        would fault it in anyway). The caller holds _moved."""
        while self._asked < len(self.spans) and not self._stop.is_set():
            span = self.spans[self._asked]
            if span.layer > self._done and self._asked not in self.resident:
                if span.layer > self._done + 1 and self._held() + span.size > self.window:
                    return
                self._read.add(self._asked)
                os.posix_fadvise(self._fd, span.offset, span.end - span.start, os.POSIX_FADV_WILLNEED)
            self._asked += 1

    def _read_ahead(self, wait: bool = True) -> None:
        """Ask for the spans the window has room for, then map each in pass order once it is read (so the pass
        neither waits on the drive nor takes a fault per page), asking for more as the pass moves the window.
        `wait`: a pass follows, whose progress moves the window; otherwise stop where it is full."""
        for index, span in enumerate(self.spans):
            with self._moved:
                self._ask_ahead()
                while index >= self._asked and not self._stop.is_set():
                    if not wait:
                        return
                    self._moved.wait(0.05)
                    self._ask_ahead()
                if self._stop.is_set():
                    return
                if span.layer <= self._done or index in self.resident:  # past it already, or in RAM for good
                    continue
            for address in range(span.start, span.end, READAHEAD_CHUNK):
                if self._stop.is_set():
                    return
                try:
                    libc.madvise(address, min(READAHEAD_CHUNK, span.end - address), MADV_POPULATE_READ)
                except OSError:
                    self.readahead = False  # an older kernel: the pass reads the drive itself
                    return

    def _drop(self, start: int, end: int, offset: int) -> None:
        """Drop a run of the file's pages, mapped at [start, end) from `offset`: from the mapping, then from the page
        cache. A whole layer's run at once: the page cache holds a file in folios of up to some MB, and one that a
        range covers only in part stays."""
        if end <= start:
            return  # (a length of 0 would mean the whole file to fadvise)
        try:
            libc.madvise(start, end - start, MADV_DONTNEED)
        except OSError:
            return
        os.posix_fadvise(self._fd, offset, end - start, os.POSIX_FADV_DONTNEED)


class WindowedTarget(SsdTarget):
    """A Target streamed from its file with a windowed read-ahead (WindowedStreamer); where its runtime cannot say
    which layer a pass is at, with none (the kernel's page faults alone)."""

    def __init__(self, target: Target, path: Path, window: int, resident: int = 0):
        streamer = WindowedStreamer(path, window, resident)
        streamer.readahead = target.follow_layers(streamer.on_layer, streamer.following)
        super().__init__(target, path, streamer=streamer)


def _split_at(spans: list[Span], resident: int) -> list[Span]:
    """The spans with the one the resident set ends in cut in two at a page (the resident set then holds exactly
    what the memory has room for: a large tensor, such as the head read last, need not stream whole because all of
    it does not fit)."""
    total = 0
    for index, span in enumerate(spans):
        if total + span.size > resident:
            cut = span.start + (resident - total) // mmap.PAGESIZE * mmap.PAGESIZE
            if span.start < cut < span.end:
                head = Span(span.start, cut, span.offset, cut - span.start, span.layer)
                tail = Span(cut, span.end, span.offset + cut - span.start, span.end - cut, span.layer)
                return [*spans[:index], head, tail, *spans[index + 1:]]
            return spans
        total += span.size
    return spans


def _resident_prefix(spans: list[Span], resident: int) -> frozenset[int]:
    """The first spans in pass order whose bytes add up to at most `resident`: a pass computes on them while the
    rest, a contiguous sweep of the file's pass, is read ahead."""
    kept, total = [], 0
    for index, span in enumerate(spans):
        if total + span.size > resident:
            break
        kept.append(index)
        total += span.size
    return frozenset(kept)


def _runs(spans: list[Span]) -> list[tuple[int, int, int]]:
    """Spans merged into contiguous runs of the mapping (start, end, file offset), in address order."""
    runs: list[tuple[int, int, int]] = []
    for span in sorted(spans, key=lambda span: span.start):
        if runs and span.start <= runs[-1][1] + mmap.PAGESIZE:
            start, end, offset = runs[-1]
            runs[-1] = (start, max(span.end, end), offset)
        else:
            runs.append((span.start, span.end, span.offset))
    return runs


def _whole_pages(runs: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The whole pages of each run (start is page-aligned; a last page shared with what follows is left out)."""
    kept = [(start, end - end % mmap.PAGESIZE) for start, end, _ in runs]
    return [(start, end) for start, end in kept if end > start]


def _outside(run: tuple[int, int, int], kept: list[tuple[int, int]]) -> tuple[int, int, int]:
    """A streamed run less any page of the resident set (locked: madvise refuses a range holding one) at its ends."""
    start, end, offset = run
    for low, high in kept:
        if low <= start < high:
            offset, start = offset + high - start, high
        if low < end <= high:
            end = low
    return start, max(start, end), offset


def _regions(spans: list[Span]) -> dict[int, list[tuple[int, int, int]]]:
    """Each layer's spans merged into contiguous runs (start, end, file offset): a file keeps a layer's tensors
    together, though not always its layers in order (blk.1 before blk.10 before blk.2, sorted by name)."""
    by_layer: dict[int, list[Span]] = {}
    for span in spans:
        by_layer.setdefault(span.layer, []).append(span)
    return {layer: _runs(layer_spans) for layer, layer_spans in by_layer.items()}


def window_bytes(room: int, plain: bool = False) -> int:
    """The read-ahead window where `room` bytes of memory are free for the target's pages: WINDOW_SHARE of it, less
    what a pass still allocates as it runs (PASS_MARGIN: its logits and compute buffers, not touched until then). A
    target decoding plainly grows no tree beside its pages: all of the room but PLAIN_PASS_MARGIN."""
    if plain:
        return max(room - PLAIN_PASS_MARGIN, 0)
    return max(int((room - PASS_MARGIN) * WINDOW_SHARE), 0)


def resident_room(planned: int, room: int, plain: bool = False) -> int:
    """The resident set loading can keep: what the plan chose, where the memory free now (`room`, both models
    loaded) still leaves the stream its pages (what a pass allocates, and MIN_STREAM_ROOM past it)."""
    from edge.offload.plan import MIN_STREAM_ROOM

    return max(0, min(planned, room - (PLAIN_PASS_MARGIN if plain else PASS_MARGIN) - MIN_STREAM_ROOM))


def free_memory() -> int:
    """Memory this process may still fill now: under a memory cgroup's limit, the limit less what the kernel cannot
    reclaim (offload/probe.py); otherwise the machine's available memory."""
    import psutil
    from edge.offload.probe import free_bytes

    free = free_bytes()
    return free if free is not None else int(psutil.virtual_memory().available)


def _layer(name: str) -> int | None:
    match = re.match(r"blk\.(\d+)\.", name)
    return int(match.group(1)) if match else None
