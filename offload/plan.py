"""Where each part of a pair goes on a machine (GPU layers, RAM, mmap from SSD), and what a target pass costs.

`edge-spec plan` prints it before anything loads; `Plan.placement()` is what chat/generate/bench apply. The cost
model (docs/plan.md, "The cost of a pass"): a pass of an offloaded target costs the bytes it must move over the
bandwidth they move at, unless the arithmetic takes longer: t(n) = max(bytes / bandwidth, 2 * params * n / flops),
summed over the layers on the GPU and the layers off it. The machine it plans for is offload/machine.py's.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from edge.offload.machine import GIB, Machine, gib
from edge.runtimes import DEFAULT, TRAITS, traits

from edge.errors import UserError

if TYPE_CHECKING:
    from edge.models.registry import ModelFacts, ModelSpec, PairSpec

MIB = 1024**2
GB = 1e9

VRAM_GBPS = 500.0  # GB/s a GPU reads its own memory (RTX 3060: 360, RTX 4090: 1000)
# Fitted to a 70B-shaped Q4_0 target streamed from the SSD on 2 cores of an AMD EPYC, passes of 1 to 256 tokens
# (benchmarks/pass_times.py): 135 GFLOP/s per core on its large matrices. A small model's passes run slower (SmolLM2
# -135M Q4_1 in RAM: ~56), so the plan under-estimates small models' compute (docs/plan.md, "The constants").
CPU_GFLOPS_PER_CORE = 135.0
# A streamed target computes its resident part from the file's mapping, on ggml's generic kernels (a target placed
# in RAM runs on its repacked copy), with an eval callback at each layer (offload/window.py): Qwen2.5-Coder-1.5B's
# one-token pass, all of it resident under 1175 MiB, took 34.5 ms against 27 ms repacked in RAM (docs/plan.md). Its
# rate is that share of the RAM rate until its own passes are timed (Machine.mapped_gbps).
MAPPED_SHARE = 0.78
# A streamed target's read-ahead and its resident layers' arithmetic overlap, but not wholly: on 2 cores the
# read-ahead takes a core's time (page faults, copies) from the pass. A pass costs the longer of the two and this
# share of the shorter. The real pair's plain passes under 1049 and 900 MiB (78 and 235 MB read, 860 and 711 MiB
# resident) gave one drive rate, 1.0 GB/s, at 0.5; at 0 (full overlap) 0.79 and 0.97, and the plan's prediction
# under 1049 MiB was 36% fast (docs/plan.md, "The constants").
UNHIDDEN_SHARE = 0.5
GPU_TFLOPS = 80.0  # effective fp16 tensor-core matmul rate of a consumer GPU (about half an RTX 4090's dense peak)

RAM_HEADROOM = 2 * GIB  # left to the OS, Python, onnxruntime and logits buffers (255 x 262k float32 is 0.27 GB)
# Under a memory cgroup's limit the OS is not charged, and what the process holds already is counted as used: the
# headroom is for what loading adds besides weights and KV caches: onnxruntime's arenas, llama.cpp's compute graph,
# and each model's logits (its buffer and the graph's output: 2 x batch x vocabulary x 4 bytes, _logits_bytes).
CAPPED_HEADROOM = 192 * MIB
# ... of which a target decoding plainly alone (no onnxruntime, one row of logits) needs only its compute buffers and
# what Python allocates past the plan: measured, Qwen2.5-Coder-1.5B's process grew by 171 MiB from its plan to the end
# of 32 tokens, 112 MiB of it the 4096-token f16 KV cache (benchmarks/load_memory.py --cap-mb 1300)
PLAIN_HEADROOM = 64 * MIB
# Under a memory limit, a target placed in RAM needs this much past its pages and KV cache, or the kernel's reclaim
# evicts pages every pass reads: Qwen2.5-Coder-1.5B planned to fit with 25 MiB to spare under 1175 MiB (its Q4_K
# weights repacked into 596 MiB of anonymous memory) read 742 MB a pass; with 150 MiB under 1300 MiB, 4-5 MB.
CAPPED_PAGE_SLACK = 128 * MIB
MAX_SEQUENCES = 256  # llama.cpp's sequences per context: its output buffer holds at least as many rows
CAPPED_MIN_TREE = 17  # under a memory limit, auto's trees may be cut down to this many nodes to fit (budget 16)
# A streamed target's layers in memory at once (the one computed, the one read ahead), and never less memory than
# MIN_STREAM_ROOM for its pages: the real pair under 1049 MiB ran 5.79 / 7.66 / 7.10 tok/s with 128 / 64 / 32 MiB of
# it (docs/plan.md): what the stream does not need stays resident, and 8 MiB asks keep the drive busy in 64.
STREAM_ROOM_LAYERS = 2
MIN_STREAM_ROOM = 64 * MIB
# A streamed target's KV cache takes memory as its cells are written (runtimes/llama_cpp/_native.py gives back the
# pages llama.cpp zeroes at creation): the plan keeps room for this many cells, and the resident set gives the cache
# room past them as the context fills, KV_STEP_CELLS at a time (offload/window.py, WindowedTarget). A chat's first
# replies fit in it: Qwen2.5-Coder-1.5B under 1049 MiB kept 98 MiB more of its weights resident than with room for
# all 4096 cells, and read 94 MB a pass instead of 183 (11.4 against 7.4 tokens/s).
KV_RESERVE_CELLS = 512
KV_STEP_CELLS = 256
UNKNOWN_VOCAB = 262_144  # a vocabulary models.toml facts do not give: the largest of the common ones (Gemma's)
GPU_RESERVE = 3 * GIB // 2  # llama.cpp's CUDA context and compute buffers for a batch of a few hundred tokens
OP_OFFLOAD_MIN_BATCH = 32  # from this batch size llama.cpp computes CPU-resident layers on the GPU (uploading them)
BATCH_EXTRA = 64  # load_target's batch also carries the previous round's accepted tokens
DRAFTER_EXTRA_CTX = 256  # load_drafter's cells past the context for a round's expanded nodes (a larger tree's nodes)
AUTO_MAX_BUDGET = 255  # budget = "auto": the largest tree offload/tuning.py may pick (llama.cpp's 256 sequences)
# KV cache bytes per element: quantized types store blocks of 32 values plus one f16 scale.
KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
Q4_0_BYTES_PER_PARAM = 18 / 32  # to estimate parameters from a file size when models.toml does not give them

PLACEMENT_KEYS = ("placement", "n_gpu_layers", "op_offload", "n_ubatch", "use_mmap", "use_mlock", "repack")


@dataclass(frozen=True)
class Shape:
    """A model file's size and dimensions: read from its GGUF header, or stated in models.toml."""

    n_layers: int
    n_embd: int
    n_kv_heads: int
    head_dim: int
    n_params: int  # the matmul weights' parameters (a looked-up token table is not a matmul)
    file_bytes: int  # all tensors: what loading it occupies
    layer_bytes: int  # the repeating blocks, all layers together
    streamed_bytes: int  # what one pass reads: file_bytes less a looked-up token table
    source: str  # the file read, or "models.toml facts"
    n_vocab: int = 0  # 0: not known (models.toml facts)

    @classmethod
    def from_gguf(cls, path: Path) -> Shape:
        from edge.runtimes.gguf_file import gguf_shape

        shape = gguf_shape(path)
        return cls(n_layers=shape.n_layers, n_embd=shape.n_embd, n_kv_heads=shape.n_kv_heads,
                   head_dim=shape.head_dim, n_params=shape.n_params - shape.lookup_params,
                   file_bytes=shape.tensor_bytes, layer_bytes=shape.layer_bytes,
                   streamed_bytes=shape.tensor_bytes - shape.lookup_bytes, source=str(path), n_vocab=shape.n_vocab)

    @classmethod
    def from_facts(cls, facts: ModelFacts) -> Shape:
        size = round(facts.size_gb * GB)
        params = facts.params_b * GB if facts.params_b else size / Q4_0_BYTES_PER_PARAM
        # The split between blocks, head and token table is unknown: counting all bytes as blocks
        # over-estimates a GPU layer slightly, so the planned GPU layers fit.
        return cls(n_layers=facts.layers, n_embd=facts.embd, n_kv_heads=facts.kv_heads, head_dim=facts.head_dim,
                   n_params=round(params), file_bytes=size, layer_bytes=size, streamed_bytes=size,
                   source="models.toml facts")


