"""Streamed layers read past the page cache (offload/direct.py), on the real SmolLM2 target rewritten to F16 with half
of it resident: each streamed layer is read straight into a slot and moved into the target's mapping before the pass
computes it, moved back after, and the logits are those of the target in RAM; where the file system refuses direct
reads, or a read fails, the page cache reads the layers as before."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from edge.offload import direct as direct_module
from edge.offload.direct import PAGE, interiors
from edge.offload.window import WindowedStreamer

from tests.test_ssd import chain
from tests.test_window import windowed


def _direct_refused(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return True
    return False


def _mapping_equals_file(streamer: WindowedStreamer, path) -> bool:
    """Whether the target's mapping reads the file's bytes over every streamed run (every page touched)."""
    data = np.fromfile(path, np.uint8)
    for runs in streamer._regions.values():
        for start, end, offset in runs:
            if end > start:
                mapped = np.ctypeslib.as_array((ctypes.c_ubyte * (end - start)).from_address(start))
                if not np.array_equal(mapped, data[offset:offset + end - start]):
                    return False
    return True


def test_a_layers_interior_is_its_whole_pages_less_the_first_and_a_partial_last() -> None:
    base = 1 << 30
    pieces, edges = interiors([(base, base + 5 * PAGE + 100, 7 * PAGE), (base + 8 * PAGE, base + 9 * PAGE, 10 * PAGE)])
    assert [(p.address, p.length, p.offset, p.at) for p in pieces] == [(base + PAGE, 4 * PAGE, 8 * PAGE, 0)]
    # the first run's first page and its last 100 bytes; the second run, one page, is all edge
    assert edges == [(7 * PAGE, PAGE), (12 * PAGE, 100), (10 * PAGE, PAGE)]


def test_streamed_layers_are_placed_before_the_pass_computes_them(f16_file) -> None:
    from edge.offload.ssd import read_bytes, resident_fraction

    size = f16_file.stat().st_size
    with windowed(f16_file, size // 8, resident=size // 2) as (target, in_ram):
        streamer = target.streamer
        assert isinstance(streamer, WindowedStreamer)
        direct = streamer._direct
        if _direct_refused(f16_file):  # (a file system without O_DIRECT: the page cache reads them, as before)
            assert direct is None
            return
        assert direct is not None and direct.slot_bytes > 0
        streamed = sorted(streamer._regions)
        placed_when_computed: dict[int, bool] = {}
        followed = streamer.on_layer

        def watch(layer: int) -> None:
            if layer in streamer._regions:
                placed_when_computed[layer] = direct.placed(layer)
            followed(layer)

        target.inner.follow_layers(watch)
        for prefetch in (False, True, False):
            target.truncate(0)
            target.prefill([1, 2, 3, 4])
            if prefetch:
                target.prefetch()
            placed_when_computed.clear()
            before = read_bytes()
            assert np.array_equal(target.verify(chain([5, 6, 7])), in_ram)
            streamer.wait_evicted()
            streamer._cancel_readahead()
            streamer._direct.release_all()
            assert sorted(placed_when_computed) == streamed
            # every layer with an interior is read directly and in place when the pass reaches it (a slot is free:
            # the window holds at least one)
            with_interior = [layer for layer in streamed if direct._layers[layer][0]]
            assert with_interior and all(placed_when_computed[layer] for layer in with_interior)
            assert read_bytes() - before >= 0.9 * streamer.streamed_bytes  # read from the drive, not from RAM
        assert resident_fraction(f16_file) < 0.6  # the streamed half never went through the page cache to stay
        assert not any(direct.placed(layer) for layer in streamed)  # all moved back ...
        assert _mapping_equals_file(streamer, f16_file)  # ... and the file mapped there again


def test_a_file_system_without_direct_reads_streams_through_the_page_cache(f16_file, monkeypatch) -> None:
    real_open = os.open

    def refuse(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_module.os, "open", refuse)
    size = f16_file.stat().st_size
    with windowed(f16_file, size // 8, resident=size // 2) as (target, in_ram):
        assert target.streamer._direct is None
        for _ in range(2):
            target.truncate(0)
            target.prefill([1, 2, 3, 4])
            target.prefetch()
            assert np.array_equal(target.verify(chain([5, 6, 7])), in_ram)


def test_a_failed_direct_read_ends_direct_reads_and_loses_nothing(f16_file, monkeypatch) -> None:
    if _direct_refused(f16_file):
        pytest.skip("this file system refuses O_DIRECT: the test above covers it")
    real_read = direct_module.libc.pread_into
    calls = {"n": 0}

    def fail_third(fd: int, address: int, length: int, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(5, "Input/output error")
        return real_read(fd, address, length, offset)

    monkeypatch.setattr(direct_module.libc, "pread_into", fail_third)
    size = f16_file.stat().st_size
    with windowed(f16_file, size // 8, resident=size // 2) as (target, in_ram):
        streamer = target.streamer
        assert streamer._direct is not None
        for _ in range(3):
            target.truncate(0)
            target.prefill([1, 2, 3, 4])
            target.prefetch()
            assert np.array_equal(target.verify(chain([5, 6, 7])), in_ram)
            streamer.wait_evicted()
        assert calls["n"] >= 3 and streamer._direct is None
        streamer._cancel_readahead()
        assert _mapping_equals_file(streamer, f16_file)


def test_the_slots_follow_the_window_and_count_as_its_own(f16_file, monkeypatch) -> None:
    """Between passes the window is fitted again with the slots' bytes counted as the window's own (held), and the
    slots shrink or grow to what it holds."""
    import edge.offload.window as window_module

    if _direct_refused(f16_file):
        pytest.skip("this file system refuses O_DIRECT")
    monkeypatch.setattr(window_module, "REFIT_S", 0.0)
    size = f16_file.stat().st_size
    with windowed(f16_file, size // 8, resident=size // 2) as (target, in_ram):
        streamer = target.streamer
        direct = streamer._direct
        assert direct is not None
        helds: list[int] = []
        window = [direct.slot_bytes * 3]

        def fit(resident_bytes: int, held: int) -> int:
            helds.append(held)
            return window[0]

        streamer._fit = fit
        for slots in (3, 1, 2):
            window[0] = direct.slot_bytes * slots
            target.truncate(0)
            target.prefill([1, 2, 3, 4])
            target.prefetch()
            assert np.array_equal(target.verify(chain([5, 6, 7])), in_ram)
            streamer.wait_evicted()
            streamer._cancel_readahead()
            direct.release_all()
            assert direct.bytes <= direct.slot_bytes * slots
        assert max(helds) > 0  # the slots taken were counted as the window's


def test_the_environment_can_turn_direct_reads_off(f16_file, monkeypatch) -> None:
    monkeypatch.setenv(direct_module.OFF_SWITCH, "0")
    size = f16_file.stat().st_size
    with windowed(f16_file, size // 8, resident=size // 2) as (target, in_ram):
        assert target.streamer._direct is None
        target.prefill([1, 2, 3, 4])
        assert np.array_equal(target.verify(chain([5, 6, 7])), in_ram)


def test_a_window_smaller_than_a_layer_takes_no_slot(f16_file) -> None:
    """A slot holds a whole layer: where the window holds less (a large model's layer in little memory), no slot is
    taken past it, and the page cache reads every layer as before."""
    if _direct_refused(f16_file):
        pytest.skip("this file system refuses O_DIRECT")
    size = f16_file.stat().st_size
    with windowed(f16_file, size // 8, resident=size // 2) as (target, in_ram):
        streamer = target.streamer
        direct = streamer._direct
        assert direct is not None and direct.slots_for(direct.slot_bytes - 1) == 0
        streamer._cancel_readahead()
        direct.release_all()
        direct.resize(0)
        for _ in range(2):
            target.truncate(0)
            target.prefill([1, 2, 3, 4])
            target.prefetch()
            assert np.array_equal(target.verify(chain([5, 6, 7])), in_ram)
            assert direct.bytes == 0 and not any(direct.placed(layer) for layer in streamer._regions)


def test_a_target_read_directly_leaves_no_core_to_the_read_ahead(f16_file, monkeypatch) -> None:
    """Loading asks, before anything loads, whether the streamed layers will be read directly: then a plainly decoding
    target computes on every core (loading.target_threads is told its passes read nothing through the page cache)."""
    from edge.offload.direct import reads_directly

    assert reads_directly(f16_file) == (not _direct_refused(f16_file))
    monkeypatch.setenv(direct_module.OFF_SWITCH, "0")
    assert not reads_directly(f16_file)
