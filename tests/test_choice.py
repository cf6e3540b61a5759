"""Partial residency in the plan (what of a target stays resident, what a pass reads from the drive) and the plan's
choice of a use of the memory (offload/choice.py), for given sizes: the 70B pair's models.toml facts and the real
Qwen2.5-Coder pair's shapes (as their GGUF headers give them) on machines described by their free memory. No model
is loaded."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from edge.models.registry import load_registry
from edge.offload.choice import choose, reason, weigh_uses
from edge.offload.machine import Machine, parse_machine
from edge.offload.plan import (
    GIB,
    KV_RESERVE_CELLS,
    MAPPED_SHARE,
    RAM_HEADROOM,
    UNHIDDEN_SHARE,
    Shape,
    plan_pair,
    stream_room,
)

from edge.budget import prior_tokens
from edge.errors import UserError
from tests.test_plan import LLAMA_70B, plan_on, shapes

MIB = 2**20
QWEN = load_registry().pair("qwen2.5-coder-1.5b")
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M and its 0.5B drafter, read from their headers (Shape.from_gguf)
TARGET = Shape(n_layers=28, n_embd=1536, n_kv_heads=2, head_dim=128, n_params=1543714304, file_bytes=1111370240,
               layer_bytes=788652032, streamed_bytes=980097536, source="test", n_vocab=151936)
DRAFTER = Shape(n_layers=24, n_embd=896, n_kv_heads=2, head_dim=64, n_params=494032768, file_bytes=485452288,
                layer_bytes=247213056, streamed_bytes=391859712, source="test", n_vocab=151936)


def machine(room_mib: int | None, disk_gbps: float = 1.2) -> Machine:
    """This 2-core machine: with `room_mib`, the room under a memory limit; else 20 GiB free."""
    if room_mib is None:
        return Machine(ram_free=20 << 30, disk_gbps=disk_gbps, cores=2)
    return Machine(ram_free=room_mib * MIB, disk_gbps=disk_gbps, cores=2, capped=True)


def chosen(room_mib: int | None, disk_gbps: float = 1.2, lookup: bool = True):
    uses = weigh_uses(QWEN, TARGET, DRAFTER, machine(room_mib, disk_gbps), lookup)
    return choose(uses), {use.name: use for use in uses}


@pytest.mark.parametrize("ram_gib", [16, 24, 32])
def test_what_fits_beside_the_rest_stays_resident_and_only_the_rest_streams(ram_gib: int) -> None:
    """A 40 GB target with 16-32 GiB free: everything but the headroom, the drafter, the KV cache and the stream's
    own room (2 layers in flight) stays resident; a pass reads only the rest from the drive."""
    plan = plan_on(f"ram={ram_gib}G,disk=3GB/s")
    target, shape = plan.target, plan.target.shape
    reserve = -(-target.kv_bytes * KV_RESERVE_CELLS // plan.ctx)  # the KV cache's first cells (then it takes room)
    room = ram_gib * GIB - RAM_HEADROOM - plan.drafter.ram_bytes - reserve
    assert stream_room(shape) == pytest.approx(2 * shape.layer_bytes / 80, abs=1)
    assert target.placement == "ssd" and target.resident_bytes == pytest.approx(room - stream_room(shape), abs=4096)
    assert plan.ssd_bytes == shape.streamed_bytes - target.resident_bytes
    assert target.ram_bytes == reserve + target.resident_bytes <= ram_gib * GIB - RAM_HEADROOM
    compute = 2 * shape.n_params / (8 * 135e9)
    # the resident part at the rate of weights computed from the file's mapping (or its arithmetic, the longer), while
    # the drive reads the streamed part ahead (the longer of the two, and a share of the shorter), then the streamed
    # part's arithmetic
    resident_s = max(target.resident_bytes / (20e9 * MAPPED_SHARE),
                     compute * target.resident_bytes / shape.streamed_bytes)
    read_s = plan.ssd_bytes / 3e9
    streamed_s = compute * plan.ssd_bytes / shape.streamed_bytes
    overlapped = max(resident_s, read_s) + UNHIDDEN_SHARE * min(resident_s, read_s)
    assert plan.one_token.seconds == pytest.approx(overlapped + streamed_s, rel=1e-6)
    assert plan.one_token.seconds < plan_on("ram=6G,disk=3GB/s").one_token.seconds
    assert plan.as_dict()["memory"]["resident_gib"] == pytest.approx(target.resident_bytes / GIB, abs=1e-3)
    note = next(note for note in plan.notes if "does not fit" in note)
    assert "stay in RAM" in note


def test_placement_ssd_keeps_nothing_resident() -> None:
    """--placement ssd streams a target that would fit: as a larger one, every byte from the drive."""
    plan = plan_pair(LLAMA_70B, *shapes(), parse_machine("ram=64G,disk=3GB/s"), stream=True)
    assert plan.target.placement == "ssd" and plan.target.resident_bytes == 0
    assert plan.ssd_bytes == plan.target.shape.streamed_bytes



def test_in_ram_on_two_cores_trees_do_not_pay_and_the_target_decodes_plainly() -> None:
    use, uses = chosen(None)
    assert use.name == "plain" and use.plan.target.placement == "ram" and use.plan.drafter.placement == "none"
    assert uses["drafter"].plan.target.placement == "ram"  # it would fit beside the drafter too: not why
    assert uses["drafter"].tokens_per_s < use.tokens_per_s and uses["lookup"].tokens_per_s < use.tokens_per_s
    assert "plain decoding, the target wholly in RAM on llama.cpp's own kernels" in reason(use, list(uses.values()))


def test_where_only_plain_decoding_fits_the_line_says_so() -> None:
    """180 MiB of room (about what a 250 MiB limit leaves): nothing fits but the target alone, nearly all of it
    streamed, and the plan's line says so, where it said "(against  tokens/s)"."""
    use, uses = chosen(180)
    assert list(uses) == ["plain"] and use.plan.target.placement == "ssd"
    assert reason(use, list(uses.values())).endswith("tokens/s predicted (nothing else fits)")