@dataclass(frozen=True)
class ModelPlan:
    role: str  # "target" or "drafter"
    shape: Shape
    runtime: str
    kv_type: str  # the cache as stored (an onnx model keeps its own 4/8-bit cache)
    kv_bytes: int
    placement: str  # "gpu": every layer on the GPU; "ram" / "ssd": where the weights off the GPU live
    n_gpu_layers: int  # llama.cpp's count: n_layers + 1 puts the output head on the GPU too
    op_offload: bool
    n_ubatch: int
    use_mmap: bool
    use_mlock: bool
    repack: bool  # llama.cpp may copy weights into its repacked buffers (faster Q4_0 kernels): not when streamed
    ram_bytes: int  # resident in RAM: weights placed there and the KV cache of layers off the GPU
    vram_bytes: int
    # placement "ssd": the weights that stay in RAM (the first in pass order, locked where allowed); the rest of the
    # weights off the GPU is read from the drive on every pass (offload/window.py, partial residency)
    resident_bytes: int = 0
    # placement "ssd": the cells of the KV cache `ram_bytes` holds (KV_RESERVE_CELLS); past them the resident set gives
    # the cache room. 0: all of the context's (kv_bytes)
    kv_cells: int = 0

    def kv_cell_bytes(self) -> float:
        """The KV cache's bytes in RAM a token: a cell of each layer off the GPU (0: a cache of its runtime's own)."""
        shape, off_gpu = self.shape, self.shape.n_layers - min(self.n_gpu_layers, self.shape.n_layers)
        return 2 * off_gpu * shape.n_kv_heads * shape.head_dim * KV_BYTES.get(self.kv_type, 0.0)

    def options(self) -> dict:
        """The runtime settings that carry this placement out."""
        return {key: getattr(self, key) for key in PLACEMENT_KEYS}


