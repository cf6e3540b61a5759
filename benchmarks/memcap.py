"""Run a command, or a Python callable in a child process, under a memory limit: a cgroup v1 memory controller's
`memory.limit_in_bytes` (as root). The cgroup is made for the one run and removed after it, on failure and Ctrl-C
too.

Why it streams a target: a v1 memory cgroup charges its processes' page cache, the read-only pages of an mmap'd file
included, and reclaims them when the cgroup reaches its limit. A target file larger than the room left under the
limit is then read from the disk on every pass, by the kernel, as on a machine with that much RAM (measured here: a
child sweeping SmolLM2's 258 MiB F16 file under a 100 MiB cap read 270 MiB from the disk on every sweep; without the
cap, nothing after the first). Anonymous memory cannot be reclaimed without swap, so a limit below what the process
allocates gets it killed (CappedRun.oom_kills says so).

A page in the page cache stays charged to the cgroup that read it first, and is never reclaimed for another one:
`drop_cache` evicts files (those not mapped by a live process) before the child starts, so that it reads them itself.

The cgroup is made inside the caller's own memory cgroup (/proc/self/cgroup): its limit then nests within any limit
the caller already runs under (a systemd slice, a container), and its memory counts there too. From the root cgroup
that is /sys/fs/cgroup/memory/edge-spec-<pid>-<n>.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_names = itertools.count()
REMOVE_WAIT_S = 5.0  # for the kernel to let go of a cgroup whose last process has just exited
SAMPLE_S = 0.05  # how often the anonymous memory is sampled for its peak (the kernel keeps only the total's)


class CgroupUnavailable(Exception):
    """A memory cgroup cannot be made here; the message says why in one line."""


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path  # the cgroup's folder
    limit_bytes: int | None  # None: no limit, the cgroup only counts

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def peak_bytes(self) -> int:
        """The most memory (anonymous and page cache) charged to the cgroup at once."""
        return int(_read(self.path / "memory.max_usage_in_bytes") or 0)

    def anon_bytes(self) -> int:
        """Anonymous memory charged now (memory.stat's rss: what cannot be reclaimed without swap)."""
        stat = dict(line.split() for line in (_read(self.path / "memory.stat") or "").splitlines() if " " in line)
        return int(stat.get("total_rss", stat.get("rss", 0)))

    def oom_kills(self) -> int:
        """Processes the kernel killed for reaching the limit (memory.oom_control's oom_kill, where it says)."""
        for line in (_read(self.path / "memory.oom_control") or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0


@dataclass(frozen=True)
class CappedRun:
    returncode: int
    limit_bytes: int | None
    peak_bytes: int  # memory.max_usage_in_bytes: anonymous memory and page cache together
    peak_anon_bytes: int  # the most anonymous memory seen (sampled every SAMPLE_S)
    oom_kills: int
    seconds: float
    stdout: str | None = None
    stderr: str | None = None
    value: Any = None  # what the callable returned (call_capped)


def own_memory_folder() -> Path | None:
    """This process's own memory cgroup's folder, where its cgroup v1 memory hierarchy is mounted; None when there is
    no v1 memory controller (cgroup v2 alone)."""
    own = _own_memory_cgroup()
    if own is None:
        return None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] != "cgroup" or "memory" not in tail[2].split(","):
            continue
        root, mount = fields[3], fields[4]  # the hierarchy's folder mounted there, and where
        if own == root or own.startswith(root.rstrip("/") + "/"):
            return Path(mount) / own[len(root):].lstrip("/")
    return None


def unavailable() -> str | None:
    """Why a memory cgroup cannot be made here (one line), or None when it can (tried: one is made and removed)."""
    try:
        with memory_cgroup(1 << 30):
            pass
    except CgroupUnavailable as error:
        return str(error)
    return None


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int | None) -> Iterator[MemoryCgroup]:
    """A new memory cgroup limited to `limit_bytes` (swap included, where swap is accounted; None: no limit, for
    the accounting alone), removed on leaving: any process still in it is killed first (only processes started into
    it can be there)."""
    parent = own_memory_folder()
    if parent is None:
        raise CgroupUnavailable("no cgroup v1 memory controller is mounted here (cgroup v2 alone is not supported); "
                                "a memory cap needs one")
    path = parent / f"edge-spec-{os.getpid()}-{next(_names)}"
    try:
        path.mkdir()
    except OSError as error:
        raise CgroupUnavailable(f"cannot make a memory cgroup in {parent}: {error.strerror} (run as root)") from None
    try:
        if limit_bytes is not None:
            _set_limit(path, limit_bytes)
        yield MemoryCgroup(path, limit_bytes)
    finally:
        _remove(path)


def _set_limit(path: Path, limit_bytes: int) -> None:
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        memsw = path / "memory.memsw.limit_in_bytes"  # only where swap is accounted; never below the memory limit
        if memsw.exists():
            with contextlib.suppress(OSError):
                memsw.write_text(str(limit_bytes))
    except OSError as error:
        raise CgroupUnavailable(f"cannot set a memory limit on {path}: {error.strerror}") from None


