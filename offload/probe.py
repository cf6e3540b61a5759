"""What this machine has: CPU, cores, RAM, GPUs, and (measured once, cached) how fast a drive reads.

probe_machine() is cheap and import-light, so `edge-spec plan` can call it first; the disk is only measured
when disk_read_gbps() is asked."""

from __future__ import annotations

import logging
import math
import mmap
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Protocol

log = logging.getLogger("edge")

GIB = 1024**3
MIB = 1024**2
DISK_SAMPLE_BYTES = 256 * MIB  # enough to get past a drive's own cache and the read-ahead ramp
_READ_BLOCK = 8 * MIB


def probe_machine() -> dict:
    """CPU model, core count, RAM total/free in GiB (None where the OS will not say; a memory cgroup's limit where it
    is tighter than the machine, memory_limit naming the file), GPUs, platform, versions."""
    ram_total_gb, ram_free_gb = _ram_gb()
    return {
        "cpu": _cpu_name(),
        "cores": os.cpu_count() or 1,
        "ram_total_gb": ram_total_gb,
        "ram_free_gb": ram_free_gb,
        "memory_limit": None if (limit := memory_limit()) is None else limit.source,
        "gpus": probe_gpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": _version("llama-cpp-python"),
    }


def probe_gpus() -> list[dict]:
    """NVIDIA GPUs as nvidia-smi reports them (name, VRAM total/free in GiB); [] when there is none or no tool."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    query = [exe, "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []  # a driver that is installed but not loaded fails here: no usable GPU
    gpus = []
    for line in out.splitlines():
        fields = [field.strip() for field in line.rsplit(",", 2)]
        try:
            total_mib, free_mib = float(fields[1]), float(fields[2])
        except (IndexError, ValueError):
            continue  # "[N/A]" and the like
        gpus.append({"name": fields[0], "vram_total_gb": _gib(int(total_mib * MIB)),
                     "vram_free_gb": _gib(int(free_mib * MIB))})
    return gpus


def machine_key(path: Path) -> str:
    """This machine and the drive holding `path`: hostname, the filesystem's device id, the CPU's name."""
    return f"{socket.gethostname()}|dev {os.stat(path).st_dev}|{_cpu_name()}"


class JsonStore(Protocol):
    """Where measurements are kept between runs (models.cache.JsonFile: a JSON object in edge-spec's cache)."""

    def read(self) -> dict: ...
    def write(self, data: dict) -> None: ...


def disk_read_gbps(path: Path, store: JsonStore, sample_bytes: int = DISK_SAMPLE_BYTES,
                   refresh: bool = False) -> float | None:
    """Read speed in GB/s (10^9 bytes) of the drive holding `path` (a model file, or a folder models go to).

    Measured once per machine and drive, then read from `store`; None when it cannot be measured."""
    key = machine_key(path)
    cached = store.read()
    entry = cached.get(key)
    if not refresh and isinstance(entry, dict) and "disk_read_gbps" in entry and entry.get("method") == DISK_METHOD:
        value = entry["disk_read_gbps"]
        if _plausible_gbps(value):
            return float(value)
        log.warning("the cached disk speed %r is not a read speed: measuring the drive again", value)
    try:
        gbps = _measure_disk(Path(path), sample_bytes)
    except OSError:
        return None
    cached[key] = {"disk_read_gbps": round(gbps, 3), "sample_bytes": sample_bytes, "measured": time.time(),
                   "method": DISK_METHOD}
    store.write(cached)
    return gbps


def _plausible_gbps(value: object) -> bool:
    """A stored read speed edge-spec could have measured: a finite number of GB/s, above a floppy's, below RAM's."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) \
        and 1e-4 <= value <= 1e3


def _measure_disk(path: Path, sample_bytes: int) -> float:
    # The model file itself when it is big enough; else a file of our own beside it, on the same drive.
    if path.is_file() and path.stat().st_size >= sample_bytes:
        return _timed_read(path, sample_bytes)
    try:
        fd, name = tempfile.mkstemp(prefix=".edge-spec-disk-", dir=path if path.is_dir() else path.parent)
    except OSError:
        if path.is_file():
            return _timed_read(path, path.stat().st_size)  # a read-only folder: a smaller sample beats none
        raise
    try:
        block = os.urandom(MIB)  # random, so a compressing filesystem cannot shrink it
        with os.fdopen(fd, "wb") as f:
            for _ in range(max(1, sample_bytes // MIB)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())  # only clean pages can be dropped from the page cache
        return _timed_read(Path(name), max(1, sample_bytes // MIB) * MIB)
    finally:
        Path(name).unlink(missing_ok=True)


DISK_METHOD = "mmap-populate"  # how the cached figure was measured; entries measured otherwise are redone


def _timed_read(path: Path, n_bytes: int) -> float:
    """GB/s reading the first n_bytes of `path` from the drive, not from the page cache.

    Read the way llama.cpp's mmap'd weights are (and offload/ssd.py reads them ahead): pages of a mapping
    populated with MADV_POPULATE_READ after the file left the page cache (docs/plan.md, "What it decides");
    O_DIRECT reads where madvise cannot do it.
    """
    try:
        return _populate_read(path, n_bytes)
    except OSError:
        pass
    if (direct := vars(os).get("O_DIRECT")) is not None:  # Linux; not every platform has it
        try:
            return _read_file(path, n_bytes, direct)
        except OSError:
            pass  # tmpfs and some others refuse O_DIRECT, at open or at the first read
    return _read_file(path, n_bytes, 0, drop_cache=True)


def _populate_read(path: Path, n_bytes: int) -> float:
    from edge.offload import libc

    n_bytes = min(n_bytes, path.stat().st_size)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with libc.mapped(fd, n_bytes) as address:
            start = time.perf_counter()
            libc.madvise(address, n_bytes, libc.MADV_POPULATE_READ)
            elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    return n_bytes / max(elapsed, 1e-9) / 1e9


def _read_file(path: Path, n_bytes: int, flags: int, drop_cache: bool = False) -> float:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        if drop_cache and "posix_fadvise" in vars(os):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buffer = mmap.mmap(-1, _READ_BLOCK)  # page-aligned, as O_DIRECT requires
        with buffer, open(fd, "rb", buffering=0, closefd=False) as f:
            done, start = 0, time.perf_counter()
            while done < n_bytes and (got := f.readinto(buffer)):
                done += got
            elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    if done == 0:
        raise OSError(f"{path} is empty")
    return done / max(elapsed, 1e-9) / 1e9


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
    """RAM total and free, in GiB: the machine's, or the memory cgroup's limit where that is tighter (a container,
    a systemd slice): what the kernel lets this process use before it reclaims its page cache and then kills it."""
    total, free = _machine_ram()
    limit = memory_limit()
    if limit is None:
        return None if total is None else _gib(total), None if free is None else _gib(free)
    room = max(0, limit.room - mapped_file_bytes())
    return (_gib(limit.limit if total is None else min(total, limit.limit)),
            _gib(room if free is None else min(free, room)))


MODEL_SUFFIXES = (".gguf", ".onnx", ".data")  # a pair's files (an ONNX graph's weights: .data)


def mapped_file_bytes(exclude: Path | None = None) -> int:
    """Bytes of file pages this process has mapped and in RAM now: its libraries' code, and a loaded drafter's
    weights, but for `exclude` (the target about to stream) and, without it, every model file. Under a memory limit
    the kernel counts them as reclaimable, but one reclaimed is read again as soon as it runs: they are not room for
    a target (Qwen2.5-Coder-1.5B's process maps 28 MiB of them; a plan that counted them as room took a repacked
    target for one that fits under 1175 MiB, and it read 742 MB a pass)."""
    import psutil

    def kept(path: str) -> bool:
        if not path.startswith("/"):
            return False
        return Path(path) != exclude if exclude is not None else not path.endswith(MODEL_SUFFIXES)

    try:
        return sum(region.rss - region.anonymous for region in psutil.Process().memory_maps(grouped=True)
                   if kept(region.path))
    except (psutil.Error, OSError):
        return 0


def free_bytes() -> int | None:
    """What this process may still allocate before the kernel reclaims or kills: the machine's available RAM, or
    the room under a memory cgroup's limit where that is less; None where neither can be read."""
    return free_beside_locked(0)


def free_beside_locked(locked: int) -> int | None:
    """free_bytes, where `locked` bytes of this process's file pages are locked (mlock) and counted as taken: a memory
    cgroup counts them in its page cache, so in its room, where the machine's MemAvailable leaves them out already
    (they are unevictable). None where neither can be read."""
    _, free = _machine_ram()
    limit = memory_limit()
    rooms = ([] if free is None else [free]) + ([] if limit is None else [limit.room - locked])
    return min(rooms, default=None)


def _machine_ram() -> tuple[int | None, int | None]:
    meminfo = _meminfo_kib()
    if "MemTotal" in meminfo:
        # MemAvailable counts reclaimable page cache; MemFree alone would understate it badly.
        free = meminfo.get("MemAvailable", meminfo.get("MemFree"))
        return meminfo["MemTotal"] * 1024, None if free is None else free * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), None
    except (AttributeError, ValueError, OSError):
        return None, None