@dataclass(frozen=True)
class PassCost:
    n_tokens: int
    seconds: float
    bound: str  # what the time goes to: "disk", "RAM", "PCIe", "VRAM", "CPU compute", "GPU compute"


@dataclass(frozen=True)
class Plan:
    pair: str
    ctx: int
    budget: int | str  # "auto": chosen round by round, up to AUTO_MAX_BUDGET
    machine: Machine
    target: ModelPlan
    drafter: ModelPlan
    one_token: PassCost
    tree: PassCost  # budget + 1 tokens: the largest tree and its root
    notes: tuple[str, ...]

    @property
    def break_even(self) -> float:
        """Tokens a tree pass must yield to beat plain decoding (drafting not counted)."""
        return self.tree.seconds / self.one_token.seconds

    @property
    def ssd_bytes(self) -> int:
        """Target bytes read from the drive on every pass: those off the GPU but for the resident set."""
        return streamed_bytes(self.target)

    def placement(self) -> dict[str, dict]:
        return {"target": self.target.options(), "drafter": self.drafter.options()}

    def as_dict(self) -> dict:
        def model(plan: ModelPlan) -> dict:
            return {"file": plan.shape.source, "size_gib": _round_gib(plan.shape.file_bytes),
                    "layers": plan.shape.n_layers, "params_b": round(plan.shape.n_params / GB, 3),
                    "runtime": plan.runtime, "kv_type": plan.kv_type, "kv_cache_gib": _round_gib(plan.kv_bytes),
                    "ram_gib": _round_gib(plan.ram_bytes), "vram_gib": _round_gib(plan.vram_bytes), **plan.options()}

        m = self.machine
        return {
            "pair": self.pair, "ctx": self.ctx, "budget": self.budget,
            "machine": {"name": m.name, "ram_free_gib": _round_gib(m.ram_free),
                        "vram_free_gib": _round_gib(m.vram_free), "disk_gbps": m.disk_gbps, "cores": m.cores,
                        "pcie_gbps": m.pcie_gbps, "ram_gbps": m.ram_gbps, "assumed": list(m.assumed),
                        "memory_limited": m.capped},
            "target": model(self.target), "drafter": model(self.drafter),
            "memory": {"ram_gib": _round_gib(self.target.ram_bytes + self.drafter.ram_bytes),
                       "vram_gib": _round_gib(self.target.vram_bytes + self.drafter.vram_bytes),
                       "resident_gib": _round_gib(self.target.resident_bytes),
                       "ssd_read_per_pass_gib": _round_gib(self.ssd_bytes)},
            "target_pass": {"tokens_1_s": round(self.one_token.seconds, 4), "bound_1": self.one_token.bound,
                            "tokens_n": self.tree.n_tokens, "tokens_n_s": round(self.tree.seconds, 4),
                            "bound_n": self.tree.bound, "break_even_tokens_per_pass": round(self.break_even, 2)},
            "notes": list(self.notes),
        }


