"""The plan's rates from this machine's own passes: where `--budget auto` timed a target's passes in RAM, or a target
decoding plainly kept its one-token pass (pass-times.json), the plan prices passes at the rates they imply instead of
the assumed ones (models/planning.py measured_rates)."""

from __future__ import annotations

from pathlib import Path

import pytest
from edge.models.cache import JsonFile
from edge.models.registry import load_registry
from edge.offload.machine import parse_machine
from edge.offload.plan import Shape, plan_pair


def test_the_plan_prices_passes_at_the_rates_this_machine_measured(tmp_path: Path, monkeypatch) -> None:
    """Where --budget auto has timed this target's passes in RAM here (pass-times.json), the plan prices a pass with
    the RAM rate and compute those passes imply, not the assumed ones; a damaged entry is passed over."""
    from edge.models.cache import cache_dir
    from edge.models.opening import materialize
    from edge.models.planning import measured_rates
    from edge.offload.probe import machine_key

    target = materialize(load_registry().pair("smollm2-135m").target, lambda message: None)
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))  # a pass-times.json of its own (the run's may have some)
    machine = parse_machine("ram=8G,disk=2GB/s,cores=2")
    assert measured_rates(machine, target) == machine  # nothing timed yet
    stat_ = target.stat()
    key = f"{machine_key(target)}|{target.name}|{stat_.st_size}|{stat_.st_mtime_ns}|drafter|ram|readahead None"
    store = JsonFile(cache_dir() / "pass-times.json")
    store.write({key + "|damaged": {"target_ms": "x"}, key: {"target_ms": {"1": 10.0, "64": 80.0}}})
    measured = measured_rates(machine, target)
    shape = Shape.from_gguf(target)
    assert measured.ram_gbps == pytest.approx(shape.streamed_bytes / 0.010 / 1e9, rel=1e-2)
    assert measured.cpu_gflops_per_core == pytest.approx(2 * shape.n_params * 64 / 0.080 / 2 / 1e9, rel=1e-2)
    assert "rambw" not in measured.assumed
    plan = plan_pair(load_registry().pair("smollm2-135m"), shape, None, measured, plain=True)
    assert plan.one_token.seconds == pytest.approx(0.010, rel=0.05)


def test_plain_decoding_in_ram_leaves_its_pass_time_for_the_next_plan(tmp_path: Path, monkeypatch) -> None:
    """A target decoding plainly on llama.cpp's own kernels times its one-token passes (the prompt's pass apart);
    kept (models.kept.keep_plain_pass), they give the next plan its RAM rate where nothing else timed the file in
    RAM, so that the plan predicts that pass, not the assumed rate's. A server's lanes' one-size entry (their passes
    padded to the GEMM's rows) is no such measure."""
    from edge.models.cache import cache_dir
    from edge.models.kept import PLAIN_PASSES_KEPT, keep_plain_pass
    from edge.models.opening import materialize
    from edge.models.planning import measured_rates
    from edge.offload.probe import machine_key
    from edge.runtimes import ModelOptions
    from edge.runtimes.llama_cpp import open_target

    from edge.generate import Decoder

    target_file = materialize(load_registry().pair("smollm2-135m").target, lambda message: None)
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    target = open_target(target_file, ModelOptions(n_ctx=256, threads=1, stock=True), 1)
    try:
        steps = list(Decoder(target).reply(target.tokenizer.tokenize("The capital of France is", True, False), 24))
        passes = steps[-1].stats.target_passes
        assert target.one_token_passes == passes - 1 > 0  # the first pass ran the prompt with the first token
        assert 0 < target.one_token_s < steps[-1].stats.decode_s + steps[-1].stats.prefill_s
        seconds = target.one_token_s
    finally:
        target.close()
    machine = parse_machine("ram=8G,disk=2GB/s,cores=2")
    stat_ = target_file.stat()
    lanes_key = f"{machine_key(target_file)}|{target_file.name}|{stat_.st_size}|{stat_.st_mtime_ns}|lanes|ram|x"
    JsonFile(cache_dir() / "pass-times.json").write({lanes_key: {"target_ms": {"1": 500.0}}})
    assert measured_rates(machine, target_file) == machine  # one padded size: not the plain pass
    keep_plain_pass(target_file, seconds, PLAIN_PASSES_KEPT - 1)
    assert measured_rates(machine, target_file) == machine  # too few passes to keep
    keep_plain_pass(target_file, 0.52, 20)  # 26 ms a pass
    measured = measured_rates(machine, target_file)
    assert "rambw" not in measured.assumed and measured.cpu_gflops_per_core == machine.cpu_gflops_per_core
    plan = plan_pair(load_registry().pair("smollm2-135m"), Shape.from_gguf(target_file), None, measured, plain=True)
    assert plan.one_token.seconds == pytest.approx(0.026, rel=0.05)
