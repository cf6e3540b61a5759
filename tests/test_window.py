"""A streamed target read ahead in a window that follows its passes (offload/window.py), on the real SmolLM2 target
rewritten to F16: llama.cpp says as each layer is computed without changing a logit, and the read-ahead holds no more
than its window past the pass."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from edge.offload.ssd import resident_fraction
from edge.offload.window import WindowedStreamer, WindowedTarget
from edge.runtimes.llama_cpp import RunOptions, load_target

from tests.test_ssd import chain


def test_a_pass_says_each_layer_and_its_logits_do_not_change(f16_file) -> None:
    plain = load_target(f16_file, RunOptions(n_ctx=256, kv_type="bf16"))
    try:
        plain.prefill([1, 2, 3, 4])
        expected = plain.verify(chain([5, 6, 7])).copy()
        assert not plain.follow_layers(lambda layer: None)  # no callback unless asked for: it costs a sync a layer
    finally:
        plain.close()
    followed = load_target(f16_file, RunOptions(n_ctx=256, kv_type="bf16", layer_progress=True))
    try:
        layers: list[int] = []
        assert followed.follow_layers(layers.append)
        followed.prefill([1, 2, 3, 4])
        layers.clear()
        assert np.array_equal(followed.verify(chain([5, 6, 7])), expected)
        assert layers == list(range(30))  # SmolLM2-135M's 30 layers, in order, once each
        layers.clear()
        followed.follow_layers(layers.append, active=lambda: False)  # a pass nobody follows: not split by layer
        followed.truncate(4)
        assert np.array_equal(followed.verify(chain([5, 6, 7])), expected) and layers == []

        def broken(layer: int) -> None:
            raise OSError("a listener that fails")

        followed.follow_layers(broken)
        followed.truncate(4)
        with pytest.raises(OSError, match="fails"):  # raised after the pass, not lost inside ggml
            followed.verify(chain([5, 6, 7]))
    finally:
        followed.close()


@contextmanager
def windowed(f16_file: Path, window: int, resident: int = 0, kv_cells: int = 0,
             kv_cell_bytes: float = 0.0) -> Iterator[tuple[WindowedTarget, np.ndarray]]:
    """The F16 target streamed in a window (and a resident set, which gives a KV cache of `kv_cells` cells room as it
    grows), with its logits for a chain computed in RAM first."""
    inner = load_target(f16_file, RunOptions(n_ctx=256, kv_type="bf16", repack=False, layer_progress=True))
    try:
        inner.prefill([1, 2, 3, 4])
        in_ram = inner.verify(chain([5, 6, 7])).copy()
        inner.truncate(0)
        target = WindowedTarget(inner, f16_file, window, resident, kv_cells, kv_cell_bytes)
    except BaseException:
        inner.close()
        raise
    try:
        yield target, in_ram
    finally:
        target.close()


def test_the_read_ahead_follows_the_pass_within_its_window(f16_file) -> None:
    size = f16_file.stat().st_size
    window = size // 4
    with windowed(f16_file, window) as (target, in_ram):
        streamer = target.streamer
        assert isinstance(streamer, WindowedStreamer) and streamer.readahead and streamer.window == window
        target.prefill([1, 2, 3, 4])  # a plain pass: its pages are left to the kernel
        streamer.wait_evicted()
        assert resident_fraction(f16_file) > 0.6
        streamer.evict()  # as under a memory limit smaller than the file, whose passes find nothing left
        table = max(span.size for span in streamer.spans)  # the tied token table is held through the pass
        largest = max(span.size for span in streamer.spans if span.size < table)
        seen: list[float] = []
        followed = streamer.on_layer

        def watch(layer: int) -> None:
            followed(layer)
            seen.append(resident_fraction(f16_file) * size)

        target.inner.follow_layers(watch)
        target.prefetch()  # a tree is grown: the window is read ahead, then follows the pass
        logits = target.verify(chain([5, 6, 7]))
        assert np.array_equal(logits, in_ram)
        assert len(seen) == 30
        assert max(seen) <= window + table + 8 * largest  # never the whole file: a window past the layer done
        streamer.wait_evicted()
        assert resident_fraction(f16_file) < 0.05  # dropped after the pass

        target.truncate(4)
        seen.clear()
        target.verify(chain([5, 6, 7]))  # plain: no prefetch, the kernel's faults alone, nothing dropped mid-pass
        assert seen[-1] > 0.6 * size  # every layer (the tied table, a fifth of the file, is read by the head after)
        streamer.wait_evicted()
        assert resident_fraction(f16_file) > 0.6  # nor after: the kernel keeps what the memory holds


def test_auto_prices_a_pass_by_what_the_window_let_growth_read() -> None:
    """--budget auto's pass time after `grow_s` of drafting: reading the file takes 400 ms, the window holds 100 ms of
    it, so growth hides at most 100 ms of the reading, however long it takes (the rest is read during the pass)."""
    from edge.budget import Costs

    windowed = Costs({1: 900.0}, {}, read_ahead_ms=400.0, warm_ms={1: 100.0}, overlap_ms={1: 410.0}, window_ms=100.0)
    whole = Costs({1: 900.0}, {}, read_ahead_ms=400.0, warm_ms={1: 100.0}, overlap_ms={1: 410.0})
    assert windowed.verify_s(1, 0.0) == whole.verify_s(1, 0.0) == pytest.approx(0.41)
    assert windowed.verify_s(1, 0.05) == pytest.approx(0.36)
    assert windowed.verify_s(1, 0.3) == windowed.verify_s(1, 1.0) == pytest.approx(0.31)  # the window's 100 ms
    assert whole.verify_s(1, 1.0) == pytest.approx(0.1)  # the whole file read during growth: the compute alone
    assert Costs.from_json(windowed.to_json()) == windowed
    with pytest.raises(ValueError, match="window_ms"):
        Costs.from_json({**windowed.to_json(), "window_ms": -1})


def _resident_share(spans, indices) -> float:
    """Share of the pages of these spans (of the target's own mapping) that are in RAM."""
    from edge.offload import libc

    pages = [libc.resident_pages(spans[i].start, spans[i].end - spans[i].start) for i in indices]
    return float(np.concatenate(pages).mean()) if pages else 0.0


def test_the_resident_set_stays_and_a_pass_reads_only_the_streamed_part(f16_file) -> None:
    """Partial residency: the head and the first tensors in pass order, half the file, stay in RAM (locked where
    allowed) through evictions and passes, plain and read ahead; every pass reads only the rest from the drive (the
    next pass's window read ahead as one ends), and its logits are those of the target in RAM."""
    from edge.offload.ssd import read_bytes

    size = f16_file.stat().st_size
    with windowed(f16_file, size // 8, resident=size // 2) as (target, in_ram):
        streamer = target.streamer
        assert isinstance(streamer, WindowedStreamer)
        kept, rest = sorted(streamer.resident), [i for i in range(len(streamer.spans)) if i not in streamer.resident]
        head = [i for i, span in enumerate(streamer.spans) if span.layer == streamer.spans[-1].layer]
        body = [i for i in kept if i not in head]
        assert set(head) <= set(kept) and body == list(range(body[0], body[0] + len(body))) and rest
        assert max(streamer.spans[i].layer for i in rest) < streamer.spans[-1].layer  # the last layers stream
        assert size // 2 - max(s.size for s in streamer.spans) < streamer.resident_bytes <= size // 2
        assert streamer.streamed_bytes == sum(streamer.spans[i].size for i in rest)
        assert _resident_share(streamer.spans, kept) > 0.99  # read (and locked) at once
        assert _resident_share(streamer.spans, rest) < 0.05  # SsdTarget evicts what streams as it starts
        for prefetch in (False, True, False):
            target.truncate(0)
            before = read_bytes()
            target.prefill([1, 2, 3, 4])  # a plain pass: followed too, its streamed layers dropped behind it
            if prefetch:
                target.prefetch()  # a tree is grown: the window is read ahead
            logits = target.verify(chain([5, 6, 7]))
            streamer.wait_evicted()
            streamer._cancel_readahead()  # the next pass's window, read ahead as this one ended: not counted below
            read = read_bytes() - before
            assert np.array_equal(logits, in_ram)
            assert _resident_share(streamer.spans, kept) > 0.99, "the resident set was dropped"
            # past its pass, the streamed part is gone but for the next pass's window
            window_share = streamer.window / streamer.streamed_bytes
            assert _resident_share(streamer.spans, rest) < window_share + 0.05, "the streamed part stayed"
            # two passes (prefill, verify), each reading the streamed part from the drive and nothing else, and at
            # most one window of the pass after them
            assert read <= 2 * streamer.streamed_bytes * 1.1 + streamer.window
            assert read >= streamer.streamed_bytes


def test_the_window_is_fitted_again_to_the_memory_free_between_passes(f16_file, monkeypatch) -> None:
    """Loading measures the memory at its peak; between passes the window takes what is free now (the fit the loader
    gives it, at most every REFIT_S). The logits stay."""
    import edge.offload.window as window_module

    monkeypatch.setattr(window_module, "REFIT_S", 0.0)
    size = f16_file.stat().st_size
    with windowed(f16_file, size // 16, resident=size // 2) as (target, in_ram):
        streamer = target.streamer
        assert isinstance(streamer, WindowedStreamer)
        asked: list[int] = []
        free: list[int | None] = [None]

        def fit(resident_bytes: int, held: int) -> int | None:
            asked.append(resident_bytes)
            return free[0]

        streamer._fit = fit
        for now, expected in ((size // 4, size // 4), (None, size // 4), (size // 32, size // 32)):
            free[0] = now  # None: the memory cannot be read, and the window stays as it was
            target.truncate(0)
            target.prefill([1, 2, 3, 4])
            assert np.array_equal(target.verify(chain([5, 6, 7])), in_ram)
            streamer.wait_evicted()
            assert streamer.window == expected
        assert asked and set(asked) == {streamer.resident_bytes}


def test_the_memory_free_beside_a_locked_resident_set_counts_it_once(monkeypatch) -> None:
    """A memory cgroup counts locked file pages in its page cache (its room holds them), the machine's MemAvailable
    leaves them out (unevictable): the window's room subtracts them from the first only."""
    import edge.offload.probe as probe

    monkeypatch.setattr(probe, "_machine_ram", lambda: (8 << 30, 3 << 30))
    monkeypatch.setattr(probe, "memory_limit", lambda: None)
    assert probe.free_beside_locked(1 << 30) == 3 << 30
    monkeypatch.setattr(probe, "memory_limit", lambda: probe.MemoryLimit(2 << 30, 512 << 20, "memory.max"))
    assert probe.free_beside_locked(1 << 30) == (2 << 30) - (512 << 20) - (1 << 30)
    monkeypatch.setattr(probe, "_machine_ram", lambda: (None, None))
    assert probe.free_beside_locked(0) == (2 << 30) - (512 << 20)


def test_the_resident_set_gives_the_kv_cache_room_as_the_context_fills(f16_file) -> None:
    """The plan gave the KV cache room for its first cells alone: a pass that writes cells past them first shrinks
    the resident set by their bytes (KV_STEP_CELLS at a time, up to the context), its last tensors unlocked and
    streamed from then on; the head and the first layers stay, and the logits do not change."""
    from edge.offload.plan import KV_STEP_CELLS

    def locked() -> int:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmLck:"))

    size = f16_file.stat().st_size
    cell = size / 4096  # a cell's KV bytes, made large: 252 cells are a sixteenth of the file
    with windowed(f16_file, size // 8, resident=size // 2, kv_cells=4, kv_cell_bytes=cell) as (target, in_ram):
        streamer = target.streamer
        kept, held, was_locked = sorted(streamer.resident), streamer.resident_bytes, locked()
        target.prefill([1, 2, 3, 4])  # 4 cells: room for them
        assert streamer.resident_bytes == held and target.kv_cells == 4
        logits = target.verify(chain([5, 6, 7]))  # 7 cells: the cache grows to the context (256, one step)
        assert KV_STEP_CELLS >= target.n_ctx == target.kv_cells == 256
        assert np.array_equal(logits, in_ram)
        given = held - streamer.resident_bytes
        assert given == pytest.approx(252 * cell, abs=2 * 4096)
        now = sorted(streamer.resident)
        head = [i for i, span in enumerate(streamer.spans) if span.layer == streamer.spans[-1].layer]
        assert set(head) <= set(now) and min(set(now) - set(head)) == min(set(kept) - set(head))  # the first layers
        assert len(now) < len(kept)
        if streamer.locked:
            assert was_locked - locked() == pytest.approx(given, abs=64 << 10)  # unlocked as they left the set
        streamer.wait_evicted()
        streamer._cancel_readahead()
        assert _resident_share(streamer.spans, now) > 0.99  # what stays, stays
        rest = [i for i in range(len(streamer.spans)) if i not in streamer.resident]
        assert _resident_share(streamer.spans, rest) < streamer.window / streamer.streamed_bytes + 0.05
        target.truncate(4)
        assert np.array_equal(target.verify(chain([5, 6, 7])), in_ram) and streamer.resident_bytes == held - given


def test_a_replys_bytes_read_per_pass_count_the_prompts_pass(f16_file) -> None:
    """bench's bytes_read_per_pass over a reply: the bytes read while it ran over every pass it ran, the prompt's
    included (it reads the streamed part like any other). Counted over the decoding passes alone, a reply of n passes
    after its prompt's came out (n + 1) / n times the streamed bytes (here two passes after the prompt's: 1.5 times).

    A pass's read is the streamed part give or take the page cache's folios (of up to some hundred KB): one that
    holds locked resident pages is never dropped, so its streamed pages are never read again (0.1% of this file's
    streamed part a pass), and one that straddles two layers is read again when the first layer's drop takes it (up
    to 5% more a pass in 12 runs here; which folios straddle changes run to run)."""
    from edge.models.bench import _row
    from edge.offload.ssd import read_bytes

    from edge.generate import Decoder

    size = f16_file.stat().st_size
    with windowed(f16_file, size // 8, resident=size // 2) as (target, _):
        streamer = target.streamer
        passes = target.passes
        before = read_bytes()
        steps = list(Decoder(target).reply([1, 2, 3, 4, 5, 6], 2))
        streamer.wait_evicted()
        streamer._cancel_readahead()  # the next pass's window, read ahead as the last one ended
        read = read_bytes() - before
        stats = steps[-1].stats
        assert stats.prefill_passes == 1 and stats.target_passes == 2 == target.passes - passes - 1
        per_pass = _row("plain", None, stats, None, read)["bytes_read_per_pass"]
        streamed = streamer.streamed_bytes
        assert 0.95 * streamed <= per_pass <= 1.25 * streamed + streamer.window / 3  # counted over two: >= 1.4x


def test_the_resident_set_fits_what_the_memory_leaves_now() -> None:
    from edge.offload.plan import MIN_STREAM_ROOM
    from edge.offload.window import PASS_MARGIN, PLAIN_PASS_MARGIN, resident_room

    assert resident_room(500 << 20, 2 << 30) == 500 << 20  # the plan's, where the room holds it
    assert resident_room(500 << 20, 600 << 20) == (600 << 20) - PASS_MARGIN - MIN_STREAM_ROOM
    assert resident_room(500 << 20, 100 << 20) == 0
    # a target decoding plainly leaves a pass only its one row of logits (PLAIN_PASS_MARGIN)
    assert resident_room(500 << 20, 550 << 20, plain=True) == (550 << 20) - PLAIN_PASS_MARGIN - MIN_STREAM_ROOM


def test_the_resident_set_is_the_head_then_the_first_layers() -> None:
    """The head (computed last, in one matmul no layer's progress follows) stays first, then the first spans in pass
    order, the one the set ends in cut at a page; where the head alone does not fit, the first spans alone."""
    from edge.offload.spans import Span, resident_set

    page = 4096
    sizes = [(0, 10), (1, 10), (2, 10), (3, 10), (4, 30)]  # (layer, pages); layer 4: the head
    spans, start = [], 0
    for layer, pages in sizes:
        spans.append(Span(start, start + pages * page, start, pages * page, layer))
        start += pages * page
    cut, kept = resident_set(spans, 45 * page)
    assert sorted(kept) == [0, 1, 5] and [s.size // page for s in cut] == [10, 5, 5, 10, 10, 30]
    assert cut[1].start == spans[1].start and cut[2].offset == spans[1].offset + 5 * page  # layer 1: half stays
    cut, kept = resident_set(spans, 25 * page)  # the head alone does not fit: the first 25 pages
    assert sorted(kept) == [0, 1, 2] and [s.size // page for s in cut] == [10, 10, 5, 5, 10, 30]
    assert resident_set(spans, 0)[1] == frozenset()


def test_the_window_is_asked_for_in_chunks_the_kernel_reads_whole(f16_file, monkeypatch) -> None:
    """Linux reads at most a device request's worth of a range it is advised of (WILLNEED): the read-ahead asks in
    WILLNEED_CHUNK pieces, and the pieces cover the window's spans, each once."""
    import os

    from edge.offload import window as window_module

    size = f16_file.stat().st_size
    with windowed(f16_file, size // 4) as (target, _):
        streamer = target.streamer
        streamer.evict()
        asked: list[tuple[int, int]] = []
        advise = os.posix_fadvise

        def record(fd: int, offset: int, length: int, advice: int) -> None:
            if advice == os.POSIX_FADV_WILLNEED:
                asked.append((offset, length))
            advise(fd, offset, length, advice)

        monkeypatch.setattr(window_module.os, "posix_fadvise", record)
        streamer.read_ahead_now()  # the window's worth, asked and mapped in
        assert asked and max(length for _, length in asked) <= window_module.WILLNEED_CHUNK
        assert len(set(asked)) == len(asked)
        largest = max(span.end - span.start for span in streamer.spans)
        covered = sum(length for _, length in asked)  # spans up to the window (the one that would pass it waits)
        assert streamer.window - largest <= covered <= streamer.window + largest


def test_the_streams_room_leaves_out_the_processs_own_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pages of the libraries this process has mapped are not room for the stream (the kernel would reclaim them
    and read them again on the next pass), but the target's own pages are. (The free memory is held still: the
    machine's moves with whatever else runs, a test beside this one too.)"""
    import sys

    from edge.offload import probe
    from edge.offload.probe import mapped_file_bytes
    from edge.offload.window import free_memory

    python = Path(sys.executable).resolve()
    code = mapped_file_bytes(exclude=Path("/nonexistent"))
    assert code > 0 and mapped_file_bytes(exclude=python) <= code and mapped_file_bytes() <= code
    monkeypatch.setattr(probe, "free_bytes", lambda: 8 << 30)
    assert free_memory() == 8 << 30
    assert abs(free_memory(Path("/nonexistent")) - ((8 << 30) - code)) <= 16 << 20  # (this process's own mappings)
    monkeypatch.setattr(probe, "free_bytes", lambda: code // 2)
    assert free_memory(Path("/nonexistent")) == 0


def test_ranges_outside_others_are_what_none_of_them_covers() -> None:
    from edge.offload.libc import ranges_outside

    assert ranges_outside([(0, 100)], [(10, 20), (50, 60)]) == [(0, 10), (20, 50), (60, 100)]
    assert ranges_outside([(0, 100), (200, 300)], [(90, 210)]) == [(0, 90), (210, 300)]
    assert ranges_outside([(0, 100)], [(0, 100)]) == [] and ranges_outside([(5, 9)], []) == [(5, 9)]


def test_ranges_inside_others_are_what_they_cover() -> None:
    from edge.offload.libc import ranges_inside

    assert ranges_inside([(0, 100)], [(10, 20), (50, 60)]) == [(10, 20), (50, 60)]
    assert ranges_inside([(0, 100), (200, 300)], [(90, 210)]) == [(90, 100), (200, 210)]
    assert ranges_inside([(0, 100)], []) == [] and ranges_inside([(5, 9)], [(0, 100)]) == [(5, 9)]


def test_a_core_is_left_to_the_read_ahead_only_where_a_pass_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed target decoding plainly computes on one core fewer, left to the read-ahead; where the plan keeps all
    of it resident (a pass reads nothing: Qwen2.5-Coder-1.5B under 1175 MiB) it computes on every core, as a
    server's lanes do."""
    import edge.models.loading as loading

    from edge.options import LoadOptions

    monkeypatch.setattr(loading, "default_threads", lambda: 4)
    options = LoadOptions()
    assert loading.target_threads(options, stock=True, reads=True) == 3
    assert loading.target_threads(options, stock=True, reads=False) is None  # every core
    assert loading.target_threads(LoadOptions(threads=2), stock=True, reads=True) == 2  # as asked
    assert loading.target_threads(options, stock=False, reads=True) is None  # a drafter's trees: theirs to share
    # a server's lanes (loaded not stock): several requests' rows a pass, whose arithmetic outweighs the read
    assert loading.target_threads(LoadOptions(parallel=4, drafter="none"), stock=False, reads=True) is None


def test_a_streamed_targets_one_token_passes_are_timed_for_the_next_plan(
        f16_file, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed target times its one-token passes. Kept (models.kept.keep_streamed_pass), a run where all of it stayed
    resident gives the next plan the rate of a streamed target's resident part (computed from the file's mapping:
    slower than the repacked weights' in RAM the plan otherwise scales it from), and one that streamed part of it the
    drive's rate during passes: the plan then prices a pass of that run's placement at that run's time."""
    from dataclasses import asdict, replace

    from edge.models.kept import PLAIN_PASSES_KEPT, keep_streamed_pass
    from edge.models.planning import measured_rates
    from edge.models.registry import load_registry
    from edge.offload.machine import parse_machine
    from edge.offload.plan import MAPPED_SHARE, Shape, pass_cost, plan_pair
    from edge.runtimes import default_threads

    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))  # a pass-times.json of its own
    size, passes = f16_file.stat().st_size, PLAIN_PASSES_KEPT
    with windowed(f16_file, size // 8, resident=size // 2) as (target, _):
        streamer = target.streamer
        assert isinstance(streamer, WindowedStreamer)
        target.prefill([1, 2, 3, 4])
        target.verify(chain([5, 6, 7]))  # a tree's pass: not timed
        assert target.timing.passes == 0
        for token in range(5, 5 + passes):
            target.truncate(4)
            target.verify(chain([token]))
        timing = target.timing
        assert timing.passes == passes and timing.seconds > 0
        assert (timing.resident_bytes, timing.streamed_bytes) == (passes * streamer.resident_bytes,
                                                                  passes * streamer.streamed_bytes)
    threads = default_threads()
    machine = parse_machine(f"ram=8G,disk=2GB/s,cores={threads},rambw=20GB/s")
    pair, shape = load_registry().pair("smollm2-135m"), Shape.from_gguf(f16_file)
    streamed = replace(plan_pair(pair, shape, None, machine, stream=True, plain=True).target,
                       resident_bytes=streamer.resident_bytes)
    resident = replace(streamed, resident_bytes=shape.streamed_bytes)  # all of it, computed from the mapping
    assert pass_cost(resident, machine, 1).seconds == pytest.approx(shape.streamed_bytes / (20e9 * MAPPED_SHARE),
                                                                    rel=0.05)
    # a run with all of it resident, 2 ms a pass: its rate; too few passes, or another file's, are no measure
    keep_streamed_pass(f16_file, {"passes": passes - 1, "seconds": 1.0, "streamed_bytes": 0}, threads)
    assert measured_rates(machine, f16_file) == machine
    keep_streamed_pass(f16_file, {"passes": passes, "seconds": 0.002 * passes, "streamed_bytes": 0}, threads)
    measured = measured_rates(machine, f16_file)
    assert measured.mapped_gbps == pytest.approx(shape.streamed_bytes / 0.002 / 1e9, rel=1e-2)
    assert pass_cost(resident, measured, 1).seconds == pytest.approx(0.002, rel=0.02)
    # then this run, which streamed part of it: the drive's rate that its passes imply
    keep_streamed_pass(f16_file, asdict(timing), threads)
    measured = measured_rates(machine, f16_file)
    assert measured.mapped_gbps == pytest.approx(shape.streamed_bytes / 0.002 / 1e9, rel=1e-2)
    assert measured.disk_gbps != machine.disk_gbps
    assert pass_cost(streamed, measured, 1).seconds == pytest.approx(timing.seconds / passes, rel=0.05)