def plan_pair(pair: PairSpec, target: Shape, drafter: Shape | None, machine: Machine, stream: bool = False,
              plain: bool = False) -> Plan:
    """Place the drafter (memory only: it runs many small passes), then the target's KV cache and layers:
    as many layers on the GPU as fit, the rest in RAM when they fit, else mmap'd from the SSD (`stream`: from the
    SSD even where they would fit, as `--placement ssd` runs them). Without a `drafter` (lookup drafting alone) the
    drafter's plan takes no memory: placement "none"; `plain`: nor trees (one token a pass, one row of logits)."""
    gpu = machine.vram_free > 0
    sizes = [1] if plain else _tree_sizes(pair, machine)
    vram_left = max(0, machine.vram_free - GPU_RESERVE) if gpu else 0
    for n_tree in sizes:  # under a memory limit, auto's largest tree shrinks until the two models' logits fit
        headroom = _headroom(machine, target, drafter, n_tree, pair.drafter.runtime, plain)
        ram_left = machine.ram_free - headroom
        room = f"a {gib(headroom)} headroom" + (" under this process's memory limit (its cgroup's)"
                                                   if machine.capped else "")
        try:
            draft = _place_drafter(pair, drafter, gpu, vram_left, ram_left, n_tree, room) if drafter is not None \
                else _no_drafter(pair, target)
            main = _place_target(pair, target, gpu, vram_left - draft.vram_bytes, ram_left - draft.ram_bytes, n_tree,
                                 f"the drafter and {room}" if drafter is not None else room,
                                 CAPPED_PAGE_SLACK if machine.capped else 0)
            break
        except UserError:
            if n_tree == sizes[-1]:
                raise
    fits = main.placement != "ssd"
    if stream and main.placement == "ram":
        if not traits(main.runtime).streams:
            raise UserError(f"placement ssd streams a target from its file: a {main.runtime} target cannot be",
                            "placement")
        main = replace(main, placement="ssd", ram_bytes=main.kv_bytes, repack=False)
    notes = []
    if n_tree < sizes[0]:
        notes.append(f"auto's trees are at most {n_tree} nodes here: the logits of larger ones would not fit under the "
                     "memory limit beside the drafter")
    if main.placement == "ssd":
        why = "streamed as asked (--placement ssd)" if fits else "does not fit in RAM"
        kept = (f"{gib(main.resident_bytes)} of its weights stay in RAM (the first in pass order, locked where the "
                "system allows) and " if main.resident_bytes else "")
        notes.append(f"the target {why}: {kept}{gib(streamed_bytes(main))} of it is read from the drive "
                     "on every pass, from the file's mapping (not repacked: llama.cpp's faster Q4_0 kernels need a "
                     "copy in RAM)")
        if main.kv_cells and main.resident_bytes:
            cell = main.kv_cell_bytes()
            full = max(0, main.resident_bytes - round((pair.ctx - main.kv_cells) * cell))
            notes.append(f"its KV cache takes memory as the context fills ({cell / 1024:.0f} KiB a token): the plan "
                         f"holds {main.kv_cells} tokens' worth; past them the resident set gives it room, down to "
                         f"{gib(full)} at {pair.ctx} tokens")
        if draft.placement == "ram":
            # Streaming the target through the page cache would evict an mmap'd drafter's pages every pass.
            draft = replace(draft, use_mmap=False)
            notes.append("the drafter loads without mmap, so the target's stream does not evict it")
    if target.source == "models.toml facts" or (drafter is not None and drafter.source == "models.toml facts"):
        notes.append(f"sized from models.toml facts (not downloaded; `edge-spec pull {pair.name}` fetches it)")
    plan = Plan(pair=pair.name, ctx=pair.ctx, budget=pair.budget, machine=machine, target=main, drafter=draft,
                one_token=pass_cost(main, machine, 1), tree=pass_cost(main, machine, n_tree), notes=())
    notes.append(f"speculation beats plain decoding when a tree pass yields more than {plan.break_even:.2f} tokens "
                 "(drafting not counted)")
    return replace(plan, notes=tuple(notes))