@dataclass(frozen=True)
class MemoryLimit:
    """A memory cgroup's limit over this process: bytes, and the bytes already charged that the kernel cannot
    reclaim (anonymous and kernel memory: the charge less its page cache)."""

    limit: int
    unreclaimable: int
    source: str  # the file the limit was read from

    @property
    def room(self) -> int:
        """What the process may still allocate before the kernel must kill something."""
        return max(0, self.limit - self.unreclaimable)


NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as the largest page-aligned 64-bit value


def memory_limit(proc_self: Path = Path("/proc/self")) -> MemoryLimit | None:
    """The tightest memory cgroup limit on this process (cgroup v2's memory.max, v1's memory.limit_in_bytes, over
    its cgroup and every parent), or None where there is none or it cannot be read (not Linux, no cgroup mounted)."""
    try:
        memberships = (proc_self / "cgroup").read_text().splitlines()
        mounts = (proc_self / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in memberships:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        version = 2 if hierarchy == "0" and controllers == "" else 1
        if version == 1 and "memory" not in controllers.split(","):
            continue
        folder = _cgroup_folder(mounts, version, path)
        if folder is not None and (limit := _tightest(folder, version)) is not None:
            found.append(limit)
    return min(found, key=lambda limit: limit.room, default=None)


def _cgroup_folder(mounts: list[str], version: int, path: str) -> tuple[Path, Path] | None:
    """The cgroup's folder and its hierarchy's mount point, from /proc/self/mountinfo (a container mounts its own
    cgroup as the root: a path outside the mount is the mount point itself)."""
    for line in mounts:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3:
            continue
        fstype, options = after[0], after[2].split(",")
        if (version == 2 and fstype == "cgroup2") or (version == 1 and fstype == "cgroup" and "memory" in options):
            root, mount_point = fields[3], Path(fields[4])
            relative = path[len(root):] if root != "/" and path.startswith(root) else path
            folder = mount_point / relative.lstrip("/")
            return (folder if folder.is_dir() else mount_point), mount_point
    return None


def _tightest(where: tuple[Path, Path], version: int) -> MemoryLimit | None:
    """The smallest limit from the cgroup's folder up to its hierarchy's root, with the usage of that cgroup."""
    folder, top = where
    best: MemoryLimit | None = None
    while True:
        limit = _read_limit(folder, version)
        if limit is not None and (best is None or limit.room < best.room):
            best = limit
        if folder == top or top not in folder.parents:
            return best
        folder = folder.parent


def _read_limit(folder: Path, version: int) -> MemoryLimit | None:
    names = ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    try:
        raw_limit = (folder / names[0]).read_text().strip()
        usage = int((folder / names[1]).read_text().strip())
        stat = dict(line.split()[:2] for line in (folder / "memory.stat").read_text().splitlines()
                    if len(line.split()) >= 2)
    except (OSError, ValueError):
        return None
    if raw_limit == "max" or not raw_limit.isdigit() or int(raw_limit) >= NO_LIMIT:
        return None
    cache_keys = ("file",) if version == 2 else ("total_cache", "cache")
    cache = next((int(stat[key]) for key in cache_keys if key in stat and stat[key].isdigit()), 0)
    return MemoryLimit(int(raw_limit), max(0, usage - cache), str(folder / names[0]))


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
