"""What this machine has: CPU, cores, RAM. Cheap and import-light, so `edge-spec plan` can call it first."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

GIB = 1024**3


def probe_machine() -> dict:
    """CPU model, core count, RAM total/free in GiB (None where the OS will not say), platform, versions."""
    ram_total_gb, ram_free_gb = _ram_gb()
    return {
        "cpu": _cpu_name(),
        "cores": os.cpu_count() or 1,
        "ram_total_gb": ram_total_gb,
        "ram_free_gb": ram_free_gb,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp": _version("llama-cpp-python"),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            # "model name" on x86; "Model"/"Hardware" on some ARM boards.
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _ram_gb() -> tuple[float | None, float | None]:
    meminfo = _meminfo_kib()
    if "MemTotal" in meminfo:
        # MemAvailable counts reclaimable page cache; MemFree alone would understate it badly.
        free = meminfo.get("MemAvailable", meminfo.get("MemFree"))
        return _gib(meminfo["MemTotal"] * 1024), None if free is None else _gib(free * 1024)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None, None
    return _gib(total), None


def _meminfo_kib() -> dict[str, int]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[key] = int(fields[0])
    return values


def _gib(n_bytes: int) -> float:
    return round(n_bytes / GIB, 2)


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