def _headroom(machine: Machine, target: Shape, drafter: Shape | None, n_tree: int,
              drafter_runtime: str = DEFAULT, plain: bool = False) -> int:
    """RAM kept free past the weights and KV caches: RAM_HEADROOM on a machine, or under a memory cgroup's limit
    CAPPED_HEADROOM and the logits the two models' batches produce (PLAIN_HEADROOM and one row for a target decoding
    plainly alone)."""
    if not machine.capped:
        return RAM_HEADROOM
    if plain:
        return PLAIN_HEADROOM + _logits_bytes(target, 1)
    # the target: its graph's output (a row per token of its batch) and its output buffer (a row per tree node, but
    # never fewer than llama.cpp's 256 sequences)
    target_rows = n_tree + BATCH_EXTRA + max(n_tree, MAX_SEQUENCES)
    return CAPPED_HEADROOM + _logits_bytes(target, target_rows) // 2 + (
        _logits_bytes(drafter, n_tree if _batch_logits(drafter_runtime) else _expanded_rows(n_tree))
        if drafter is not None else 0)


def _batch_logits(runtime: str) -> bool:
    """Whether a drafter on `runtime` holds logits for its whole batch (where the runtime is chosen at load, by the
    file's architecture, the plan assumes it does)."""
    return runtime not in TRAITS or traits(runtime).drafter_batch_logits


