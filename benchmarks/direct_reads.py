"""What reading a streamed target's layers costs the CPU, through the page cache as the window read them before, and
straight into slots moved into the mapping (offload/direct.py), on the real file.

    python benchmarks/direct_reads.py                       # the default pair's target, as the plan streams it
                                                            # under 1049 MiB (its last 217 MiB in pass order)
    python benchmarks/direct_reads.py --streamed-mb 400 --repeats 8

Each repeat reads the streamed layers once each way, in turn, as a pass does: the page cache way asks for a layer
(posix_fadvise WILLNEED, in the window's chunks), touches each of its pages through the mapping (a pass's page faults)
and drops it (MADV_DONTNEED, FADV_DONTNEED); the direct way reads it into a slot and places it, touches its pages and
releases it. It reports, for each, the median wall time, GB/s, and the CPU time the whole machine spent meanwhile
(/proc/stat: the kernel's work for the reads counts wherever it ran). Nothing else should run beside it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def busy_seconds() -> float:
    """CPU seconds the machine has spent not idle (all cores), from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def touch(start: int, end: int) -> int:
    """Read one byte of each page of [start, end) of this process's memory, as a pass's matmuls fault them in."""
    import ctypes

    pages = np.ctypeslib.as_array((ctypes.c_ubyte * (end - start)).from_address(start))
    return int(pages[::mmap.PAGESIZE].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default=None, help="a pair of models.toml (default: the default pair)")
    parser.add_argument("--streamed-mb", type=int, default=217, help="the target's last MiB in pass order, streamed")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()

    from edge.models.opening import materialize
    from edge.models.registry import load_registry
    from edge.offload.ssd import pass_order, readahead_order
    from edge.offload.window import WILLNEED_CHUNK, WindowedStreamer

    spec = load_registry().pair(args.pair)
    path = materialize(spec.target, lambda message: print(message, file=sys.stderr))
    size = path.stat().st_size
    with open(path, "rb") as file, mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ):  # as the runtime maps it
        weights = sum(tensor.size for tensor in readahead_order(pass_order(path)))  # what passes read
        streamer = WindowedStreamer(path, window=size, resident=max(0, weights - (args.streamed_mb << 20)))
        try:
            direct = streamer._direct
            if direct is None:
                sys.exit("this file system refuses direct reads (O_DIRECT): the page cache reads every layer")
            layers = sorted(streamer._regions)
            direct.resize(len(layers))

            def through_page_cache() -> None:
                for layer in layers:
                    for start, end, offset in streamer._regions[layer]:
                        for at in range(offset, offset + end - start, WILLNEED_CHUNK):
                            os.posix_fadvise(streamer._fd, at, min(WILLNEED_CHUNK, offset + end - start - at),
                                             os.POSIX_FADV_WILLNEED)
                for layer in layers:
                    for start, end, offset in streamer._regions[layer]:
                        touch(start, end)
                        streamer._drop(start, end, offset)

            def directly() -> None:
                for layer in layers:
                    direct.read(layer)
                for layer in layers:
                    for start, end, _ in streamer._regions[layer]:
                        touch(start, end)
                    direct.release(layer)
                    for start, end, offset in streamer._regions[layer]:
                        streamer._drop(start, end, offset)

            streamer.evict()
            runs: dict[str, list[tuple[float, float]]] = {"page_cache": [], "direct": []}
            for _ in range(args.repeats + 1):  # the first round takes the slots' pages: not counted
                for name, read in (("page_cache", through_page_cache), ("direct", directly)):
                    busy, started = busy_seconds(), time.perf_counter()
                    read()
                    runs[name].append((time.perf_counter() - started, busy_seconds() - busy))
            streamed = streamer.streamed_bytes
            report = {"target": path.name, "streamed_bytes": streamed, "layers": len(layers),
                      "slot_bytes": direct.slot_bytes, "repeats": args.repeats}
            for name, timings in runs.items():
                wall = statistics.median(t for t, _ in timings[1:])
                cpu = statistics.median(c for _, c in timings[1:])
                report[name] = {"wall_ms": round(wall * 1000, 1), "cpu_ms": round(cpu * 1000, 1),
                                "gb_per_s": round(streamed / wall / 1e9, 3)}
            print(json.dumps(report, indent=2))
        finally:
            streamer.close()


if __name__ == "__main__":
    main()
