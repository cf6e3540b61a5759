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

Partial residency: where the memory holds part of the target beside everything else (the plan's `resident_bytes`), the
head and the first tensors in pass order, that many bytes, stay resident: locked (mlock) where the system allows, else
read once and never dropped. Only the rest is streamed: read ahead, followed and dropped behind on every pass, plain
ones too, so the kernel never has to reclaim anything to make room for it. The kernel's own LRU cannot do this: a pass
reads the weights in the same order every time, so the page it needs next is always the one it evicted longest ago.
The resident layers come first so that the pass computes on them while the drive reads the streamed ones ahead; the
head, computed last in one matmul that no layer's progress can follow, stays too (offload/spans.py, `resident_set`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from edge.offload import libc
from edge.offload.direct import DirectReads, open_direct
from edge.offload.libc import MADV_DONTNEED, MADV_POPULATE_READ
from edge.offload.plan import KV_STEP_CELLS, MIN_STREAM_ROOM
from edge.offload.spans import Span, layer_of, layer_regions, merged_runs, outside, resident_set, whole_pages
from edge.offload.ssd import READAHEAD_CHUNK, SsdStreamer, SsdTarget, pass_order, readahead_order

from edge.protocols import Target

if TYPE_CHECKING:
    from edge.tree import TokenTree

WINDOW_SHARE = 0.5  # of the memory free for the target's pages, what the read-ahead may hold past the pass
PASS_MARGIN = 96 << 20  # bytes a pass still allocates after loading (logits rows, compute buffers): not for pages
# ... for a target decoding plainly (one row of logits): measured, 10.6 MiB more after 32 tokens than once loaded
# (Qwen2.5-Coder-1.5B, benchmarks/load_memory.py)
PLAIN_PASS_MARGIN = 16 << 20
# How often, at most, the window is fitted again to the memory free now (WindowedStreamer.refit): loading measures it
# once, and the KV caches then fill (Qwen2.5-Coder-1.5B under 1049 MiB, 4 plain server lanes: 193 MiB as loaded, 125
# once their caches held four conversations)
REFIT_S = 0.5
# What the next pass's read-ahead asks for while this one computes its head (_read_next_pass), before the window's
# worth once the next pass has begun: a larger burst there stalled the next pass's first layer (Qwen2.5-Coder-1.5B
# under 1049 MiB, a 150-190 MB window asked at once: 55-100 ms in half the 4-lane passes, none with 32 MiB first;
# 4-lane passes 226 ms against 250)
EARLY_READ = 32 << 20
# Bytes a WILLNEED asks for at a time: Linux reads at most the device's largest request of a range it is advised of
# (force_page_cache_ra), so one call for a whole 26 MB layer queued 8 MiB of it. Cold reads of 200 MiB here: one call,
# 8 MiB read; in 2 MiB calls 1.45 GB/s, 8 MiB calls 1.78 GB/s, populating (MADV_POPULATE_READ) 1.72 GB/s.
WILLNEED_CHUNK = 8 << 20
# How long the pass waits, at most, for the next layer's direct read to be placed before it reads the file itself
DIRECT_WAIT_S = 5.0


@dataclass
class PassTiming:
    """A streamed target's one-token passes, timed (sums over `passes`), with the bytes each computed from its
    resident set and read from the drive: the plan's rates for the next plan of this file are fitted to them
    (models.planning.streamed_rates)."""

    passes: int = 0
    seconds: float = 0.0
    resident_bytes: int = 0
    streamed_bytes: int = 0


class WindowedStreamer(SsdStreamer):
    """An SsdStreamer whose read-ahead stays `window` bytes ahead of the pass (on_layer says where the pass is); with
    `resident` bytes, the head and the first tensors in pass order stay in RAM (never dropped) and the rest streams."""

    def __init__(self, path: Path, window: int, resident: int = 0,
                 fit: Callable[[int, int], int | None] | None = None):
        """`fit(resident_bytes, held)`: the window the memory free now allows beside that resident set, `held` bytes
        of the window's own counted as free (None: not known), asked between passes (refit)."""
        super().__init__(path, readahead=True)
        self.window = window
        self._fit, self._fitted = fit, 0.0
        self._all_spans = self._spans()
        self._kept: list[tuple[int, int]] = []
        self._direct: DirectReads | None = None
        self._place(resident)
        self.locked = self._keep_resident()
        self._moved = threading.Condition()
        self._done = -1  # the last layer of the running pass computed (-1: none yet)
        self._read: set[int] = set()  # the spans asked for this pass and not dropped yet
        self._asked = 0  # spans asked for so far, in pass order (skipped ones included)
        self._following = False  # a read-ahead runs for this pass: its layers are dropped as it computes them
        self._early = False
        self._pending: int | None = None  # the layer being read directly now
        self._direct_failed = False  # a direct read failed: no more, and they end at the next drop (_drop_pages)
        self.timing = PassTiming()

    def _place(self, resident: int) -> None:
        """Split the spans into the resident set (`resident` bytes: spans.resident_set) and the streamed rest."""
        self.spans, self.resident = resident_set(self._all_spans, resident)  # self.resident: the spans that stay
        streamed = [span for index, span in enumerate(self.spans) if index not in self.resident]
        self._ranges = [(span.start, span.end) for span in streamed]  # what a whole read-ahead reads
        self.resident_bytes = sum(self.spans[index].size for index in self.resident)
        self.streamed_bytes = sum(span.size for span in streamed)  # what a pass reads from the drive
        # the resident set's whole pages (a page it shares with a streamed tensor streams); each layer's streamed bytes
        # as contiguous runs past them (dropped once the layer is done), and all of them in file order (after a pass)
        self._kept = whole_pages(merged_runs([self.spans[index] for index in sorted(self.resident)]))
        self._regions = {layer: [outside(run, self._kept) for run in runs]
                         for layer, runs in layer_regions(streamed).items()}
        self._streamed_runs = [outside(run, self._kept) for run in merged_runs(streamed)]
        # with a resident set, the pass's last streamed layer: once it is computed (and dropped), the next pass's
        # read-ahead starts, while this pass computes its resident head (`_early`: it has)
        self._last_streamed = max((span.layer for span in streamed), default=-1) if self.resident else -1
        # with a resident set every pass is followed: its streamed layers read past the page cache (offload/direct.py)
        if self._direct is not None:
            self._direct.close()
        self._direct = open_direct(self.path, self._regions, self._fd, self.window) if self.resident else None

    def give_way(self, n_bytes: int) -> int:
        """Between passes: shrink the resident set by `n_bytes` (the KV cache grows into their room), its last
        tensors in pass order now streamed. Their pages are unlocked, left to the next pass to read and drop behind
        it as it drops every streamed layer's. Returns the bytes the set shrank by."""
        if n_bytes <= 0 or not self.resident:
            return 0
        self._cancel_readahead()  # the next pass's read-ahead, started on the old set
        kept, before = self._kept, self.resident_bytes
        self._place(max(0, before - n_bytes))
        if self.locked:
            for start, end in libc.ranges_outside(kept, self._kept):
                with contextlib.suppress(OSError):
                    libc.munlock(start, end - start)
        with self._moved:
            self._reset()
            self._following = False
        super().after_pass(evict=False)  # a read-ahead thread for the next pass, on the new set
        self.prefetch()
        return before - self.resident_bytes

    def _spans(self) -> list[Span]:
        order = readahead_order(pass_order(self.path))
        layers = [layer_of(t.name) for t in order]
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
        if self._direct is not None:
            self._direct.release_all()  # (a placed interior's drop would free its slot's pages, not the file's)
            if self._direct_failed:  # no pass computes now: its placed layers can go back to the file for good
                self._direct.close()
                self._direct = None
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

    @contextlib.contextmanager
    def timed(self, one_token: bool) -> Iterator[None]:
        """Around a pass: one of a single token is timed (PassTiming)."""
        started = time.perf_counter()
        yield
        if one_token:
            timing = self.timing
            timing.passes += 1
            timing.seconds += time.perf_counter() - started
            timing.resident_bytes += self.resident_bytes
            timing.streamed_bytes += self.streamed_bytes

    def on_layer(self, layer: int) -> None:
        """From the pass (the target's runtime): `layer` is computed. Its pages go, and the read-ahead moves on."""
        with self._moved:
            if not self.following() or self._early:
                return
            self._done = layer
            self._read = {index for index in self._read if self.spans[index].layer != layer}
            self._moved.notify_all()  # the read-ahead asks for what the window now has room for
        direct = self._direct  # (read once: the read-ahead thread may end direct reads meanwhile)
        if direct is not None:
            direct.release(layer)
        for start, end, offset in self._regions.get(layer, ()):
            self._drop(start, end, offset)
        if layer == self._last_streamed:
            self._read_next_pass()
        elif direct is not None:
            with self._moved:  # the next layer being read directly: wait for it, rather than fault it in meanwhile
                self._moved.wait_for(lambda: self._pending != layer + 1 or self._stop.is_set(), DIRECT_WAIT_S)

    def refit(self) -> None:
        """Between passes, at most every REFIT_S: the window as large as the memory free now allows. Its pages are the
        page cache's, which the kernel reclaims where memory runs short (the KV cache growing): never an
        out-of-memory kill, at worst a page read again, and the next refit makes the window smaller."""
        now = time.monotonic()
        if self._fit is None or now - self._fitted < REFIT_S:
            return
        self._fitted = now
        # the slots of direct reads are memory taken, where the page cache's read-ahead counts as free: the window's own
        window = self._fit(self.resident_bytes, self._direct.bytes if self._direct is not None else 0)
        if window is not None:
            self.window = window
            if self._direct is not None:
                self._direct.resize(self._direct.slots_for(self.window))

    def _read_next_pass(self) -> None:
        """The pass has computed (and dropped) its last streamed layer; what is left of it is resident (the head, in
        one matmul). Start the next pass's read-ahead now, not after it: the drive would otherwise wait through the
        head, the sampling and the round's own work (Qwen2.5-Coder-1.5B under 1049 MiB: about 20 ms a token). What
        it gained there was within the machine's noise (5.96-6.16 tokens/s with it, 5.85-5.92 without)."""
        super().after_pass(evict=True)  # (what is left of its stream: folios that straddle two layers)
        with self._moved:
            self._reset()
            self._early = True
        self.refit()
        self.prefetch()

    def after_pass(self, evict: bool = True) -> None:
        """After a pass that was read ahead, its pages go (as in the SSD regime); after a plain one the kernel keeps
        what the memory holds of them, as it would without edge-spec (the next plain pass finds some). With a
        resident set, the next pass's streamed part is read ahead at once, plain pass or not: that pass starts on
        the resident layers, which need no reading, while the drive reads the window past them (Qwen2.5-Coder-1.5B
        under 900 MiB, plain: 2.3 tokens/s without, 2.8 with it and a core left to it, benchmarks/peer_llama_cpp.py)."""
        with self._moved:
            early, self._early = self._early, False
        if early:  # the next pass's read-ahead runs already (_read_next_pass)
            return
        self._cancel_readahead()
        if self._direct is not None:
            self._direct.release_all()
        with self._moved:
            followed = self.following()
            self._reset()
            self._following = False
        super().after_pass(evict and followed)
        if self.resident:
            self.refit()
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
        self._done, self._read, self._asked, self._early = -1, set(), 0, False

    def _held(self) -> int:
        """Bytes asked for ahead of the pass: for layers it has not computed yet (the caller holds _moved)."""
        return sum(self.spans[index].size for index in self._read if self.spans[index].layer > self._done)

    def _next_asks(self) -> list[Span]:
        """The next spans in pass order the window has room for (EARLY_READ of it before the pass they are for has
        begun), now counted as asked for; the next layer the pass needs is asked for whatever the window (the pass
        would fault it in anyway). The caller holds _moved, and asks the drive for them (`_ask`) once it has let go
        of it."""
        asks = []
        window = min(self.window, EARLY_READ) if self._early else self.window
        while self._asked < len(self.spans) and not self._stop.is_set():
            span = self.spans[self._asked]
            if span.layer > self._done and self._asked not in self.resident:
                if span.layer > self._done + 1 and self._held() + span.size > window:
                    break
                self._read.add(self._asked)
                asks.append(span)
            self._asked += 1
        return asks

    def _ask(self, spans: list[Span]) -> None:
        """Ask the drive for these spans (posix_fadvise WILLNEED: their reads queued), a chunk at a time, never for
        a layer the pass got past (its pages dropped, they would stay); with direct reads, read each span's layer
        into a slot and place it (_read_directly), the page cache asked only for what that leaves. The call runs
        outside _moved: it waits while the drive's queue is full, and the pass's on_layer, which takes _moved, would
        wait behind it (a lock is not fair: this loop took it back chunk after chunk, and a 4-lane pass of
        Qwen2.5-Coder-1.5B under 1049 MiB spent 50 ms in its first layer's callback while a 190 MB window was asked
        for). A chunk asked for as the pass got past its layer is dropped again."""
        if self._direct is not None:
            spans = self._read_directly(spans)
        for span in spans:
            for offset in range(span.offset, span.offset + span.end - span.start, WILLNEED_CHUNK):
                with self._moved:
                    if self._stop.is_set():
                        return
                    if span.layer <= self._done:
                        break
                length = min(WILLNEED_CHUNK, span.offset + span.end - span.start - offset)
                os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_WILLNEED)
                with self._moved:
                    passed = span.layer <= self._done
                if passed:
                    os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)
                    break

    def _read_directly(self, spans: list[Span]) -> list[Span]:
        """Read the layers of these spans directly and place them, in pass order; returns the spans of those left to
        the page cache (no slot free, no interior). A failed read ends direct reads for good (the page cache then
        reads everything, as before): the layers placed stay until the pass is done with them, since moving one back
        while the pass computes it would leave it empty for a moment."""
        rest: list[Span] = []
        for span in spans:
            direct = self._direct
            if direct is None or self._direct_failed:
                rest.append(span)
                continue
            with self._moved:
                if self._stop.is_set():
                    return []
                if span.layer <= self._done or direct.placed(span.layer):
                    continue
                self._pending = span.layer
            try:
                placed = direct.read(span.layer)
            except OSError:
                placed = False
                self._direct_failed = True
            with self._moved:
                self._pending = None
                self._moved.notify_all()
                passed = span.layer <= self._done
            if placed and passed:  # read too late: the pass faulted it in meanwhile
                direct.release(span.layer)
            if not placed:
                rest.append(span)
        return rest

    def _read_ahead(self, wait: bool = True) -> None:
        """Ask the drive for the spans the window has room for, in pass order, and for more as the pass moves the
        window (on_layer), until every streamed span is asked for. The pass maps the pages itself as it reaches
        them: mapping them here too (MADV_POPULATE_READ) ran no faster under 1049 MiB (5.66-5.83 tokens/s with it,
        5.78-5.82 without), and raced the pass to pages it had dropped. `wait`: a pass follows, whose progress moves
        the window; otherwise (read_ahead_now) the window's worth is asked for and mapped, and this returns once it
        is read."""
        while not self._stop.is_set():
            with self._moved:
                asks = self._next_asks()
                if not asks:
                    if not wait or self._asked >= len(self.spans):
                        return
                    self._moved.wait(0.05)  # until the pass computes a layer and the window moves
                    continue
            self._ask(asks)
            if not wait:
                self._map_in(asks)
                return

    def _map_in(self, spans: list[Span]) -> None:
        """Map the spans' pages in (MADV_POPULATE_READ), waiting for whatever of them the drive has not read yet."""
        for span in spans:
            for address in range(span.start, span.end, READAHEAD_CHUNK):
                if self._stop.is_set():
                    return
                try:
                    libc.madvise(address, min(READAHEAD_CHUNK, span.end - address), MADV_POPULATE_READ)
                except OSError:  # an older kernel: the pass reads what is not read yet itself
                    return

    def close(self) -> None:
        self._cancel_readahead()
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        super().close()

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

    def __init__(self, target: Target, path: Path, window: int, resident: int = 0, kv_cells: int = 0,
                 kv_cell_bytes: float = 0.0, threads: int = 0,
                 fit: Callable[[int, int], int | None] | None = None):
        """`fit(resident bytes, held)`: the window the memory free now allows beside them and the KV cells still to be
        written (kv_reserve), `held` bytes of its own counted as free, None where unknown (WindowedStreamer.refit)."""
        streamer = WindowedStreamer(path, window, resident, fit)
        self.threads = threads  # the CPU threads its passes compute on (0: not said), as its PassTiming is kept
        streamer.readahead = target.follow_layers(streamer.on_layer, streamer.following)
        super().__init__(target, path, streamer=streamer)
        self.timing = streamer.timing  # its one-token passes
        self._timed = streamer.timed
        # the KV cache's cells the memory has room for besides the resident set (the plan's KV_RESERVE_CELLS, 0: all),
        # and its bytes a cell: a pass that writes cells past them first takes their room from the resident set
        self.kv_cells, self.kv_cell_bytes = kv_cells, kv_cell_bytes

    @property
    def kv_reserve(self) -> int:
        """Bytes of the KV cache's cells the plan counted that no pass has written yet (their pages not taken)."""
        return max(0, round((self.kv_cells - self.n_past - self.deferred) * self.kv_cell_bytes)) if self.kv_cells else 0

    def _room_for(self, n_tokens: int) -> None:
        """Before a pass that writes `n_tokens` cells past the cache's (and what the target defers to it)."""
        cells = self.n_past + self.deferred + n_tokens
        if not self.kv_cells or cells <= self.kv_cells:
            return
        grown = min(max(self.n_ctx, cells), -(-cells // KV_STEP_CELLS) * KV_STEP_CELLS)
        self.ssd.give_way(round((grown - self.kv_cells) * self.kv_cell_bytes))
        self.kv_cells = grown

    def prefill(self, tokens: Sequence[int]) -> None:
        self._room_for(len(tokens))
        super().prefill(tokens)

    def verify(self, tree: TokenTree) -> np.ndarray:
        self._room_for(len(tree))
        return super().verify(tree)

    def _pass(self, tree: TokenTree) -> np.ndarray:
        with self._timed(len(tree) == 1 and not self.deferred):
            return self.inner.verify(tree)


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
    return max(0, min(planned, room - (PLAIN_PASS_MARGIN if plain else PASS_MARGIN) - MIN_STREAM_ROOM))


def free_memory(target: Path | None = None) -> int:
    """Memory this process may still fill now: under a memory cgroup's limit, the limit less what the kernel cannot
    reclaim (offload/probe.py); otherwise the machine's available memory. Less, with `target` (the file to be
    streamed), the pages of the other files this process has mapped (probe.mapped_file_bytes: its libraries' code, a
    drafter's weights): a stream sized to use them evicted its own read-ahead instead (Qwen2.5-Coder-1.5B under 1049
    MiB: 28 MiB of them, 7% of a pass's reads read again)."""
    import psutil
    from edge.offload.probe import free_bytes, mapped_file_bytes

    free = free_bytes()
    free = free if free is not None else int(psutil.virtual_memory().available)
    return free if target is None else max(0, free - mapped_file_bytes(exclude=target))
