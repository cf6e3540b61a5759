"""The machine a pair is planned for: probed here (free RAM and VRAM, cores, the drive's measured read speed), or
described with --machine ("ram=32G,vram=24G,disk=3GB/s"). offload/plan.py places a pair on it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from edge.errors import UserError

if TYPE_CHECKING:
    from edge.offload.probe import JsonStore

GIB = 1024**3

# What a machine is assumed to have where neither the probe nor --machine says (docs/plan.md).
RAM_GBPS = 20.0  # GB/s a CPU streams weights from DRAM inside matmuls (dual-channel desktops sustain ~20-40)
PCIE_GBPS = 25.0  # GB/s of host-to-GPU uploads: PCIe 4.0 x16 in practice (32 peak)
DISK_GBPS = 2.0  # GB/s when the drive cannot be measured: a mid-range NVMe SSD under mmap page faults
DESCRIBED_CORES = 8  # cores of a described machine that does not say
MACHINE_KEYS = ("ram", "vram", "disk", "cores", "pcie", "rambw")


@dataclass(frozen=True)
class Machine:
    ram_free: int  # bytes
    vram_free: int = 0  # bytes; 0: no GPU
    disk_gbps: float = DISK_GBPS
    cores: int = DESCRIBED_CORES
    pcie_gbps: float = PCIE_GBPS
    ram_gbps: float = RAM_GBPS
    name: str = "described"  # "described", or the CPU (and GPU) probed
    assumed: tuple[str, ...] = ()  # which of disk, cores, pcie, rambw are defaults, not measured or described
    capped: bool = False  # ram_free is the room under a memory cgroup's limit, not the machine's free RAM
    cpu_gflops_per_core: float | None = None  # measured on this machine's passes; None: offload/plan.py's constant
    # GB/s a streamed target's one-token pass computes its resident part at, from the file's mapping; measured on its
    # own passes (models.planning.measured_rates); None: ram_gbps x offload/plan.py's MAPPED_SHARE
    mapped_gbps: float | None = None

    def describe(self) -> str:
        ram = f"RAM {gib(self.ram_free)} free" + (" under a memory limit" if self.capped else "")
        parts = [ram, f"VRAM {gib(self.vram_free)} free" if self.vram_free else "no GPU",
                 f"disk {self.disk_gbps:g} GB/s", f"{self.cores} cores", f"RAM {self.ram_gbps:g} GB/s"]
        if self.vram_free:
            parts.append(f"PCIe {self.pcie_gbps:g} GB/s")
        assumed = f" (assumed: {', '.join(self.assumed)})" if self.assumed else ""
        return f"{self.name}: {', '.join(parts)}{assumed}"


def parse_machine(text: str) -> Machine:
    """A described machine: "ram=32G,vram=24G,disk=3GB/s" plus optional cores=N, pcie=25GB/s, rambw=20GB/s."""
    values: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not value.strip():
            _machine_error(f"'{item}' is not key=value")
        if key not in MACHINE_KEYS:
            _machine_error(f"unknown key '{key}'")
        if key in values:
            _machine_error(f"'{key}' is given twice")
        values[key] = value.strip()
    if "ram" not in values:
        _machine_error("'ram' is missing (the RAM free for the models)")
    ram = _size(values["ram"], "ram")
    if ram <= 0:
        _machine_error("'ram' must be more than 0")
    cores = values.get("cores", str(DESCRIBED_CORES))
    if not cores.isdigit() or int(cores) < 1:
        _machine_error(f"cores must be a positive whole number, got '{cores}'")
    relevant = ("disk", "cores", "pcie", "rambw") if "vram" in values else ("disk", "cores", "rambw")
    assumed = tuple(key for key in relevant if key not in values)
    return Machine(
        ram_free=ram, vram_free=_size(values["vram"], "vram") if "vram" in values else 0,
        disk_gbps=_rate(values["disk"], "disk") if "disk" in values else DISK_GBPS, cores=int(cores),
        pcie_gbps=_rate(values["pcie"], "pcie") if "pcie" in values else PCIE_GBPS,
        ram_gbps=_rate(values["rambw"], "rambw") if "rambw" in values else RAM_GBPS,
        assumed=assumed,
    )


def probe_here(model_file: Path | None, store: JsonStore, gpus: list[dict] | None = None) -> Machine:
    """This machine: free RAM and VRAM now, and the measured read speed of the drive holding the model (kept in
    `store` once measured). `gpus`: those the model's runtime can use (default: nvidia-smi's)."""
    from edge.offload.probe import disk_read_gbps, probe_machine

    probed = probe_machine()
    ram_gb = probed["ram_free_gb"] or probed["ram_total_gb"]
    if ram_gb is None:
        raise UserError("cannot tell how much RAM is free here; describe it (machine): ram=16G,disk=2GB/s",
                        "machine")
    gpus = probed["gpus"] if gpus is None else gpus
    gpu = max(gpus, key=lambda g: g["vram_free_gb"]) if gpus else None  # one GPU: layers are not split across GPUs
    disk = disk_read_gbps(_existing(model_file), store) if model_file is not None else None
    assumed = ("rambw",) + (("pcie",) if gpu else ()) + (() if disk else ("disk",))
    name = probed["cpu"] + (f" + {gpu['name']}" if gpu else "")
    return Machine(ram_free=int(ram_gb * GIB), vram_free=int(gpu["vram_free_gb"] * GIB) if gpu else 0,
                   disk_gbps=round(disk, 2) if disk else DISK_GBPS, cores=probed["cores"], name=name, assumed=assumed,
                   capped=probed.get("memory_limit") is not None)


def _existing(path: Path) -> Path:
    """The path, or its nearest existing folder (where a file not downloaded yet would land)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


_SIZE_RE = re.compile(r"^(\d+(?:\.\d*)?)\s*([kmgt])(?:i?b)?$", re.IGNORECASE)
_RATE_RE = re.compile(r"^(\d+(?:\.\d*)?)\s*(?:([kmgt])(?:i?b)?)?(?:/s)?$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def _size(value: str, key: str) -> int:
    # Memory is sold in binary units whatever the label: 32G, 32GB and 32GiB all mean 32 x 2^30 bytes.
    match = _SIZE_RE.match(value)
    if not match:
        _machine_error(f"{key}={value} is not a size like 32G")
    return round(float(match[1]) * 1024 ** _POWERS[match[2].lower()])


def _rate(value: str, key: str) -> float:
    # Drives and links are rated in decimal units: 3GB/s is 3 x 10^9 bytes a second; a bare number is GB/s.
    match = _RATE_RE.match(value)
    if not match or float(match[1]) <= 0:
        _machine_error(f"{key}={value} is not a speed like 3GB/s")
    return float(match[1]) * 1000.0 ** (_POWERS[match[2].lower()] - 3 if match[2] else 0)


def _machine_error(problem: str) -> NoReturn:
    raise UserError(f"machine: {problem}; write it like ram=32G,vram=24G,disk=3GB/s "
                    f"(keys: {', '.join(MACHINE_KEYS)})", "machine")


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.2f} GiB"
