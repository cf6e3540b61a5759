"""The GPU path, with no GPU and the default CPU build: what llama.cpp reports it can run layers on, how the plan
uses a GPU it can and cannot use, and the one-line refusal of layers for a GPU the build lacks. The runs on a real
GPU backend are benchmarks/gpu_check.py's (Vulkan here, CUDA where lent)."""

from __future__ import annotations

import stat
from pathlib import Path

import edge.offload.probe as probe
import pytest
from edge.models.cache import JsonFile
from edge.models.planning import check_gpu_layers, usable_gpus
from edge.models.registry import load_registry
from edge.offload.machine import parse_machine, probe_here
from edge.offload.plan import GIB, GPU_RESERVE, PLACEMENT_KEYS, Shape, plan_pair
from edge.runtimes.llama_cpp.devices import Device, backend_line, devices
from edge.runtimes.llama_cpp.kernels import gpu_guarantee

from edge.errors import UserError
from tests.cli_helpers import assert_one_line_error, run

LLAMA_70B = load_registry().pair("llama3.1-70b")  # sized from models.toml facts: nothing is loaded
DESCRIBED = "ram=32G,vram=24G,disk=3GB/s"
RTX = {"name": "NVIDIA GeForce RTX 4090", "vram_total_gb": 24.0, "vram_free_gb": 23.0}
RADEON = Device("Vulkan0", "AMD Radeon RX 7800 XT (RADV NAVI32)", "gpu", free=15 * GIB, total=16 * GIB)
INTEGRATED = Device("Vulkan0", "Intel(R) Graphics (ADL GT2)", "igpu", free=23 * GIB, total=23 * GIB)


def _plan(machine, plain: bool = False):
    assert LLAMA_70B.target.facts is not None and LLAMA_70B.drafter.facts is not None
    return plan_pair(LLAMA_70B, Shape.from_facts(LLAMA_70B.target.facts), Shape.from_facts(LLAMA_70B.drafter.facts),
                     machine, plain=plain)


def plan_on(machine: str):
    return _plan(parse_machine(machine))


def _here(tmp_path, monkeypatch, smi: list[dict], gpus: tuple[Device, ...]):
    """This machine as the plan probes it, with nvidia-smi and llama.cpp's devices as given (RAM: 32 GiB free)."""
    monkeypatch.setattr("edge.offload.probe.probe_gpus", lambda: smi)
    monkeypatch.setattr("edge.runtimes.llama_cpp.gpu_devices", lambda: gpus)
    monkeypatch.setattr("edge.offload.probe.probe_machine", lambda: {
        "cpu": "a CPU", "cores": 8, "ram_total_gb": 64.0, "ram_free_gb": 32.0, "memory_limit": None, "gpus": smi})
    return probe_here(None, JsonFile(tmp_path / "machine.json"), usable_gpus())


# --- the plan's GPU split, for described VRAM sizes ---


def test_gpu_layers_fill_free_vram() -> None:
    plan = plan_on(DESCRIBED)
    target, drafter, shape = plan.target, plan.drafter, plan.target.shape
    assert drafter.placement == "gpu" and drafter.n_gpu_layers == drafter.shape.n_layers + 1
    assert target.placement == "ram" and 0 < target.n_gpu_layers < shape.n_layers
    per_layer = shape.layer_bytes / shape.n_layers + target.kv_bytes / shape.n_layers
    vram_left = 24 * GIB - GPU_RESERVE - drafter.vram_bytes
    assert target.n_gpu_layers * per_layer <= vram_left < (target.n_gpu_layers + 1) * per_layer
    assert target.vram_bytes + drafter.vram_bytes <= 24 * GIB - GPU_RESERVE
    # a tree sees the kernels a one-token pass sees: the layers left on the CPU are computed there, not uploaded to
    # the GPU from 32 tokens (op offload: other kernels, other logits); the CPU then paces a 256-token pass
    assert not target.op_offload and target.n_ubatch >= plan.tree.n_tokens
    assert plan.tree.bound == "CPU compute" and plan.one_token.bound == "RAM"
    assert _plan(parse_machine(DESCRIBED), plain=True).target.op_offload  # verifying no tree, it may offload
    assert plan.placement() == {"target": target.options(), "drafter": drafter.options()}
    assert set(target.options()) == set(PLACEMENT_KEYS)


