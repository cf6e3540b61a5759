"""`edge-spec plan` as a library call: a pair's shapes (GGUF headers of files already here, else models.toml facts),
the machine (probed or described), and the plan. Nothing is loaded or downloaded."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from edge.models.cache import JsonFile, cache_dir
from edge.models.registry import ModelSpec, PairSpec
from edge.models.sources import model_path, source_path
from edge.offload.machine import Machine, parse_machine, probe_here
from edge.offload.plan import Plan, Shape, plan_pair
from edge.runtimes import runtime, traits

if TYPE_CHECKING:
    from edge.offload.choice import Use

from edge.errors import Remedy, UserError

MIN_TIMED_STREAM = 16 << 20  # bytes a timed pass must read from the drive for its rate to count (streamed_rates)


def make_plan(pair: PairSpec, machine: str | None, models_file: Path, stream: bool = False,
              drafts: bool = True, plain: bool = False) -> Plan:
    """`drafts`: a drafter model loads too (without, the target drafts by lookup alone: nothing to place); `plain`:
    the target verifies no tree (one token a pass)."""
    target = model_shape(pair, "target", pair.target, models_file)
    drafter = model_shape(pair, "drafter", pair.drafter, models_file) if drafts else None
    return plan_pair(pair, target, drafter, _machine(pair, machine), stream, plain=plain)


def make_choice(pair: PairSpec, machine: str | None, models_file: Path | None,
                lookup: bool = True, stream: bool = False) -> tuple[Use, list[Use]]:
    """The use of the memory the pair is best at on this machine (or a described one): offload/choice.py's, and
    every use weighed; `stream`: with the target read from the drive every pass (--placement ssd)."""
    from edge.offload.choice import choose, weigh_uses

    target = model_shape(pair, "target", pair.target, models_file)
    drafter = model_shape(pair, "drafter", pair.drafter, models_file)
    uses = weigh_uses(pair, target, drafter, _machine(pair, machine), lookup, stream)
    return choose(uses), uses


def _machine(pair: PairSpec, machine: str | None) -> Machine:
    if machine is not None:
        return parse_machine(machine)
    target = _local_file(pair.target)
    here = probe_here(target or cache_dir() / "models", JsonFile(cache_dir() / "machine.json"), usable_gpus())
    return measured_rates(here, target) if target is not None else here


def measured_rates(machine: Machine, target: Path) -> Machine:
    """The machine with the rates its own passes of this target showed, in place of the assumed ones: the RAM rate
    and CPU compute (in_ram_rates), then a streamed target's (streamed_rates)."""
    return streamed_rates(in_ram_rates(machine, target), target)


