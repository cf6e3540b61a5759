"""benchmarks/memcap.py: a child under a cgroup v1 memory cap below the size of SmolLM2's F16 file decodes the same
greedy tokens as without the cap, reading the file from the disk on every pass (the kernel streams it); the cgroup is
gone afterwards, also when the child fails or is killed for memory. Skipped where cgroups cannot be made (not root, no
v1 memory controller)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import memcap

MIB = 1 << 20
CAP = 200 * MIB  # the file is 258 MiB; the child allocates ~45 MiB of its own (killed at 80 MiB here)
PROMPT = [1, 504, 3458, 28, 2]

reason = memcap.unavailable()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"no memory cgroups here: {reason}")


def greedy(path: Path, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """n greedy tokens of the target alone, and the bytes read from storage by each pass."""
    from edge.offload.ssd import read_bytes
    from edge.runtimes.llama_cpp import RunOptions, load_target

    from edge.tree import TokenTree

    target = load_target(path, RunOptions(n_ctx=64, kv_type="bf16"))
    tokens, reads = [], []
    try:
        target.prefill(prompt[:-1])
        last = prompt[-1]
        for _ in range(n):
            tree = TokenTree.root(last)
            before = read_bytes() or 0
            logits = target.verify(tree)  # [1, n_vocab]
            reads.append((read_bytes() or 0) - before)
            last = int(np.argmax(logits[0]))
            target.commit(tree, [0])
            tokens.append(last)
    finally:
        target.close()
    return tokens, reads


def fail() -> None:
    raise ValueError("on purpose")


def allocate(n_bytes: int) -> int:
    block = np.ones(n_bytes, np.uint8)  # touched: resident
    return int(block.sum())


def left_behind() -> list[str]:
    """This process's cgroups still there (another test run may have its own at the same time)."""
    mount = memcap.own_memory_folder()
    return sorted(p.name for p in mount.glob(f"edge-spec-{os.getpid()}-*")) if mount else []


def test_a_capped_child_streams_the_file_and_decodes_the_same_tokens(f16_file: Path) -> None:
    size = f16_file.stat().st_size
    assert size > CAP
    tokens, _ = greedy(f16_file, PROMPT, 3)
    run = memcap.call_capped(greedy, f16_file, PROMPT, 3, limit_bytes=CAP, drop_cache=[f16_file])
    capped_tokens, reads = run.value
    assert capped_tokens == tokens
    assert run.peak_bytes <= CAP and run.oom_kills == 0
    assert 0 < run.peak_anon_bytes < CAP / 2  # the rest of the cap went to the file's pages, reclaimed as it streamed
    assert min(reads) > 0.5 * size, [r // MIB for r in reads]  # every pass read (most of) the file from the disk
    assert left_behind() == []


def test_a_failure_or_an_oom_kill_removes_the_cgroup() -> None:
    with pytest.raises(RuntimeError, match="ValueError: on purpose"):
        memcap.call_capped(fail, limit_bytes=64 * MIB)
    with pytest.raises(MemoryError, match=r"died under a 64 MiB cap \(killed for memory"):
        memcap.call_capped(allocate, 256 * MIB, limit_bytes=64 * MIB)
    assert left_behind() == []


def test_a_command_runs_inside_its_cgroup() -> None:
    run = memcap.run_capped([sys.executable, "-c", "print(open('/proc/self/cgroup').read())"], 64 * MIB)
    assert run.returncode == 0 and run.oom_kills == 0
    line = next(line for line in run.stdout.splitlines() if "memory" in line.split(":")[1].split(","))
    assert line.split(":")[2].rsplit("/", 1)[1].startswith("edge-spec-")
    assert left_behind() == []


def streams(path: Path) -> str:
    """--placement ssd's check (models.loading.on_ssd) on a target loaded as a streamed one: its type, or its
    refusal."""
    from edge.models.loading import on_ssd
    from edge.runtimes.llama_cpp import RunOptions, load_target

    from edge.errors import UserError

    target = load_target(path, RunOptions(n_ctx=64, kv_type="bf16", repack=False))
    try:
        wrapped = on_ssd(target, path, readahead=False)
    except UserError as error:
        return str(error)
    wrapped.close()
    return type(wrapped).__name__


def test_the_ssd_check_accepts_a_file_streamed_under_a_cap_smaller_than_it(f16_file: Path) -> None:
    """Under a cap below the file, the pass's first pages are evicted before it ends: the check counts the bytes the
    pass read from the drive, not only what the page cache holds after it (it refused this file before)."""
    run = memcap.call_capped(streams, f16_file, limit_bytes=CAP, drop_cache=[f16_file])
    assert run.value == "SsdTarget"


def probe_and_plan() -> tuple[dict, dict | str]:
    """What the probe and the plan see in the child: its machine facts, and smollm2-135m's plan (or the one line that
    refuses it)."""
    from edge.models.loading import resolve_spec
    from edge.models.planning import make_plan
    from edge.offload.probe import probe_machine

    from edge.errors import UserError
    from edge.options import LoadOptions

    spec, models_file = resolve_spec(LoadOptions(pair="smollm2-135m"))
    try:
        return probe_machine(), make_plan(spec, None, models_file or Path("models.toml")).as_dict()
    except UserError as problem:
        return probe_machine(), str(problem)


def test_the_probe_and_the_plan_read_the_memory_limit() -> None:
    """Under a cap the machine has the cap, not the host's RAM: under 1 GiB the plan places smollm2-135m within it;
    under 300 MiB (less than its models, caches and logits need) it refuses in one line that says why."""
    machine, plan = memcap.call_capped(probe_and_plan, limit_bytes=1024 * MIB).value
    assert machine["memory_limit"] is not None and machine["memory_limit"].endswith("memory.limit_in_bytes")
    assert 0.9 < machine["ram_total_gb"] <= 1.01 and machine["ram_free_gb"] < machine["ram_total_gb"]
    assert isinstance(plan, dict), plan
    assert plan["machine"]["memory_limited"] is True and plan["machine"]["ram_free_gib"] < 1
    assert plan["memory"]["ram_gib"] < 1
    machine, refused = memcap.call_capped(probe_and_plan, limit_bytes=300 * MIB).value
    assert machine["ram_total_gb"] <= 300 / 1024 + 0.01
    assert isinstance(refused, str) and "\n" not in refused and "memory limit" in refused, refused