def test_a_tree_target_with_no_gpu_layer_is_not_offloaded() -> None:
    """No VRAM left for the target's layers (a small card, the drafter first): its trees stay on the CPU's
    batch-invariant kernels rather than go to the GPU's from 32 tokens; verifying no tree, it may offload."""
    plan = plan_on("ram=64G,vram=1600M")
    assert plan.target.n_gpu_layers == 0 and not plan.target.op_offload
    assert plan.tree.bound != "PCIe"
    plain = _plan(parse_machine("ram=64G,vram=1600M"), plain=True)
    assert plain.target.n_gpu_layers == 0 and plain.target.op_offload


def test_more_vram_more_gpu_layers_until_all_fit() -> None:
    layers = [plan_on(f"ram=32G,vram={v}G").target.n_gpu_layers for v in (8, 16, 24, 48)]
    assert layers == sorted(layers) and layers[0] > 0
    whole = plan_on("ram=32G,vram=80G").target
    assert (whole.placement, whole.n_gpu_layers, whole.ram_bytes) == ("gpu", 81, 0)  # 80 layers + the output head


def _fake_nvidia_smi(folder: Path, output: str) -> None:
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)


def test_gpus_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert probe.probe_gpus() == []  # no tool: no GPU, quietly
    _fake_nvidia_smi(tmp_path, "NVIDIA GeForce RTX 4090, 24564, 23000\\nBroken, [N/A], [N/A]\\n")
    assert probe.probe_gpus() == [{"name": "NVIDIA GeForce RTX 4090", "vram_total_gb": 23.99, "vram_free_gb": 22.46}]


# --- this machine's GPUs, as nvidia-smi and llama.cpp report them ---


def test_llama_cpp_names_what_it_runs_layers_on() -> None:
    """The default install is the CPU build: its one device is the CPU, and the line `plan` and `check` print says
    so (a GPU build lists its GPUs first: "CUDA0 (NVIDIA ..., 22.5 of 24.0 GiB free), CPU")."""
    found = devices()
    assert any(device.name == "CPU" and device.kind == "cpu" for device in found)
    assert backend_line().endswith("CPU")
    assert RADEON.describe() == "Vulkan0 (AMD Radeon RX 7800 XT (RADV NAVI32), 15.0 of 16.0 GiB free)"
    assert RADEON.backend == "Vulkan" and RADEON.offloads and INTEGRATED.offloads


def test_a_gpu_the_build_cannot_use_gets_no_layers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi sees a card, the installed llama.cpp is a CPU build: the plan places every layer off the GPU
    (it would otherwise plan layers that llama.cpp silently keeps in RAM)."""
    machine = _here(tmp_path, monkeypatch, [RTX], ())
    assert machine.vram_free == 0
    plan = _plan(machine)
    assert plan.target.n_gpu_layers == 0 and plan.drafter.placement != "gpu"


def test_the_gpu_a_build_reports_is_planned_as_nvidia_smi_would_be(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Vulkan (or HIP) build on a card nvidia-smi does not see: llama.cpp's own figure of the card's free memory
    sizes the split, the same split as a machine described with that VRAM."""
    machine = _here(tmp_path, monkeypatch, [], (RADEON,))
    assert machine.vram_free == 15 * GIB and "AMD Radeon" in machine.name
    split = _plan(machine).target.n_gpu_layers
    assert split == _plan(parse_machine("ram=32G,vram=15G,cores=8")).target.n_gpu_layers
    assert 0 < split < LLAMA_70B.target.facts.layers
    # with a CUDA build, nvidia-smi's figures are the plan's
    assert _here(tmp_path, monkeypatch, [RTX], (RADEON,)).vram_free == 23 * GIB


