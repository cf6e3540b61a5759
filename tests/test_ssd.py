"""--placement ssd on the real SmolLM2 target rewritten to F16 (offload/ssd.py): every pass reads the file from
the disk, readahead fills the page cache from a thread, the logits do not change; a Q4_0 target that llama.cpp would
copy into repacked buffers is loaded from the mapping when it streams (--placement ssd, or a plan that puts it on
the drive), and refused in one line where it was repacked."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
from edge.models.loading import on_ssd
from edge.models.opening import materialize
from edge.models.registry import load_registry
from edge.offload.ssd import SsdStreamer, SsdTarget, TensorRange, read_bytes, readahead_order, resident_fraction
from edge.runtimes.llama_cpp import RunOptions, load_target

from edge.errors import UserError
from edge.tree import TokenTree


def chain(tokens: list[int]) -> TokenTree:
    n = len(tokens)
    return TokenTree(np.array(tokens, np.int32), np.arange(-1, n - 1, dtype=np.int32), np.arange(n, dtype=np.int32),
                     np.zeros(n, np.float32))


def test_every_pass_reads_the_weights_and_logits_stay_the_same(f16_file) -> None:
    target = load_target(f16_file, RunOptions(n_ctx=256, kv_type="bf16"))
    try:
        target.prefill([1, 2, 3, 4])
        in_ram = target.verify(chain([5, 6, 7])).copy()
        target.truncate(0)
        ssd = on_ssd(target, f16_file, readahead=False)  # checks that a pass reads the mapping (and empties the cache)
        ssd.prefill([1, 2, 3, 4])
        size = f16_file.stat().st_size
        for _ in range(2):
            before = read_bytes()
            logits = ssd.verify(chain([5, 6, 7]))
            ssd.truncate(4)
            assert np.array_equal(logits, in_ram)
            ssd.streamer.wait_evicted()  # eviction runs in a thread after each pass
            assert resident_fraction(f16_file) < 0.05
            stamps = ssd.streamer.timeline[-1]  # for benchmarks/ssd_timeline.py
            assert stamps["evicted"] <= stamps["evicted_end"] and "read" not in stamps  # no readahead asked for
            if before is not None:
                assert read_bytes() - before > 0.8 * size  # the pass read (nearly) the whole file from storage
        ssd.streamer.close()
        ahead = SsdStreamer(f16_file, readahead=True)
        ahead.read_ahead_now()
        assert resident_fraction(f16_file) > 0.95  # read ahead: the next pass finds its weights in RAM
        assert np.array_equal(target.verify(chain([5, 6, 7])), in_ram)  # the inner target: no eviction after
        ahead.close()
    finally:
        target.close()


def test_a_q4_0_target_streams_unless_repacked(f16_file) -> None:
    """llama.cpp copies Q4_0 weights into repacked buffers on x86: loaded so, a pass reads nothing from the file and
    streaming it is refused; loaded without repacking (what load_pair does for a streamed target), it streams."""
    spec = load_registry().pair("smollm2-135m")
    q4_0 = materialize(replace(spec.drafter, quantize="q4_0"), lambda message: None)
    mapped = on_ssd(load_target(q4_0, RunOptions(n_ctx=256, kv_type="bf16", repack=False)), q4_0, readahead=False)
    assert isinstance(mapped, SsdTarget)
    mapped.close()
    target = load_target(q4_0, RunOptions(n_ctx=256, kv_type="bf16"))
    try:
        wrapped = on_ssd(target, q4_0, readahead=False)
    except UserError as error:
        assert "--target-dtype f16" in str(error)
    else:  # a CPU without repacked Q4_0 kernels maps the weights either way
        assert isinstance(wrapped, SsdTarget)
        wrapped.close()


def test_a_target_the_plan_streams_is_used_from_its_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target larger than RAM (the plan's placement "ssd"), without --placement ssd: loaded with repacking off, so
    a pass reads its weights from the file (a repacked Q4_0 copy would read nothing and could not fit)."""
    import edge.models.loading as loading_module
    from edge.models.loading import PlannedTarget

    import edge

    spec = load_registry().pair("smollm2-135m")
    q4_0 = materialize(replace(spec.drafter, quantize="q4_0"), lambda message: None)
    drafter = materialize(spec.drafter, lambda message: None)
    monkeypatch.setattr(loading_module, "planned_target", lambda *args, **kwargs: PlannedTarget(0, streamed=True))
    from edge.offload.window import WindowedTarget

    with edge.load(target=q4_0, drafter=drafter, ctx=256, budget=4) as pair:
        assert isinstance(pair.target, WindowedTarget)  # read ahead in a window that follows its passes
        assert pair.streamed and pair.placement == "ssd"
        inner = pair.target.inner
        streamer = SsdStreamer(q4_0, readahead=False)
        streamer.evict()
        inner.verify(chain([1, 2]))
        assert resident_fraction(q4_0) > 0.5  # the pass read the file: its weights are not a repacked copy
        streamer.close()