def _expanded_rows(n_tree: int) -> int:
    """The most nodes one drafter pass expands in growing a tree of n_tree nodes (GrowConfig.for_budget's beams)."""
    return max(1, (n_tree - 1) // 16)


def _logits_bytes(shape: Shape, n_batch: int) -> int:
    return 2 * n_batch * (shape.n_vocab or UNKNOWN_VOCAB) * 4


def _tree_sizes(pair: PairSpec, machine: Machine) -> list[int]:
    """The largest trees the plan tries, largest first: the pair's, and under a memory limit with --budget auto, smaller
    ones down to CAPPED_MIN_TREE nodes (auto chooses within what the plan sized)."""
    largest = largest_tree(pair)
    if not machine.capped or pair.budget != "auto":
        return [largest]
    return [largest, *(n + 1 for n in (128, 64, 32) if n + 1 < largest), CAPPED_MIN_TREE]


def largest_tree(pair: PairSpec) -> int:
    """Nodes of the largest tree a target pass verifies: the budget's nodes and the root."""
    return (AUTO_MAX_BUDGET if pair.budget == "auto" else int(pair.budget)) + 1


def pass_cost(plan: ModelPlan, machine: Machine, n_tokens: int,
              cpu_gflops_per_core: float | None = None) -> PassCost:
    """Predicted time of one target pass over n_tokens: each part of the weights costs the longer of moving
    them (at the bandwidth of where they live) and computing with them (where the op runs); for weights the CPU
    computes from the drive, the sum of the two, whose reading overlaps a streamed target's resident part."""
    shape = plan.shape
    cpu_gflops_per_core = cpu_gflops_per_core or machine.cpu_gflops_per_core or CPU_GFLOPS_PER_CORE
    off_bytes = _off_gpu_bytes(plan)
    on_bytes = shape.streamed_bytes - off_bytes
    from_disk = streamed_bytes(plan)
    in_ram = off_bytes - from_disk  # placed in RAM, or the resident set of a streamed target
    flops_per_byte = 2 * shape.n_params * n_tokens / max(shape.streamed_bytes, 1)
    gpu_flops, cpu_flops = GPU_TFLOPS * 1e12, machine.cores * cpu_gflops_per_core * 1e9
    # (where the weights move from, seconds, where they are computed, seconds, whether the two add up)
    parts = [("VRAM", on_bytes / (VRAM_GBPS * GB), "GPU compute", on_bytes * flops_per_byte / gpu_flops, False)]
    ram_gbps = machine.ram_gbps if plan.placement != "ssd" else mapped_rate(machine)
    for source, n_bytes, source_gbps in (("RAM", in_ram, ram_gbps), ("disk", from_disk, machine.disk_gbps)):
        if n_bytes == 0 and (source == "disk" or from_disk > 0):
            continue
        if plan.op_offload and n_tokens >= OP_OFFLOAD_MIN_BATCH:
            # The GPU computes these layers too, after uploading them: DMA reads RAM faster than PCIe carries it, so
            # PCIe paces weights in RAM; weights on the drive go at the slower of the drive and PCIe.
            slow_disk = source == "disk" and machine.disk_gbps < machine.pcie_gbps
            link, link_gbps = ("disk", machine.disk_gbps) if slow_disk else ("PCIe", machine.pcie_gbps)
            parts.append((link, n_bytes / (link_gbps * GB), "GPU compute", n_bytes * flops_per_byte / gpu_flops,
                          False))
        else:
            # Weights mapped from the drive are read by page faults in the computing threads: a layer's reading and
            # its arithmetic take turns, so they add up (measured on a 70B-shaped file: docs/plan.md, "The
            # constants").
            parts.append((source, n_bytes / (source_gbps * GB), "CPU compute", n_bytes * flops_per_byte / cpu_flops,
                          source == "disk"))
    seconds = sum(move + compute if serial else max(move, compute) for _, move, _, compute, serial in parts)
    sources = {source: (move, compute) for source, move, _, compute, _ in parts}
    if plan.placement == "ssd" and "RAM" in sources and "disk" in sources:
        # A streamed target's next streamed part is read ahead as soon as a pass has computed its last streamed
        # layer (offload/window.py): the drive reads it while the pass computes its resident layers, so the two
        # overlap, all but UNHIDDEN_SHARE of the shorter, and the streamed part's arithmetic follows.
        resident, read = max(sources["RAM"]), sources["disk"][0]
        seconds -= (1 - UNHIDDEN_SHARE) * min(resident, read)
    terms = [(move, label) for label, move, *_ in parts] + [(compute, label) for _, _, label, compute, _ in parts]
    return PassCost(n_tokens=n_tokens, seconds=seconds, bound=max(terms)[1])


def mapped_rate(machine: Machine) -> float:
    """GB/s a streamed target's one-token pass computes its resident part at (from the file's mapping)."""
    return machine.mapped_gbps or machine.ram_gbps * MAPPED_SHARE


def fit_constants(plan: ModelPlan, machine: Machine, passes: dict[int, list[float]]) -> dict[str, float] | None:
    """The read rate and the CPU's GFLOP/s per core that measured passes {n: [seconds, ...]} of a target placed by
    `plan` imply, under pass_cost's model: from the drive, t(n) = read + n x per-token compute, fitted by least
    squares on relative errors; in RAM, the one-token pass reads and the largest computes (one-token passes alone: the
    read rate alone). None with fewer than two sizes from the drive, or none in RAM."""
    points = [(n, t) for n, times in passes.items() for t in times if t > 0]
    shape = plan.shape
    moved = streamed_bytes(plan) if plan.placement == "ssd" else _off_gpu_bytes(plan)
    if plan.placement != "ssd" and {n for n, _ in points} == {1}:
        return {"ram_gbps": round(float(moved / statistics.median(t for _, t in points) / GB), 3)}
    if len({n for n, _ in points}) < 2:
        return None
    if plan.placement == "ssd":
        import numpy as np

        n, t = np.array(points, dtype=np.float64).T
        per_token, read = np.polyfit(n, t, 1, w=1 / t)  # residuals weighted by 1/t: relative errors
    else:
        read, largest = statistics.median(passes[min(passes)]), max(passes)
        per_token = statistics.median(passes[largest]) / largest
    key = "disk_gbps" if plan.placement == "ssd" else "ram_gbps"
    return {key: round(float(moved / max(read, 1e-9) / GB), 3),
            "cpu_gflops_per_core": round(float(2 * shape.n_params / max(per_token, 1e-12) / machine.cores / 1e9), 1)}


def kv_bytes(shape: Shape, n_cells: int, kv_type: str) -> int:
    """K and V for every layer: 2 x layers x kv_heads x head_dim x cells (gemma's sliding-window layers keep their
    full history too: swa_full, so rejected branches can be removed)."""
    return math.ceil(2 * shape.n_layers * shape.n_kv_heads * shape.head_dim * n_cells * KV_BYTES[kv_type])


def _no_drafter(pair: PairSpec, shape: Shape) -> ModelPlan:
    """The drafter's plan where none loads: nothing placed."""
    return ModelPlan(role="drafter", shape=shape, runtime=pair.drafter.runtime, kv_type="none", kv_bytes=0,
                     placement="none", n_gpu_layers=0, op_offload=False, n_ubatch=0, use_mmap=False, use_mlock=False,
                     repack=False, ram_bytes=0, vram_bytes=0)


def _place_drafter(pair: PairSpec, shape: Shape, gpu: bool, vram_left: int, ram_left: int, n_tree: int,
                   room: str) -> ModelPlan:
    model = pair.drafter
    kv_type = _kv_type(model, "drafter")
    kv = kv_bytes(shape, pair.ctx + max(DRAFTER_EXTRA_CTX, n_tree), kv_type)
    need = shape.file_bytes + kv
    common = {"role": "drafter", "shape": shape, "runtime": model.runtime, "kv_type": kv_type, "kv_bytes": kv,
              "op_offload": gpu and traits(model.runtime).splits_layers, "n_ubatch": n_tree, "use_mmap": True,
              "use_mlock": False, "repack": True}
    if gpu and _can_use_gpu(model) and need <= vram_left:
        n_gpu_layers = shape.n_layers + 1 if traits(model.runtime).splits_layers else 0
        return ModelPlan(placement="gpu", n_gpu_layers=n_gpu_layers, ram_bytes=0, vram_bytes=need, **common)
    if need <= ram_left:
        return ModelPlan(placement="ram", n_gpu_layers=0, ram_bytes=need, vram_bytes=0, **common)
    vram = f" or the {gib(vram_left)} of VRAM left past a {gib(GPU_RESERVE)} reserve" if gpu else ""
    raise UserError(f"pair {pair.name} cannot run here: its drafter needs {gib(need)} "
                    f"(weights {gib(shape.file_bytes)} + KV cache {gib(kv)}) but only {gib(max(ram_left, 0))} "
                    f"of RAM is free past {room}{vram}; free memory or pick a pair with a "
                    "smaller drafter")


def _place_target(pair: PairSpec, shape: Shape, gpu: bool, vram_left: int, ram_left: int, n_tree: int,
                  room: str, page_slack: int = 0) -> ModelPlan:
    """The target's placement: on the GPU as far as it fits, else in RAM where its pages, its KV cache and
    `page_slack` fit (CAPPED_PAGE_SLACK under a memory limit), else streamed with a resident set."""
    model = pair.target
    kv_type = _kv_type(model, "target")
    kv = kv_bytes(shape, pair.ctx, kv_type)
    common = {"role": "target", "shape": shape, "runtime": model.runtime, "kv_type": kv_type, "kv_bytes": kv,
              "op_offload": gpu and traits(model.runtime).splits_layers, "n_ubatch": n_tree + BATCH_EXTRA,
              "use_mmap": True, "use_mlock": False, "repack": True}
    if not traits(model.runtime).splits_layers:  # an onnx target (QuantSpec) loads whole: no split, no streaming
        need = shape.file_bytes + kv
        if gpu and _can_use_gpu(model) and need <= vram_left:
            return ModelPlan(placement="gpu", n_gpu_layers=0, ram_bytes=0, vram_bytes=need, **common)
        if need <= ram_left:
            return ModelPlan(placement="ram", n_gpu_layers=0, ram_bytes=need, vram_bytes=0, **common)
        raise UserError(f"pair {pair.name} cannot run here: its {model.runtime} target loads whole and needs "
                        f"{gib(need)} (weights + KV cache) but {gib(max(ram_left, 0))} of RAM is free past "
                        f"{room}; use a target that streams from the SSD "
                        f"(runtime = \"{DEFAULT}\")")
    layer = shape.layer_bytes / shape.n_layers
    kv_layer = kv / shape.n_layers
    head = shape.streamed_bytes - shape.layer_bytes  # output head and norms: the "+1" of n_gpu_layers
    lookup = shape.file_bytes - shape.streamed_bytes  # a looked-up token table stays on the CPU side
    n_gpu = min(shape.n_layers, int(max(vram_left, 0) // (layer + kv_layer))) if gpu else 0
    with_head = n_gpu == shape.n_layers and vram_left - n_gpu * (layer + kv_layer) >= head
    vram = round(n_gpu * (layer + kv_layer) + (head if with_head else 0))
    kv_ram = kv - round(n_gpu * kv_layer)
    if kv_ram > ram_left:
        raise UserError(f"pair {pair.name} cannot run here: the target's {kv_type} KV cache for {pair.ctx} tokens "
                        f"needs {gib(kv_ram)} of RAM{' off the GPU' if n_gpu else ''} but {gib(max(ram_left, 0))} "
                        f"is free past {room}; lower the context (ctx) or free memory", "ctx")
    off_gpu = shape.file_bytes - round(n_gpu * layer) - (head if with_head else 0)  # lookup table included
    # of the looked-up table, only the rows of the context's tokens are ever read (mapped: only they take memory)
    in_use = off_gpu - lookup + touched_rows(shape, pair.ctx)
    resident, kv_cells = 0, 0
    if with_head:
        placement, ram = "gpu", kv_ram + lookup
    elif in_use + page_slack <= ram_left - kv_ram:
        placement, ram = "ram", kv_ram + in_use
    else:
        # Mapped: what the memory holds past the KV cache's first cells and the stream's own room stays resident, the
        # rest passes through the page cache on every pass; as the context fills, the cache takes the resident set's
        # room (KV_RESERVE_CELLS)
        placement = "ssd"
        if pair.contexts == 1:  # a server's lanes fill caches of their own, which no pass of the target follows
            kv_cells = min(pair.ctx, KV_RESERVE_CELLS)
            kv_ram = math.ceil(kv_ram * kv_cells / pair.ctx)
        resident = resident_share(shape, off_gpu - lookup, ram_left - kv_ram)
        ram = kv_ram + resident
    # Streamed weights must be used from the mapping: a repacked copy of a file larger than RAM cannot be made.
    common["repack"] = placement != "ssd"
    # A tree target keeps the layers left on the CPU on the CPU's batch-invariant kernels: op offload would compute
    # its 32-token batches on the GPU's, not a one-token pass's (runtimes/llama_cpp, load_target)
    common["op_offload"] = common["op_offload"] and n_tree == 1
    return ModelPlan(placement=placement, n_gpu_layers=n_gpu + (1 if with_head else 0), ram_bytes=ram,
                     vram_bytes=vram, resident_bytes=resident, kv_cells=kv_cells, **common)


def touched_rows(shape: Shape, ctx: int) -> int:
    """Bytes of a looked-up token table that a context of `ctx` tokens reads: a row per token at most (a 152k-token
    table of 131 MiB holds 4096 tokens' rows in 5 MiB)."""
    table = shape.file_bytes - shape.streamed_bytes
    if not shape.n_vocab:
        return table
    return min(table, ctx * -(-table // shape.n_vocab))


def stream_room(shape: Shape) -> int:
    """Memory a streamed target's pass needs for the pages it streams: STREAM_ROOM_LAYERS layers in flight (the one
    computed, the ones read ahead), and never less than MIN_STREAM_ROOM."""
    return max(MIN_STREAM_ROOM, round(STREAM_ROOM_LAYERS * shape.layer_bytes / max(shape.n_layers, 1)))


def resident_share(shape: Shape, off_gpu: int, room: int) -> int:
    """Bytes of a streamed target's `off_gpu` weights to keep resident in `room` bytes of free memory: all but the
    stream's own room (stream_room), in whole pages."""
    resident = max(0, min(off_gpu, room - stream_room(shape)))
    return resident if resident == off_gpu else resident - resident % 4096  # all of it, or whole pages of it


def streamed_bytes(plan: ModelPlan) -> int:
    """Bytes a pass of this model reads from the drive: its weights off the GPU less the resident set."""
    return max(0, _off_gpu_bytes(plan) - plan.resident_bytes) if plan.placement == "ssd" else 0


def _off_gpu_bytes(plan: ModelPlan) -> int:
    """Bytes of one pass's weights that live off the GPU (in RAM or on the drive)."""
    shape = plan.shape
    if plan.placement == "gpu":
        return 0
    on_gpu = min(plan.n_gpu_layers, shape.n_layers) * shape.layer_bytes / shape.n_layers
    return max(0, round(shape.streamed_bytes - on_gpu))


def _kv_type(model: ModelSpec, role: str) -> str:
    # onnx models keep edge-spec's own QuantSpec cache: 4-bit for a drafter, 4+4-bit (about q8_0) for a target.
    own = traits(model.runtime).own_kv
    if own is not None:
        return own[0] if role == "drafter" else own[1]
    return model.kv_type


def _can_use_gpu(model: ModelSpec) -> bool:
    return traits(model.runtime).splits_layers or model.provider != "cpu"


def _round_gib(n_bytes: float) -> float:
    return round(n_bytes / GIB, 3)