@contextlib.contextmanager
def _anon_peak(cgroup: MemoryCgroup) -> Iterator[list[int]]:
    """Samples the cgroup's anonymous memory from a thread while the block runs; [peak] once it ends."""
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], cgroup.anon_bytes())
            stop.wait(SAMPLE_S)

    thread = threading.Thread(target=sample, name="edge-spec-memcap", daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()


def drop_from_cache(paths: Iterable[Path]) -> None:
    """Evict the files' pages from the page cache (pages mapped by a live process stay)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_capped(command: Sequence[str], limit_bytes: int | None, drop_cache: Iterable[Path] = (), capture: bool = True,
               **popen: Any) -> CappedRun:
    """Run `command` in a new memory cgroup of `limit_bytes`; its output captured (text) unless capture is False.
    A tiny shell enters the cgroup and then execs the command, so everything the command allocates is counted."""
    start = time.perf_counter()
    with memory_cgroup(limit_bytes) as cgroup:
        drop_from_cache(drop_cache)
        enter = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup.procs), *command]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True} if capture else {}
        with _anon_peak(cgroup) as anon:
            child = subprocess.Popen(enter, **pipes, **popen)
            try:
                stdout, stderr = child.communicate()
            except BaseException:  # Ctrl-C: stop the child, then the cgroup goes
                child.kill()
                child.wait()
                raise
        return CappedRun(child.returncode, limit_bytes, cgroup.peak_bytes(), anon[0], cgroup.oom_kills(),
                         time.perf_counter() - start, stdout, stderr)


def call_capped(fn: Callable[..., Any], *args: Any, limit_bytes: int | None,
                drop_cache: Iterable[Path] = ()) -> CappedRun:
    """fn(*args) in a fresh Python process (spawned: `fn` and its arguments must pickle) that enters a new memory
    cgroup of `limit_bytes` before calling it; its return value in `.value`. An exception in fn is raised here as a
    RuntimeError with the child's traceback; a child killed for memory raises MemoryError."""
    start = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    with memory_cgroup(limit_bytes) as cgroup:
        drop_from_cache(drop_cache)
        receive, send = spawn.Pipe(duplex=False)
        child = spawn.Process(target=_call_in_cgroup, args=(str(cgroup.procs), fn, args, send), daemon=True)
        with _anon_peak(cgroup) as anon:
            child.start()
            send.close()
            try:
                try:
                    status, value = receive.recv()
                except EOFError:  # the child died without answering
                    status, value = "died", None
                child.join()
            except BaseException:
                child.kill()
                child.join()
                raise
            finally:
                receive.close()
        run = CappedRun(child.exitcode or 0, limit_bytes, cgroup.peak_bytes(), anon[0], cgroup.oom_kills(),
                        time.perf_counter() - start, value=value if status == "ok" else None)
    if status == "error":
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed under {_cap(limit_bytes)}:\n{value}")
    if status == "died":
        why = "killed for memory" if run.oom_kills else f"exit code {run.returncode}"
        raise MemoryError(f"{getattr(fn, '__name__', fn)} died under {_cap(limit_bytes)} ({why}; "
                          f"peak {run.peak_bytes >> 20} MiB)")
    return run


def _cap(limit_bytes: int | None) -> str:
    return "no cap" if limit_bytes is None else f"a {limit_bytes >> 20} MiB cap"


def _call_in_cgroup(procs: str, fn: Callable[..., Any], args: tuple, send: Any) -> None:
    Path(procs).write_text(str(os.getpid()))  # before fn allocates anything: what it does is counted
    try:
        send.send(("ok", fn(*args)))
    except Exception:
        send.send(("error", traceback.format_exc()))
    finally:
        send.close()


def _remove(path: Path) -> None:
    """Kill what is left in the cgroup (our own children), reclaim its page cache, and remove it."""
    deadline = time.monotonic() + REMOVE_WAIT_S
    while True:
        pids = [int(pid) for pid in (_read(path / "cgroup.procs") or "").split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not pids:
            with contextlib.suppress(OSError):  # drop its charged page cache now, not whenever the kernel gets to it
                (path / "memory.force_empty").write_text("0")
            try:
                path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
        elif time.monotonic() > deadline:
            raise OSError(f"cannot remove cgroup {path}: processes {pids} are still in it")
        time.sleep(0.05)


def _own_memory_cgroup() -> str | None:
    """This process's memory cgroup as /proc/self/cgroup names it (v1: the 'memory' controller's line)."""
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        _id, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def main() -> None:
    """`python benchmarks/memcap.py --cap-mb 900 -- edge-spec generate -m qwen2.5-coder-1.5b -n 48 "..."`: the command
    in a cgroup of that limit, its output passed through; then one JSON line on stderr: its exit code, peak memory
    (page cache included), peak anonymous memory, whether the kernel killed it, and its seconds."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    parser.add_argument("--cap-mb", type=int, default=None, help="the limit in MiB (default: none; the cgroup counts)")
    parser.add_argument("--drop", action="append", type=Path, default=[],
                        help="a file to evict from the page cache first, e.g. the model (repeatable): a page stays "
                             "charged to the cgroup that read it, so a file an earlier run left cached is free memory")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if (why := unavailable()) is not None:
        raise SystemExit(why)
    run = run_capped(command, None if args.cap_mb is None else args.cap_mb << 20, drop_cache=args.drop, capture=False)
    print(json.dumps({"returncode": run.returncode, "cap_mib": args.cap_mb, "peak_mib": run.peak_bytes >> 20,
                      "peak_anon_mib": run.peak_anon_bytes >> 20, "oom_kills": run.oom_kills,
                      "seconds": round(run.seconds, 1)}), file=sys.stderr)
    raise SystemExit(run.returncode)


if __name__ == "__main__":
    main()