def test_an_integrated_gpu_gets_layers_only_when_asked(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An integrated GPU shares the RAM the plan already counts: no layers unless
    gpu_layers asks, and then they are not refused."""
    assert _here(tmp_path, monkeypatch, [], (INTEGRATED,)).vram_free == 0
    check_gpu_layers(29)


def test_layers_for_a_gpu_the_build_lacks_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("edge.runtimes.llama_cpp.gpu_devices", lambda: ())
    check_gpu_layers(0)  # nothing asked of a GPU: nothing to refuse
    with pytest.raises(UserError) as refused:
        check_gpu_layers(12)
    assert "no GPU backend" in str(refused.value) and refused.value.option == "gpu_layers"


@pytest.mark.parametrize("command", ["generate", "check"])
def test_the_cli_refuses_gpu_layers_in_one_line(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a model loads: a user with the CPU build who asks for GPU layers gets what is wrong and the fix."""
    monkeypatch.setattr("edge.runtimes.llama_cpp.gpu_devices", lambda: ())
    args = ["generate", "-m", "smollm2-135m", "-n", "4", "Hello"] if command == "generate" else \
        ["check", "smollm2-135m"]
    result = run(*args, "--gpu-layers", "8")
    assert_one_line_error(result, "no GPU backend")
    assert "--gpu-layers" in result.output and "reinstall llama-cpp-python" in result.output


def test_layers_on_a_gpu_carry_a_lossless_warning() -> None:
    """No GPU backend's kernels have been measured batch-invariant: a target with layers there says so in one line
    (the pair's lossless_warning, which chat, generate and serve print); one without layers there is exact."""
    assert gpu_guarantee(0, "Vulkan") is None
    warning = gpu_guarantee(14, "CUDA")
    assert warning is not None and "14 target layers run on CUDA" in warning and "gpu_layers 0" in warning


# --- passes padded to a backend's smallest batch (kernels.MIN_ROWS) ---


def test_a_padded_pass_gives_the_unpadded_logits_and_leaves_no_cell(files: dict) -> None:
    """Vulkan's kernels change below 9 rows, so a target with layers there pads each pass to 9 rows with throwaway
    tokens in a sequence of their own (each with an output, so that the output head multiplies 9 rows too). On the
    CPU's batch-invariant kernels the padding must change nothing: the same logits, bit for bit, for a prompt, a
    chain and a one-token pass, and no cell of the padding left in the cache after the pass."""
    import numpy as np
    from edge.runtimes.llama_cpp import RunOptions, load_target
    from edge.runtimes.llama_cpp.models import PAD_SEQ

    from edge.invariance import sequential_logits
    from edge.tree import TokenTree

    targets = [load_target(files["smol"], RunOptions(n_ctx=512, kv_type="bf16", min_rows=rows), 64)
               for rows in (1, 9)]
    try:
        tokens = targets[0].tokenizer.tokenize("A padded pass is the same pass. " * 8, add_special=True,
                                               parse_special=False)
        prefix, chain = tokens[:40], tokens[40:44]
        logits = []
        for target in targets:
            steps = sequential_logits(target, prefix, chain)  # one-token passes, padded to 9 rows on the second
            target.truncate(len(prefix))
            tree = TokenTree(np.array(chain, np.int32), np.arange(-1, len(chain) - 1, dtype=np.int32),
                             np.arange(len(chain), dtype=np.int32), np.zeros(len(chain), np.float32))
            logits.append((steps, target.verify(tree).copy()))
            assert target.ctx.seq_pos_max(PAD_SEQ) == -1  # the padding's cells are gone
        assert np.array_equal(logits[0][0], logits[1][0]) and np.array_equal(logits[0][1], logits[1][1])
        assert targets[1].n_ctx == targets[1].ctx.n_ctx - 8  # its room for the padding is not offered as context
    finally:
        for target in targets:
            target.close()


# --- a backend whose attention rounds a node by its cells verifies a tree's likeliest path (kernels.CHAIN_BACKENDS) ---


def test_a_tree_cut_to_its_likeliest_path_keeps_the_best_child_at_each_node() -> None:
    """TokenTree.spine: the root, then at each node its best-scored child (the lowest id among equals), to a leaf;
    the nodes the target puts first in its pass, in the cells plain decoding gives them."""
    import numpy as np

    from edge.tree import TokenTree

    #        0
    #      1   2        scores: 1 -1.0, 2 -0.5 -> 2
    #     3   4 5       4 -0.7, 5 -0.7 -> 4 (lower id)
    #           6
    tree = TokenTree(np.array([10, 11, 12, 13, 14, 15, 16], np.int32), np.array([-1, 0, 0, 1, 2, 2, 5], np.int32),
                     np.array([0, 1, 1, 2, 2, 2, 3], np.int32),
                     np.array([0, -1.0, -0.5, -1.2, -0.7, -0.7, -0.9], np.float32),
                     source=np.array([0, 1, 1, 1, 2, 1, 1], np.uint8))
    spine = tree.spine()
    assert spine.tokens.tolist() == [10, 12, 14] and spine.parents.tolist() == [-1, 0, 1]
    assert spine.depth.tolist() == [0, 1, 2] and spine.source.tolist() == [0, 1, 2] and spine.is_chain()
    assert not tree.is_chain() and TokenTree.root(3).spine().tokens.tolist() == [3]


def test_only_vulkan_targets_with_layers_there_verify_chains() -> None:
    from edge.runtimes.llama_cpp.kernels import chains_only

    assert chains_only(14, "Vulkan") and not chains_only(0, "Vulkan")
    assert not chains_only(14, "CUDA") and not chains_only(14, None)
    warning = gpu_guarantee(31, "Vulkan")
    assert warning is not None and "likeliest path" in warning and "gpu_layers 0" in warning


def test_a_target_that_verifies_chains_gets_chains_and_decodes_as_plain() -> None:
    """Every round's tree, grown or from lookup, reaches such a target as its likeliest path; greedy output stays the
    target's own, token for token."""
    from edge.sampling import SamplingConfig
    from tests.tiny import TinyModel, generate_tokens

    class ChainTarget(TinyModel):
        chains_only = True

        def __init__(self) -> None:
            super().__init__(n_vocab=12, seed=3)
            self.widths: list[int] = []

        def verify(self, tree):
            assert tree.is_chain(), tree.parents
            self.widths.append(len(tree))
            return super().verify(tree)

    target, plain = ChainTarget(), TinyModel(n_vocab=12, seed=3)
    drafter = TinyModel(n_vocab=12, seed=3).noisy(0.3)
    greedy = SamplingConfig()
    assert generate_tokens(target, drafter, 16, [1, 2, 3], 40, greedy) == \
        generate_tokens(plain, None, None, [1, 2, 3], 40, greedy)
    assert max(target.widths) > 1  # it did speculate


def test_the_check_of_a_target_that_verifies_chains_checks_chains(files: dict) -> None:
    """`edge-spec check` measures what such a target verifies: the chain, and the grown tree's likeliest path (here on
    the CPU, where both are exact)."""
    from edge.runtimes import DEFAULT, ModelOptions, runtime

    from edge.invariance import check_batch_invariance

    engine = runtime(DEFAULT)
    target = engine.open_target(files["smol"], ModelOptions(n_ctx=512, kv_type="bf16"), 64)
    drafter = engine.open_drafter(files["smol"], ModelOptions(n_ctx=512, kv_type="q4_0"), 256)
    target.chains_only = True
    try:
        tokens = target.tokenizer.tokenize("A chain is checked as it runs. " * 6, add_special=True,
                                           parse_special=False)
        results = check_batch_invariance(target, drafter, tokens)
    finally:
        drafter.close()
        target.close()
    assert [r.shape for r in results] == ["chain of 16", "grown, budget 255: its likeliest path"]
    assert all(r.nodes == r.nodes_checked and r.max_abs_diff == 0.0 for r in results)
    assert results[1].nodes > 2


def test_the_first_difference_probe_finds_none_on_the_cpu(files: dict) -> None:
    """benchmarks/first_difference.py, which named ggml-vulkan's flash attention as what moves a tree node off its
    likeliest path, reads every node of both passes back; on the CPU's batch-invariant kernels none differs."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "benchmarks/first_difference.py", "--node", "8"], capture_output=True,
                         text=True, cwd=repo, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["cell_in_tree"] != out["cell_plain"] and out["first_difference"] is None
    assert out["logits_max_abs_diff"] == 0.0 and out["attention_by_layer"] == [0.0] * 30  # SmolLM2's 30 layers
