"""A target larger than the memory it may use (a memory limit's room, or the machine's RAM): its weights read ahead in
a window that follows the pass.

Where the plan streams a target, the kernel reads its weights by page faults on every pass, one fault after another
in the computing threads: about half the drive's speed (docs/performance.md, "under a memory cap"). The SSD regime's
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
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Span:
    """One tensor's bytes: its range in the target's mapping and in the file, and the last layer that uses it."""

    start: int
    end: int
    offset: int  # the file offset of `start` (page-aligned, as the mapping is)
    size: int  # the tensor's bytes
    layer: int  # dropped once this layer is computed; the head and a tied token table: n_layers (at the pass's end)


class WindowedStreamer(SsdStreamer):
    """An SsdStreamer whose read-ahead stays `window` bytes ahead of the pass (on_layer says where the pass is)."""

    def __init__(self, path: Path, window: int):
        super().__init__(path, readahead=True)
        self.window = window
        self.spans = self._spans()
        self._regions = _regions(self.spans)  # each layer's bytes as contiguous runs: what is dropped once it is done
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

    def prefetch(self) -> None:
        """A tree is about to be grown: read the next pass's weights, the window's worth, and follow that pass."""
        with self._moved:
            self._following = True
        super().prefetch()

    def following(self) -> bool:
        """Whether the pass about to run (or running) is read ahead: only those are followed layer by layer."""
        return self._following

    def on_layer(self, layer: int) -> None:
        """From the pass (the target's runtime): `layer` is computed. Its pages go, and the read-ahead moves on."""
        with self._moved:
            if not self._following:
                return
            self._done = layer
            self._read = {index for index in self._read if self.spans[index].layer != layer}
            for start, end, offset in self._regions.get(layer, ()):
                self._drop(start, end, offset)
            self._ask_ahead()
            self._moved.notify_all()

    def after_pass(self, evict: bool = True) -> None:
        """After a pass that was read ahead, its pages go (as in the SSD regime); after a plain one the kernel keeps
        what the memory holds of them, as it would without edge-spec (the next plain pass finds some)."""
        self._cancel_readahead()
        with self._moved:
            followed = self._following
            self._reset()
            self._following = False
        super().after_pass(evict and followed)

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
            if span.layer > self._done:
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
                if span.layer <= self._done:  # the pass is past it already
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
        try:
            libc.madvise(start, end - start, MADV_DONTNEED)
        except OSError:
            return
        os.posix_fadvise(self._fd, offset, end - start, os.POSIX_FADV_DONTNEED)


class WindowedTarget(SsdTarget):
    """A Target streamed from its file with a windowed read-ahead (WindowedStreamer); where its runtime cannot say
    which layer a pass is at, with none (the kernel's page faults alone)."""

    def __init__(self, target: Target, path: Path, window: int):
        streamer = WindowedStreamer(path, window)
        streamer.readahead = target.follow_layers(streamer.on_layer, streamer.following)
        super().__init__(target, path, streamer=streamer)


def _regions(spans: list[Span]) -> dict[int, list[tuple[int, int, int]]]:
    """Each layer's spans merged into contiguous runs (start, end, file offset): a file keeps a layer's tensors
    together, though not always its layers in order (blk.1 before blk.10 before blk.2, sorted by name)."""
    regions: dict[int, list[tuple[int, int, int]]] = {}
    for span in sorted(spans, key=lambda span: span.start):
        runs = regions.setdefault(span.layer, [])
        if runs and span.start <= runs[-1][1] + mmap.PAGESIZE:
            start, end, offset = runs[-1]
            runs[-1] = (start, max(span.end, end), offset)
        else:
            runs.append((span.start, span.end, span.offset))
    return regions


def window_bytes(room: int) -> int:
    """The read-ahead window where `room` bytes of memory are free for the target's pages: WINDOW_SHARE of it, less
    what a pass still allocates as it runs (PASS_MARGIN: its logits and compute buffers, not touched until then)."""
    return max(int((room - PASS_MARGIN) * WINDOW_SHARE), 0)


def free_memory() -> int:
    """Memory this process may still fill now: under a memory cgroup's limit, the limit less what the kernel cannot
    reclaim (offload/probe.py); otherwise the machine's available memory."""
    import psutil
    from edge.offload.probe import memory_limit

    limit = memory_limit()
    return limit.room if limit is not None else int(psutil.virtual_memory().available)


def _layer(name: str) -> int | None:
    match = re.match(r"blk\.(\d+)\.", name)
    return int(match.group(1)) if match else None
