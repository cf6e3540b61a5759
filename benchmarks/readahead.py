"""How to read a streamed target's weights ahead (docs/performance.md): each way, right after an eviction.

    python benchmarks/readahead.py PREPARED.gguf     e.g. a target rewritten by `--target-dtype f16`

Prints, per way and repeat: the call's wall time and CPU time, the share of the file then in the page cache,
and the time of a 1-token llama.cpp pass after it; and the time one eviction takes.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import time
from pathlib import Path

from edge.offload import libc
from edge.offload.libc import MADV_POPULATE_READ
from edge.offload.ssd import READAHEAD_CHUNK, SsdStreamer, resident_fraction
from edge.runtimes.llama_cpp import RunOptions, load_target

from edge.tree import TokenTree

CHUNK_READAHEAD = 2 << 20
MADV_NORMAL, MADV_SEQUENTIAL, MADV_WILLNEED = 0, 2, 3
CHUNK_PREAD = 32 << 20


def main(path: Path, repeats: int = 2) -> None:
    target = load_target(path, RunOptions(n_ctx=256))
    streamer = SsdStreamer(path, readahead=True)
    native = ctypes.CDLL(None)  # readahead(2), which edge-spec itself does not call
    native.readahead.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_size_t]
    fd, size = os.open(path, os.O_RDONLY), path.stat().st_size
    buffer = bytearray(CHUNK_PREAD)
    ways = {
        "none": lambda: None,
        "posix_fadvise(WILLNEED), whole file": lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED),
        "readahead(2), 2 MB steps": lambda: [native.readahead(fd, o, CHUNK_READAHEAD)
                                             for o in range(0, size, CHUNK_READAHEAD)],
        "pread, 32 MB steps": lambda: [os.preadv(fd, [buffer], o) for o in range(0, size, CHUNK_PREAD)],
        "MADV_POPULATE_READ, 16 MB steps (edge-spec)": streamer._read_all,
        "same, MADV_WILLNEED 4 steps ahead": lambda: _populate_with_willneed(streamer, ahead=4),
        "same, mapping MADV_SEQUENTIAL": lambda: _populate_sequential(streamer),
    }
    print(f"{path.name}: {size / 1e6:.0f} MB")
    for name, read in ways.items():
        for _ in range(repeats):
            start = time.perf_counter()
            streamer.evict()
            evict_ms = 1000 * (time.perf_counter() - start)
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            read()
            call_ms = 1000 * (time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu_ms = 1000 * (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            time.sleep(max(0.0, 0.3 - call_ms / 1000))  # asynchronous ways get the time a tree's growth would give
            resident = resident_fraction(path)
            start = time.perf_counter()
            target.verify(TokenTree.root(1))
            pass_ms = 1000 * (time.perf_counter() - start)
            target.truncate(0)
            print(f"{name:45s} call {call_ms:6.0f} ms  cpu {cpu_ms:5.0f} ms  resident {resident:4.0%}  "
                  f"1-token pass {pass_ms:5.0f} ms  (eviction {evict_ms:3.0f} ms)")
    streamer.close()
    target.close()


def _steps(streamer: SsdStreamer) -> list[tuple[int, int]]:
    return [(address, min(READAHEAD_CHUNK, end - address))
            for start, end in streamer._ranges for address in range(start, end, READAHEAD_CHUNK)]


def _populate_with_willneed(streamer: SsdStreamer, ahead: int) -> None:
    """Each step populated while madvise(MADV_WILLNEED) has queued the reading of the next `ahead`."""
    steps = _steps(streamer)
    for address, length in steps[:ahead]:
        libc.madvise(address, length, MADV_WILLNEED)
    for index, (address, length) in enumerate(steps):
        if index + ahead < len(steps):
            later, later_length = steps[index + ahead]
            libc.madvise(later, later_length, MADV_WILLNEED)
        libc.madvise(address, length, MADV_POPULATE_READ)


def _populate_sequential(streamer: SsdStreamer) -> None:
    """The mapping marked sequential (the kernel then reads further ahead on faults) while it is populated."""
    for start, end, _ in streamer._maps:
        libc.madvise(start, end - start, MADV_SEQUENTIAL)
    streamer._read_all()
    for start, end, _ in streamer._maps:
        libc.madvise(start, end - start, MADV_NORMAL)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a target GGUF file, e.g. one `--target-dtype f16` prepared")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    main(args.path)