def test_readahead_reads_a_small_tied_table_first_a_large_one_last_and_an_untied_one_not_at_all() -> None:
    layers = [TensorRange(f"blk.{i}.ffn_up.weight", 1000 * (i + 1), 1000, 10) for i in range(4)]
    small, large = TensorRange("token_embd.weight", 0, 500, 50), TensorRange("token_embd.weight", 0, 9000, 50)
    norm, head = TensorRange("output_norm.weight", 9000, 10), TensorRange("output.weight", 9010, 500, 50)
    assert readahead_order([*layers, small, norm]) == [small, *layers, norm]
    assert readahead_order([*layers, large, norm]) == [*layers, large, norm]
    assert readahead_order([*layers, small, norm, head]) == [*layers, norm, head]  # the pass reads only its rows
    assert readahead_order(layers) == layers


def test_fetch_rows_reads_just_the_rows_of_the_tokens(f16_file) -> None:
    target = load_target(f16_file, RunOptions(n_ctx=64))
    streamer = SsdStreamer(f16_file, readahead=True)
    try:
        streamer.evict()
        streamer.fetch_rows([5, 40000, 40000, 10**9])  # duplicates and ids past the table are skipped
        resident, deadline = 0.0, time.perf_counter() + 10
        while resident == 0 and time.perf_counter() < deadline:  # the reads were only queued: wait for them
            time.sleep(0.05)
            resident = resident_fraction(f16_file)
        assert 0 < resident < 0.01  # a page or two per row (and a read-around at most), not the table
    finally:
        streamer.close()
        target.close()


def test_auto_measures_passes_started_with_the_reading(f16_file) -> None:
    """--budget auto's costs from the SSD with readahead: passes as placed, over read-ahead weights, and started
    together with the reading (the tail a pass adds after the last byte: edge.budget.Costs.verify_s)."""
    from edge.offload.tuning import measure_costs
    from edge.runtimes.llama_cpp import load_drafter

    from edge.budget import Costs

    spec = load_registry().pair("smollm2-135m")
    target = load_target(f16_file, RunOptions(n_ctx=256, kv_type="bf16"))
    drafter = load_drafter(materialize(replace(spec.drafter, quantize="q4_0"), lambda message: None),
                           RunOptions(n_ctx=256))
    ssd = on_ssd(target, f16_file, readahead=True)
    try:
        costs = measure_costs(ssd, drafter, list(range(1, 12)), max_tree=16)
        assert set(costs.target_ms) == set(costs.warm_ms) == set(costs.overlap_ms) == {1, 2, 4, 8, 16}
        assert costs.read_ahead_ms > 0 and all(ms > 0 for ms in costs.overlap_ms.values())
        ssd.streamer.wait_evicted()
        stamps = list(ssd.streamer.timeline)
        assert any("read" in s for s in stamps)  # the overlapped passes had the reading started with them
        assert Costs.from_json(costs.to_json()) == costs
    finally:
        ssd.streamer.close()
        drafter.close()
        target.close()