def test_where_the_drafter_would_push_the_target_out_of_memory_it_is_dropped() -> None:
    """Room for the target, its KV cache and one row of logits, not for the drafter beside them: the drafter would
    cost nearly all of the target's residency, so the target keeps the memory and decodes plainly from RAM."""
    use, uses = chosen(1300)
    assert uses["drafter"].plan.target.placement == "ssd"
    assert uses["drafter"].plan.target.resident_bytes < TARGET.streamed_bytes / 4
    assert use.name == "plain" and use.plan.target.placement == "ram"
    assert use.tokens_per_s > 3 * uses["drafter"].tokens_per_s


def test_a_little_less_room_keeps_most_of_the_target_resident() -> None:
    """Room for all but ~180 MiB of the target (its KV cache's first cells counted): it stays resident but for that,
    which streams every pass."""
    use, _ = chosen(900)
    target = use.plan.target
    assert use.name == "plain" and target.placement == "ssd"
    assert TARGET.streamed_bytes / 2 < target.resident_bytes < TARGET.streamed_bytes
    assert use.plan.ssd_bytes == TARGET.streamed_bytes - target.resident_bytes


def test_the_kv_caches_room_past_its_first_cells_holds_weights_but_not_beside_lanes() -> None:
    """With 1000 MiB free the target decodes plainly: its KV cache is counted for KV_RESERVE_CELLS cells, and the
    room of the rest of its 4096 (98 MiB) stays resident until the context needs it. A server's lanes fill caches of
    their own, which no pass of the target follows: with them the plan counts every cell."""
    from dataclasses import replace

    from edge.offload.plan import kv_bytes

    use, _ = chosen(1000)
    target = use.plan.target
    whole, reserve = kv_bytes(TARGET, 4096, "f16"), kv_bytes(TARGET, KV_RESERVE_CELLS, "f16")
    assert use.name == "plain" and target.placement == "ssd" and target.kv_cells == KV_RESERVE_CELLS
    assert target.ram_bytes == -(-target.kv_bytes * KV_RESERVE_CELLS // 4096) + target.resident_bytes
    assert whole == 4096 * 28 * 1024 and target.kv_cell_bytes() == 28 * 1024
    lanes = plan_pair(replace(QWEN, ctx=5 * 4096, contexts=5), TARGET, None, machine(1000), plain=True)
    alone = plan_pair(replace(QWEN, ctx=5 * 4096), TARGET, None, machine(1000), plain=True)
    assert lanes.target.kv_cells == 0 and lanes.target.ram_bytes == lanes.target.kv_bytes + lanes.target.resident_bytes
    assert alone.target.resident_bytes - lanes.target.resident_bytes == pytest.approx(5 * whole - reserve, abs=4096)


def test_where_no_use_fits_the_refusal_says_what_the_target_alone_needs() -> None:
    """Under a 200 MiB limit (150 MiB free once started) not even the target alone fits: the one line says what that
    smallest use needs (its KV cache), not what the drafter would have needed."""
    with pytest.raises(UserError) as refused:
        weigh_uses(QWEN, TARGET, DRAFTER, machine(150), True)
    assert "the target's" in str(refused.value) and "KV cache for 4096 tokens needs 0.11 GiB" in str(refused.value)
    assert "drafter" not in str(refused.value)  # no drafter in that use: nothing is "past the drafter"


def test_where_neither_fits_a_slow_drive_makes_the_drafters_trees_pay() -> None:
    """Far below the target's own size every use streams most of it: a pass costs the drive's read whatever it
    carries, and the drafter's trees share that read over several tokens. (The 70B pair with 12 GiB: the Qwen pair's
    0.5B drafter is a third of its target, whose memory the target's own residency repays better at every limit.)"""
    target, drafter = shapes()
    room = Machine(ram_free=12 * GIB, disk_gbps=0.05, cores=2, capped=True)  # a slow drive (a network share)
    uses = {use.name: use for use in weigh_uses(LLAMA_70B, target, drafter, room, True)}
    use = choose(list(uses.values()))
    assert {u.plan.target.placement for u in uses.values()} == {"ssd"}
    assert use.name == "drafter" and use.budget >= 8
    assert use.tokens_per_pass == pytest.approx(prior_tokens(use.budget))
    assert uses["plain"].plan.target.resident_bytes > use.plan.target.resident_bytes  # the drafter's memory


def test_the_resident_share_grows_with_the_memory() -> None:
    residents = [chosen(room)[1]["plain"].plan.target.resident_bytes for room in (700, 800, 900, 1000)]
    assert residents == sorted(residents) and residents[0] < residents[-1]
    streamed = [chosen(room)[1]["plain"].plan.ssd_bytes for room in (700, 800, 900, 1000)]
    assert streamed == sorted(streamed, reverse=True)


def test_without_lookup_it_is_not_weighed() -> None:
    assert "lookup" not in chosen(None, lookup=False)[1]


def test_where_nothing_fits_the_plan_refuses_in_one_line() -> None:
    with pytest.raises(UserError) as refused:
        chosen(120)
    assert "\n" not in str(refused.value) and "cannot run here" in str(refused.value)


def test_under_a_limit_a_target_in_ram_keeps_slack_for_its_pages() -> None:
    """Under a memory limit a target is placed in RAM only with CAPPED_PAGE_SLACK to spare past its pages and KV cache
    (the kernel's reclaim evicts pages every pass reads otherwise: 742 MB a pass under 1175 MiB); short of that, it
    keeps all but the stream's room resident and streams the rest. Without a limit, no slack."""
    from edge.offload.plan import CAPPED_PAGE_SLACK, PLAIN_HEADROOM, kv_bytes

    in_use = plan_pair(QWEN, TARGET, None, machine(None), plain=True).target.ram_bytes  # pages and KV cache
    logits = 4 * TARGET.n_vocab
    just_fits = (in_use + PLAIN_HEADROOM + logits) // MIB + 8  # fits, with less than the slack to spare
    tight = plan_pair(QWEN, TARGET, None, machine(just_fits), plain=True).target
    assert tight.placement == "ssd" and tight.resident_bytes > 0.8 * TARGET.streamed_bytes
    roomy = plan_pair(QWEN, TARGET, None, machine(just_fits + CAPPED_PAGE_SLACK // MIB), plain=True).target
    assert roomy.placement == "ram" and roomy.ram_bytes == in_use
    assert in_use > kv_bytes(TARGET, QWEN.ctx, "f16")


def test_a_target_that_fits_beside_its_stream_room_reads_nothing() -> None:
    """Room for all of a streamed target's weights keeps all of them, not all but a page's remainder: a plan that
    reads 2560 bytes a pass would leave a core to a read-ahead with nothing to read (models/loading.py)."""
    from edge.offload.plan import resident_share

    assert TARGET.streamed_bytes % 4096 == 2560
    assert resident_share(TARGET, TARGET.streamed_bytes, 4 << 30) == TARGET.streamed_bytes
    assert resident_share(TARGET, TARGET.streamed_bytes, 600 << 20) % 4096 == 0  # part of it: whole pages


def test_an_onnx_drafter_is_planned_at_its_built_graphs_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An onnx drafter holds its graph's weights (Gemma-3-270M's 486 MB against its 253 MB GGUF): once the graph is
    built beside the file, the plan counts its size, not the GGUF's (runtimes/onnx derived_bytes); before, and for a
    llama.cpp drafter, the file's."""
    from edge.models import planning
    from edge.runtimes.onnx import GRAPH_VERSION

    from tests.ggufs import write_gguf

    def built(version: int, data_bytes: int) -> None:
        graph = tmp_path / f"tiny.int4-full-kv4.v{version}.onnx"
        graph.write_bytes(b"g" * 100)
        Path(f"{graph}.data").write_bytes(bytes(data_bytes))

    gguf = write_gguf(tmp_path / "tiny.gguf", shape=True)
    pair = load_registry().pair("gemma3-270m")
    monkeypatch.setattr(planning, "_local_file", lambda model: gguf)
    size = Shape.from_gguf(gguf).file_bytes
    assert pair.drafter.runtime == "onnx"
    assert planning.model_shape(pair, "drafter", pair.drafter, None).file_bytes == size  # no graph yet
    built(GRAPH_VERSION, 4 * size)
    built(GRAPH_VERSION - 1, 8 * size)  # an older build's: not what loads
    assert planning.model_shape(pair, "drafter", pair.drafter, None).file_bytes == 100 + 4 * size
    on_llama_cpp = replace(pair.drafter, runtime="llama_cpp")
    assert planning.model_shape(pair, "drafter", on_llama_cpp, None).file_bytes == size
    assert planning.model_shape(pair, "target", pair.target, None).file_bytes == size
