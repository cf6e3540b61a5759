"""The placement plan: machine descriptions, models.toml facts, where each part goes, what a pass costs, the probe's
GPU and disk readings, and `edge-spec plan` as users type it. No model is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import edge.offload.probe as probe
import numpy as np
import pytest
from edge.cli.main import app
from edge.cli.render import flag
from edge.models.cache import JsonFile
from edge.models.registry import ModelFacts, load_registry
from edge.models.sources import model_path
from edge.offload.machine import parse_machine
from edge.offload.plan import (
    GIB,
    KV_RESERVE_CELLS,
    Shape,
    kv_bytes,
    plan_pair,
)
from typer.testing import CliRunner

from edge.errors import UserError

LLAMA_70B = load_registry().pair("llama3.1-70b")  # target and drafter sized from models.toml facts
DESCRIBED = "ram=32G,vram=24G,disk=3GB/s"
runner = CliRunner()


def shapes(pair=LLAMA_70B) -> tuple[Shape, Shape]:
    assert pair.target.facts is not None and pair.drafter.facts is not None
    return Shape.from_facts(pair.target.facts), Shape.from_facts(pair.drafter.facts)


# the 70B pair with a context of KV_RESERVE_CELLS: its KV cache planned whole, no room of it lent to weights
SHORT_70B = replace(LLAMA_70B, ctx=KV_RESERVE_CELLS)


def plan_on(machine: str, pair=LLAMA_70B):
    return plan_pair(pair, *shapes(pair), parse_machine(machine))


# --- --machine descriptions ---


def test_machine_description() -> None:
    machine = parse_machine(DESCRIBED)
    assert (machine.ram_free, machine.vram_free, machine.disk_gbps) == (32 * GIB, 24 * GIB, 3.0)
    assert (machine.cores, machine.pcie_gbps, machine.ram_gbps) == (8, 25.0, 20.0)
    assert machine.assumed == ("cores", "pcie", "rambw")


def test_machine_units_and_optional_keys() -> None:
    machine = parse_machine(" RAM=1.5GiB, disk=3500MB/s ,cores=4,rambw=40 ")
    assert machine.ram_free == int(1.5 * GIB) and machine.vram_free == 0
    assert (machine.disk_gbps, machine.cores, machine.ram_gbps) == (3.5, 4, 40.0)
    assert machine.assumed == ()  # pcie is moot without a GPU
    assert parse_machine("ram=512M,vram=8GB,pcie=16GB/s").vram_free == 8 * GIB


@pytest.mark.parametrize(("text", "fragment"), [
    ("", "is not key=value"),
    ("ram", "'ram' is not key=value"),
    ("ram=lots", "ram=lots is not a size like 32G"),
    ("ram=32", "ram=32 is not a size"),
    ("ram=0G", "'ram' must be more than 0"),
    ("vram=24G", "'ram' is missing"),
    ("ram=32G,ram=16G", "'ram' is given twice"),
    ("ram=32G,gpu=1", "unknown key 'gpu'"),
    ("ram=32G,disk=fast", "disk=fast is not a speed like 3GB/s"),
    ("ram=32G,disk=0GB/s", "disk=0GB/s is not a speed"),
    ("ram=32G,cores=0", "cores must be a positive whole number"),
])
def test_bad_machine_descriptions(text: str, fragment: str) -> None:
    with pytest.raises(UserError) as info:
        parse_machine(text)
    message = str(info.value)
    assert message.startswith("machine: ") and fragment in message and "\n" not in message
    assert info.value.worded(flag).startswith("--machine: ")
    assert "ram=32G,vram=24G,disk=3GB/s" in message  # says what to write instead


# --- models.toml facts ---

FACTS_PAIR = """
[pairs.x]
target.hf = "user/big-GGUF:Q4_0"
target.size_gb = 40.12
target.layers = 80
target.embd = 8192
target.kv_heads = 8
target.head_dim = 128
drafter.hf = "user/small-GGUF:Q4_0"
"""


def test_facts_are_parsed(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(FACTS_PAIR + "target.params_b = 70\n")
    pair = load_registry(path).pair("x")
    assert pair.target.facts == ModelFacts(size_gb=40.12, layers=80, embd=8192, kv_heads=8, head_dim=128, params_b=70.0)
    assert pair.drafter.facts is None
    shape = Shape.from_facts(pair.target.facts)
    assert (shape.file_bytes, shape.n_params, shape.n_layers) == (40_120_000_000, 70_000_000_000, 80)


def test_shipped_real_pairs_have_facts() -> None:
    registry = load_registry()
    for name in ("llama3.1-70b", "qwen2.5-72b", "gemma3-27b"):
        pair = registry.pair(name)
        assert pair.target.facts is not None and pair.drafter.facts is not None, name
        assert pair.target.facts.size_gb > 10 * pair.drafter.facts.size_gb


@pytest.mark.parametrize(("old", "new", "fragment"), [
    ("target.layers = 80", 'target.layers = "80"', "'layers' must be a positive integer, got '80'"),
    ("target.kv_heads = 8", "target.kv_heads = 0", "'kv_heads' must be a positive integer, got 0"),
    ("target.size_gb = 40.12", "target.size_gb = -1", "'size_gb' must be a positive number, got -1"),
    ("", "target.params_b = true", "'params_b' must be a positive number, got True"),
    ("", "drafter.size_gb = 0.77", "need all of size_gb, layers, embd, kv_heads, head_dim; missing layers, embd"),
    ("", "drafter.size = 0.77", "unknown key 'size'"),
])
def test_bad_facts(tmp_path: Path, old: str, new: str, fragment: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(FACTS_PAIR.replace(old, new) if old else FACTS_PAIR + new + "\n")
    with pytest.raises(UserError) as info:
        load_registry(path)
    message = str(info.value)
    assert str(path) in message and "pair 'x'" in message and fragment in message and "\n" not in message


# --- placement ---


def test_fits_in_ram() -> None:
    plan = plan_on("ram=64G,disk=3GB/s")
    assert (plan.target.placement, plan.target.n_gpu_layers, plan.target.op_offload) == ("ram", 0, False)
    assert plan.drafter.placement == "ram" and plan.drafter.use_mmap
    assert plan.ssd_bytes == 0
    # one token reads every weight once from RAM: 40.12 GB at 20 GB/s
    assert plan.one_token.bound == "RAM" and plan.one_token.seconds == pytest.approx(40.12 / 20, rel=0.01)


def test_bigger_than_ram_streams_from_the_ssd() -> None:
    # 6 GiB: past the 2 GiB headroom and the drafter, room for the whole context's KV cache (2.5 GiB at 8192 tokens)
    # and the stream's pages. Until the context fills, the cache's room holds weights: the plan counts its first
    # KV_RESERVE_CELLS cells, and the resident set gives the cache room as it grows.
    held = plan_on("ram=6G,disk=3GB/s")
    target = held.target
    reserve = -(-target.kv_bytes * KV_RESERVE_CELLS // 8192)
    assert target.placement == "ssd" and target.use_mmap and target.kv_cells == KV_RESERVE_CELLS
    assert target.ram_bytes == reserve + target.resident_bytes
    assert 0.8 * (target.kv_bytes - reserve) < target.resident_bytes <= target.kv_bytes - reserve
    assert held.ssd_bytes == target.shape.streamed_bytes - target.resident_bytes
    assert any(f"{KV_RESERVE_CELLS} tokens' worth" in note for note in held.notes)
    assert not held.drafter.use_mmap  # kept out of the page cache the target streams through
    plan = plan_on("ram=3.5G,disk=3GB/s", SHORT_70B)  # room for the KV cache and the stream's pages alone
    assert plan.target.resident_bytes == 0 and plan.ssd_bytes == plan.target.shape.streamed_bytes
    # the CPU computes from the mapping: the drive's read (40.12 GB at 3 GB/s) and the arithmetic add up
    compute = 2 * plan.target.shape.n_params / (8 * 135e9)  # seconds a token on 8 described cores
    assert plan.one_token.bound == "disk" and plan.one_token.seconds == pytest.approx(40.12 / 3 + compute, rel=0.01)
    # 256 tokens: 2 x 70.6G x 256 / (8 x 135 GFLOP/s) = 33.5 s of arithmetic, after the 13.4 s read
    assert LLAMA_70B.budget == "auto" and plan.tree.n_tokens == 256  # auto plans for the largest tree
    assert plan.tree.bound == "CPU compute" and plan.tree.seconds == pytest.approx(40.12 / 3 + 33.5, rel=0.01)
    small = plan_on("ram=3.5G,disk=3GB/s", replace(SHORT_70B, budget=16))
    assert small.tree.bound == "disk" and small.tree.seconds == pytest.approx(40.12 / 3 + 17 * compute, rel=0.01)


def test_kv_cache_size() -> None:
    target, drafter = shapes()
    # 2 (K, V) x 80 layers x 8 heads x 128 dims x 8192 tokens x 2 bytes
    assert kv_bytes(target, 8192, "bf16") == 2 * 80 * 8 * 128 * 8192 * 2 == int(2.5 * GIB)
    assert kv_bytes(target, 8192, "q4_0") == int(2.5 * GIB * 18 / 64)
    assert plan_on(DESCRIBED).drafter.kv_bytes == kv_bytes(drafter, 8192 + 256, "q4_0")


def test_refuses_a_drafter_larger_than_memory() -> None:
    with pytest.raises(UserError) as info:
        plan_on("ram=2.5G")
    message = str(info.value)
    assert "drafter needs 0.79 GiB (weights 0.72 GiB + KV cache 0.07 GiB)" in message
    assert "0.50 GiB of RAM is free past a 2.00 GiB headroom" in message


def test_refuses_a_kv_cache_that_does_not_fit() -> None:
    with pytest.raises(UserError) as info:
        plan_on("ram=4G")
    message = str(info.value)
    assert "KV cache for 8192 tokens needs 2.50 GiB of RAM but 1.21 GiB is free" in message
    assert "lower the context (--ctx)" in info.value.worded(flag)
    small_ctx = replace(LLAMA_70B, ctx=2048)
    assert plan_on("ram=4G", small_ctx).target.placement == "ssd"


# --- GGUF headers ---


def _write_part(path: Path, first: bool, tensors: dict[str, np.ndarray], heads: int = 4) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    if first:
        writer.add_block_count(2)
        writer.add_embedding_length(64)
        writer.add_head_count(heads)
        writer.add_head_count_kv(2)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_header_with_zero_heads_is_one_line(tmp_path: Path) -> None:
    _write_part(tmp_path / "zero.gguf", True, {"token_embd.weight": np.zeros((10, 64), np.float32)}, heads=0)
    with pytest.raises(UserError, match=r"zero.gguf: GGUF key llama.attention.head_count is 0, not a positive count"):
        Shape.from_gguf(tmp_path / "zero.gguf")


def test_shape_of_a_split_gguf(tmp_path: Path) -> None:
    weight = np.zeros((64, 64), np.float32)  # 16 KiB
    table = np.zeros((10, 64), np.float32)
    _write_part(tmp_path / "m-00001-of-00002.gguf", True, {"token_embd.weight": table, "blk.0.attn_q.weight": weight})
    _write_part(tmp_path / "m-00002-of-00002.gguf", False, {"blk.1.attn_q.weight": weight, "output.weight": table})
    shape = Shape.from_gguf(tmp_path / "m-00001-of-00002.gguf")
    assert (shape.n_layers, shape.n_embd, shape.n_kv_heads, shape.head_dim) == (2, 64, 2, 16)
    assert shape.file_bytes == 2 * weight.nbytes + 2 * table.nbytes
    assert shape.layer_bytes == 2 * weight.nbytes
    assert shape.streamed_bytes == shape.file_bytes - table.nbytes  # token_embd is looked up, not streamed
    assert shape.n_params == 2 * weight.size + table.size
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(UserError, match=r"part 1 of 2; missing m-00002-of-00002\.gguf: download"):
        Shape.from_gguf(tmp_path / "m-00001-of-00002.gguf")


# --- the probe ---


def test_disk_speed_is_measured_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(4 << 20))
    cache = tmp_path / "machine.json"
    speed = probe.disk_read_gbps(model, store=JsonFile(cache), sample_bytes=4 << 20)
    assert speed is not None and speed > 0
    entry = json.loads(cache.read_text())[probe.machine_key(model)]
    assert entry["disk_read_gbps"] == round(speed, 3)

    def measure_again(*_args):
        raise AssertionError("measured again")

    monkeypatch.setattr(probe, "_measure_disk", measure_again)
    # the same drive: any file on it, or the folder, reads the cache
    assert probe.disk_read_gbps(model, store=JsonFile(cache), sample_bytes=4 << 20) == round(speed, 3)
    assert probe.disk_read_gbps(tmp_path, store=JsonFile(cache)) == round(speed, 3)


@pytest.mark.parametrize("stored", [None, "fast", [1.0], 1e-300, 0, -1, float("nan"), float("inf"), True])
def test_a_damaged_disk_speed_in_the_cache_is_measured_again(tmp_path: Path, stored: object,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """machine.json is data a person may edit: a read speed that is not one is measured again, with one line."""
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(2 << 20))
    cache = tmp_path / "machine.json"
    entry = {"disk_read_gbps": stored, "sample_bytes": 1, "measured": 0, "method": probe.DISK_METHOD}
    cache.write_text(json.dumps({probe.machine_key(model): entry}))
    speed = probe.disk_read_gbps(model, store=JsonFile(cache), sample_bytes=2 << 20)
    assert speed is not None and 1e-4 <= speed <= 1e3
    assert "is not a read speed: measuring the drive again" in caplog.text
    assert json.loads(cache.read_text())[probe.machine_key(model)]["disk_read_gbps"] == round(speed, 3)


def test_disk_speed_of_a_small_file_uses_a_temporary_one(tmp_path: Path) -> None:
    model = tmp_path / "small.gguf"
    model.write_bytes(b"GGUF" + bytes(1000))
    speed = probe.disk_read_gbps(model, store=JsonFile(tmp_path / "cache" / "machine.json"), sample_bytes=2 << 20)
    assert speed is not None and speed > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "small.gguf"]  # the temporary file is gone


# --- edge-spec plan ---


def test_plan_json_on_a_described_machine() -> None:
    result = runner.invoke(app, ["plan", "llama3.1-70b", "--machine", DESCRIBED, "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert (plan["pair"], plan["ctx"], plan["budget"]) == ("llama3.1-70b", 8192, "auto")
    assert plan["machine"]["ram_free_gib"] == 32.0 and plan["machine"]["vram_free_gib"] == 24.0
    target, drafter = plan["target"], plan["drafter"]
    assert (target["file"], target["layers"], target["placement"]) == ("models.toml facts", 80, "ram")
    assert 0 < target["n_gpu_layers"] < 80 and not target["op_offload"] and target["n_ubatch"] >= 256
    assert (drafter["placement"], drafter["n_gpu_layers"]) == ("gpu", 17)
    assert plan["target_pass"]["tokens_n"] == 256
    assert 0 < plan["target_pass"]["tokens_1_s"] <= plan["target_pass"]["tokens_n_s"]


def test_plan_table_on_a_described_machine() -> None:
    result = runner.invoke(app, ["plan", "llama3.1-70b", "--machine", "ram=16G,disk=3GB/s"])
    assert result.exit_code == 0, result.output
    assert "plan for llama3.1-70b: ctx 8192, budget auto (up to 255)" in result.stdout
    assert "target pass: 1 token " in result.stdout and "target resident " in result.stdout
    assert "uses of the memory" in result.stdout and "chosen: " in result.stdout


def test_plan_shows_what_auto_runs_where_the_pair_as_named_does_not_fit() -> None:
    """4.8 GB: the 70B target's KV cache fits, its drafter's memory beside it does not. `plan` shows the plan auto
    applies (the target alone), says why the pair as named cannot run, and lists no drafter it will not load."""
    result = runner.invoke(app, ["plan", "llama3.1-70b", "--machine", "ram=4800M,disk=2GB/s"])
    assert result.exit_code == 0, result.output
    assert "budget none (plain decoding)" in result.stdout and "with its drafter it cannot run here" in result.stdout
    assert "drafter settings" not in result.stdout and "chosen: plain decoding" in result.stdout


def test_plan_errors_are_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["plan", "llama3.1-70b", "--machine", "ram=lots"])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "ram=lots is not a size" in result.stderr
    models = tmp_path / "models.toml"
    models.write_text('[pairs.x]\ntarget.hf = "nobody/nothing-GGUF:Q4_0"\ndrafter.from = "target"\n')
    result = runner.invoke(app, ["--models", str(models), "plan", "x", "--machine", DESCRIBED])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert "the target file is not here and" in result.stderr and "gives no facts about it" in result.stderr
    assert "Traceback" not in result.output


def test_plan_reads_local_gguf_headers(smollm2: object) -> None:
    """The pair's files are here (the smollm2 fixture fetches them): plan reads their headers, not the facts."""
    pair = load_registry().pair("smollm2-135m")
    assert all((path := model_path(m)) is not None and path.is_file() for m in (pair.target, pair.drafter))
    result = runner.invoke(app, ["plan", "smollm2-135m", "--machine", "ram=8G", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["target"]["file"] == str(model_path(pair.target))
    assert (plan["target"]["layers"], plan["target"]["placement"], plan["drafter"]["runtime"]) == (30, "ram", "onnx")
    assert plan["target"]["kv_cache_gib"] == round(2 * 30 * 3 * 64 * 4096 * 2 / GIB, 3)  # 3 KV heads of 64, bf16


def test_plan_loads_no_runtime() -> None:
    code = ("import sys, cli.main; cli.main.app(['plan', 'llama3.1-70b', '--machine', 'ram=32G', '--json'], "
            "standalone_mode=False); print('loaded', 'llama_cpp' in sys.modules, 'onnxruntime' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("loaded False False")


# --- plan --acceptance: expected tokens/s by budget from a bench run's tokens per pass ---


def bench_json(path: Path, tokens: dict[int, float], draft_s: float = 0.5) -> Path:
    """A bench --json result with a plain row, an auto row, and one tree row per budget (two rules at 16)."""
    rows = [{"method": "plain", "budget": None, "tokens_per_pass": 1.0, "draft_s_per_round": 0.0},
            {"method": "tree", "budget": "auto", "tokens_per_pass": 9.0, "draft_s_per_round": 0.1}]
    rows += [{"method": "tree", "budget": b, "accept": "residual", "tokens_per_pass": t, "draft_s_per_round": draft_s}
             for b, t in tokens.items()]
    if 16 in tokens:
        rows.append({"method": "tree", "budget": 16, "accept": "match", "tokens_per_pass": tokens[16] / 2,
                     "draft_s_per_round": draft_s})
    path.write_text(json.dumps({"pair": "smollm2-135m", "target": "x.gguf", "placement": "ssd", "sampling": "greedy",
                                "rows": rows}))
    return path


def test_acceptance_is_read_from_the_tree_rows_of_a_bench(tmp_path: Path) -> None:
    from edge.offload.expected import read_acceptance

    measured = read_acceptance(bench_json(tmp_path / "b.json", {16: 4.0, 64: 6.0}))
    assert measured.tokens_per_pass == {16: 4.0, 64: 6.0}  # the better of two rules at 16; auto and plain left out
    assert measured.draft_s == {16: 0.5, 64: 0.5}
    assert "smollm2-135m" in measured.source and "placement ssd" in measured.source


@pytest.mark.parametrize(("content", "fragment"), [
    (None, "no such file"),
    ("{not json", "is not a bench JSON"),
    ('{"pair": "x"}', 'has no "rows"'),
    ('{"rows": [{"method": "plain", "budget": null}]}', "has no tree rows with a fixed budget"),
    ('{"rows": [{"method": "tree", "budget": 16}]}', "lacks tokens_per_pass"),
])
def test_a_bad_acceptance_file_is_one_line(tmp_path: Path, content: str | None, fragment: str) -> None:
    path = tmp_path / "b.json"
    if content is not None:
        path.write_text(content)
    result = runner.invoke(app, ["plan", "llama3.1-70b", "--machine", "ram=16G,disk=3GB/s", "--acceptance", str(path)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and fragment in result.stderr, result.output


def test_expected_rates_pick_the_fastest_budget(tmp_path: Path) -> None:
    from edge.offload.expected import expected_rates, pick, read_acceptance

    plan = plan_on("ram=3.5G,disk=3GB/s", SHORT_70B)  # nothing resident: 13.5 s a token from the drive, +0.13 s more
    rates = expected_rates(plan, read_acceptance(bench_json(tmp_path / "b.json", {16: 4.0, 255: 8.0})))
    plain, sixteen, large = rates
    assert plain.budget == 0 and plain.tokens_per_s == pytest.approx(1 / plan.one_token.seconds)
    per_token = 2 * plan.target.shape.n_params / (8 * 135e9)
    assert sixteen.verify_s == pytest.approx(plan.one_token.seconds + 19 * per_token)  # 16 nodes, root, 3 carried
    assert sixteen.tokens_per_s == pytest.approx(4.0 / (0.5 + sixteen.verify_s))
    assert large.verify_s > 3 * plan.one_token.seconds  # 263 tokens compute for ~34 s
    assert pick(rates) is sixteen
    # a drafter the target never agrees with: plain decoding
    assert pick(expected_rates(plan, read_acceptance(bench_json(tmp_path / "c.json", {16: 1.0, 64: 1.05})))).budget == 0


def test_plan_acceptance_prints_the_pick(tmp_path: Path) -> None:
    path = bench_json(tmp_path / "b.json", {16: 4.0, 64: 5.0, 255: 8.0})
    args = ["plan", "llama3.1-70b", "--machine", "ram=16G,disk=3GB/s", "--acceptance", str(path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "expected with the tokens per pass of smollm2-135m" in result.stdout
    assert "the plan would pick budget 16:" in result.stdout
    data = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert data["acceptance"]["pick"] == 16 and [r["budget"] for r in data["acceptance"]["rates"]] == [0, 16, 64, 255]


def test_plan_placement_ssd_streams_a_target_that_fits() -> None:
    """`plan --placement ssd` plans what `--placement ssd` runs: the target read from the drive every pass."""
    args = ["plan", "llama3.1-70b", "--machine", "ram=64G,disk=3GB/s"]
    fits = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert fits["target"]["placement"] == "ram" and fits["target"]["repack"]
    result = runner.invoke(app, [*args, "--placement", "ssd", "--json"])
    assert result.exit_code == 0, result.output
    streamed = json.loads(result.stdout)
    assert streamed["target"]["placement"] == "ssd" and not streamed["target"]["repack"]
    assert streamed["target_pass"]["bound_1"] == "disk"
    assert streamed["target_pass"]["tokens_1_s"] > 5 * fits["target_pass"]["tokens_1_s"]  # 3 GB/s, not 20
    assert any("streamed as asked" in note for note in streamed["notes"])
    bad = runner.invoke(app, [*args, "--placement", "disk"])
    assert bad.exit_code == 1 and bad.stderr.count("\n") == 1 and "--placement must be ram or ssd" in bad.stderr


def test_under_a_memory_limit_a_drafter_graph_holds_only_its_expanded_rows_logits() -> None:
    """A llama.cpp drafter holds logits for its whole batch (a tree's nodes); an ONNX drafter's graph gives each
    expanded node's top-k, so the headroom under a memory limit counts the rows one pass expands (15 at 256 nodes)."""
    from edge.offload.plan import UNKNOWN_VOCAB, _headroom

    pair = load_registry().pair("qwen2.5-coder-1.5b")
    target, drafter = shapes(pair)
    capped = replace(parse_machine("ram=1G,disk=3GB/s"), capped=True)
    row = 2 * (drafter.n_vocab or UNKNOWN_VOCAB) * 4
    assert _headroom(capped, target, drafter, 256, "llama_cpp") - _headroom(capped, target, drafter, 256, "onnx") \
        == row * (256 - 15)
    assert _headroom(capped, target, drafter, 256, "by-architecture") == \
        _headroom(capped, target, drafter, 256, "llama_cpp")  # chosen at load: assume the larger
    uncapped = parse_machine("ram=1G,disk=3GB/s")
    assert _headroom(uncapped, target, drafter, 256, "onnx") == _headroom(uncapped, target, drafter, 256, "llama_cpp")


def test_under_a_memory_limit_auto_plans_smaller_trees_until_the_logits_fit() -> None:
    """The real pair under a 1.2 GiB memory limit: 256-node trees' logits (576 rows x 151,936 floats for the target)
    leave no room for the drafter, smaller trees do; the plan says how large, and loading sizes the target so.
    A fixed budget keeps its size (and is refused where it does not fit); with no limit nothing changes."""
    pair = load_registry().pair("qwen2.5-coder-1.5b")
    assert pair.budget == "auto"
    capped = replace(parse_machine("ram=1.2G,disk=3GB/s"), capped=True)
    plan = plan_pair(pair, *shapes(pair), capped)
    assert plan.tree.n_tokens in (129, 65, 33, 17) and plan.target.placement == "ssd"
    assert any(f"at most {plan.tree.n_tokens} nodes" in note for note in plan.notes)
    assert plan_pair(pair, *shapes(pair), parse_machine("ram=4G,disk=3GB/s")).tree.n_tokens == 256
    with pytest.raises(UserError, match="memory limit"):
        plan_pair(replace(pair, budget=255), *shapes(pair), capped)


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_a_file_planned_without_a_drafter_model(drafter: str) -> None:
    """`edge-spec plan FILE --drafter none` (or lookup) plans the target alone: it once asked the traits of the
    drafter runtime chosen at load ("unknown runtime 'by-architecture'")."""
    from edge.models.opening import materialize

    target = materialize(load_registry().pair("smollm2-135m").target, lambda message: None)
    result = CliRunner().invoke(app, ["plan", str(target), "--drafter", drafter, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["drafter"]["placement"] == "none"