def in_ram_rates(machine: Machine, target: Path) -> Machine:
    """The machine with the RAM rate and CPU compute its own passes of this target showed, in RAM, where `--budget
    auto` has timed them (pass-times.json: once per machine, placement and file), in place of the assumed ones
    (offload.plan.fit_constants: the one-token pass reads the weights, the largest computes); else the RAM rate alone
    that its plain decoding's one-token passes showed (models.kept.keep_plain_pass)."""
    from edge.models.kept import measured_at, target_entries
    from edge.offload.plan import ModelPlan, fit_constants

    def sizes(entry: dict) -> int:
        timed = entry.get("target_ms")
        return len(timed) if isinstance(timed, dict) else 0

    def rank(item: tuple[str, dict]) -> tuple[bool, float]:  # several sizes first (the compute rate too), then newest
        return sizes(item[1]) > 1, measured_at(item[1])

    for key, entry in sorted(target_entries(target).items(), key=rank, reverse=True):
        # one size alone only from plain decoding (a server's lanes time passes padded to their GEMM's rows)
        if "|ram|" not in key or (sizes(entry) < 2 and "|stock|" not in key):
            continue
        try:
            passes = {int(n): [float(ms) / 1000] for n, ms in entry["target_ms"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        plan = ModelPlan(role="target", shape=Shape.from_gguf(target), runtime="", kv_type="", kv_bytes=0,
                         placement="ram", n_gpu_layers=0, op_offload=False, n_ubatch=0, use_mmap=True,
                         use_mlock=False, repack=False, ram_bytes=0, vram_bytes=0)
        fit = fit_constants(plan, machine, passes)
        if fit is None or not all(value > 0 for value in fit.values()):
            continue
        return replace(machine, ram_gbps=fit["ram_gbps"],
                       cpu_gflops_per_core=fit.get("cpu_gflops_per_core", machine.cpu_gflops_per_core),
                       assumed=tuple(name for name in machine.assumed if name != "rambw"))
    return machine


def streamed_rates(machine: Machine, target: Path) -> Machine:
    """The machine with the rates this target's streamed runs showed (models.kept.keep_streamed_pass: the newest of
    each kind): the rate a streamed target's resident part computes at, from the file's mapping, where all of it stayed
    resident (Machine.mapped_gbps), and the drive's rate while passes read, where part of it streamed (disk_gbps:
    from the pass's time less its streamed part's arithmetic, where that is longer than its resident part at the
    mapped rate, under pass_cost's partial overlap of the two; the probe reads the drive alone, once). Each is scaled
    from the run's threads to every core, as the plan computes on every core."""
    from edge.models.kept import MAPPED, STREAMED, measured_at, target_entries
    from edge.offload.plan import CPU_GFLOPS_PER_CORE, GB, UNHIDDEN_SHARE, mapped_rate

    entries = target_entries(target)
    runs = {kind: [entry for key, entry in entries.items() if f"|{kind}|readahead window|" in key]
            for kind in (MAPPED, STREAMED)}

    def newest(kind: str) -> tuple[int, float, float] | None:  # threads, seconds a pass, bytes streamed a pass
        for entry in sorted(runs[kind], key=measured_at, reverse=True):
            try:
                threads, passes = int(entry["threads"]), int(entry["passes"])
                seconds, streamed = float(entry["seconds"]), float(entry["streamed_bytes"])
            except (KeyError, TypeError, ValueError):
                continue
            if threads >= 1 and passes >= 1 and seconds > 0:
                return threads, seconds / passes, streamed / passes
        return None

    shape = Shape.from_gguf(target)
    if (resident := newest(MAPPED)) is not None:
        threads, seconds, _ = resident
        machine = replace(machine, mapped_gbps=round(shape.streamed_bytes / seconds * machine.cores / threads / GB, 3))
    if (streamed := newest(STREAMED)) is not None and streamed[2] >= MIN_TIMED_STREAM:
        threads, seconds, read = streamed
        mapped = mapped_rate(machine) * GB * threads / machine.cores  # bytes/s on the run's threads
        gflops = (machine.cpu_gflops_per_core or CPU_GFLOPS_PER_CORE) * threads * 1e9
        arithmetic = 2 * shape.n_params * read / max(shape.streamed_bytes, 1) / gflops
        # the drive reads while the resident part computes: a pass costs the longer of the two and UNHIDDEN_SHARE
        # of the shorter, then the streamed part's arithmetic (offload.plan.pass_cost)
        both, resident = seconds - arithmetic, max(0.0, shape.streamed_bytes - read) / mapped
        if both >= (1 + UNHIDDEN_SHARE) * resident:  # the reading was the longer
            reading = both - UNHIDDEN_SHARE * resident
        elif both > resident:
            reading = (both - resident) / UNHIDDEN_SHARE
        else:
            reading = 0.0  # hidden: no measure
        if reading > 0:
            machine = replace(machine, disk_gbps=round(read / reading / GB, 3))
    return machine


def model_shape(pair: PairSpec, role: str, model: ModelSpec, models_file: Path) -> Shape:
    """The model's shape from its file when it is here, else from models.toml facts; never downloads."""
    path = _local_file(model)
    if path is not None:
        shape = Shape.from_gguf(path)
        # a runtime that builds its own file from the GGUF (an onnx graph) holds that file's weights, not the GGUF's:
        # a plan counting the GGUF's 253 MB for Gemma-3-270M's 486 MB graph under a memory limit left the target's
        # read-ahead no room (docs/performance.md); before the first build, the GGUF's size
        derives = role == "drafter" and traits(model.runtime).derives_files
        derived = runtime(model.runtime).derived_bytes(path, role) if derives else 0
        return replace(shape, file_bytes=derived) if derived > shape.file_bytes else shape
    if model.facts is not None:
        return Shape.from_facts(model.facts)
    source = source_path(model.source)
    if model.source.path is not None and models_file is None:  # a file named on the command line
        raise UserError(f"{model.source.path}: no such file (the {role}); check the path")
    if model.quantize and source is not None and source.is_file():
        raise UserError(f"pair {pair.name}: the {role} is not prepared yet ({model.quantize} of {source.name}); "
                        "prepare the pair first", remedy=Remedy("prepare", pair.name))
    raise UserError(f"pair {pair.name}: the {role} file is not here and {models_file} gives no facts about it; add "
                    f"{role}.size_gb, {role}.layers, {role}.embd, {role}.kv_heads and {role}.head_dim to the pair, or "
                    "prepare it (which downloads it)", remedy=Remedy("prepare", pair.name))


def _local_file(model: ModelSpec) -> Path | None:
    path = model_path(model)
    return path if path is not None and path.is_file() else None


def usable_gpus() -> list[dict]:
    """The GPUs whose memory the plan may fill: none where the installed llama.cpp has no GPU backend; else
    nvidia-smi's figures, or the dedicated GPUs llama.cpp itself reports (Vulkan, HIP, SYCL: no nvidia-smi there). An
    integrated GPU shares the RAM: layers go there only when asked (gpu_layers)."""
    from edge.offload.probe import probe_gpus
    from edge.runtimes import tools

    devices = tools().gpu_devices()
    if not devices:
        return []
    return probe_gpus() or [{"name": device.description, "vram_total_gb": round(device.total / 2**30, 2),
                             "vram_free_gb": round(device.free / 2**30, 2)}
                            for device in devices if device.kind == "gpu"]


def backend_line() -> str:
    """What the installed llama.cpp runs a target's layers on, in one line (its GPUs first, then the CPU)."""
    from edge.runtimes import tools

    return tools().backend_line()


def check_gpu_layers(gpu_layers: int) -> None:
    """Refuses, in one line, target layers for a GPU that the installed llama.cpp cannot use."""
    from edge.runtimes import tools

    if gpu_layers and not tools().gpu_devices():
        raise UserError(f"{gpu_layers} target layers are to go on a GPU, but the installed llama.cpp has no GPU "
                        f"backend (it runs on: {tools().backend_line()}); reinstall llama-cpp-python for the GPU "
                        "(README, \"GPUs\"), or set gpu_layers to 0", "gpu_layers")


def unused_gpu() -> str | None:
    """A warning when this machine has a GPU that the installed llama.cpp cannot use (a CPU-only build)."""
    from edge.offload.probe import probe_gpus
    from edge.runtimes import tools

    gpus = probe_gpus()
    if not gpus or tools().gpu_devices():  # the same test as usable_gpus: a device llama.cpp can put layers on
        return None
    return (f"this machine has a GPU ({gpus[0]['name']}) but llama-cpp-python was built without GPU offload: "
            "reinstall it for the GPU (README, \"GPUs\"), e.g. CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install "
            "--force-reinstall --no-cache-dir llama-cpp-python==0.3.36")
