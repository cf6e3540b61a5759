"""The pages of a target's file mapping that its passes read, locked in RAM: for a target loaded in RAM on
llama.cpp's repacked buffers under a memory limit.

Such a target reads most of its weights from anonymous memory (the repacked copy), which the kernel cannot evict
without swap, and the rest from its file's mapping: the tensors llama.cpp does not repack (Qwen2.5-Coder-1.5B
Q4_K_M: the Q6_K ones and the tied token table, 368 MiB of the 1066 MiB file). Under a limit the kernel's reclaim
takes some of those mapped pages between passes, and the next pass reads them again (0.92 MB a pass in a second
reply under 1300 MiB; docs/plan.md). The pages a pass reads are found on the first passes: before the first, the
mapping is emptied (MADV_DONTNEED: the pages stay in the page cache, only this process's page table forgets them);
after it, the pages mapped again (/proc/self/pagemap) are the ones the pass touched, and those are locked (mlock).
The rest of the mapping, the repacked tensors' original bytes, stays evictable. Under the limit the first pass's own
reading evicts some of what it read before it ends (the pair under 1300 MiB: 348 MiB still mapped after it), so the
next passes, up to WATCHED_PASSES, lock what they map again.

Locked pages are never reclaimed, so a lock that left no room for what the process still allocates would turn the
kernel's eviction (a slower pass) into the limit's OOM kill. Only as much is locked as the limit leaves past the
KV cache's growth to its whole context (`reserve`) and a plain target's headroom (offload/plan.py PLAIN_HEADROOM);
what is not locked stays as it was, evictable.
"""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path

from edge.offload import libc
from edge.offload.libc import MADV_DONTNEED
from edge.offload.plan import PLAIN_HEADROOM
from edge.offload.probe import memory_limit
from edge.offload.ssd import mapped_ranges

WATCHED_PASSES = 4  # passes whose pages are locked: the first, and those that read again what it lost meanwhile


class PassPages:
    """Locks the pages of `path`'s mapping that a pass reads, around the target's first passes (`before_pass` and
    `after_pass` do nothing past WATCHED_PASSES). `locked_bytes`: what stays locked, up to what the memory limit
    leaves (0 where mlock was refused: RLIMIT_MEMLOCK without CAP_IPC_LOCK, in which case nothing stays locked)."""

    def __init__(self, path: Path, reserve: int = 0):
        self.path = path
        self.reserve = reserve  # bytes the process may still allocate (its KV cache's growth), kept out of the lock
        self.locked_bytes = 0
        self.found_bytes = 0  # what the passes so far read from the mapping
        self._ranges: list[tuple[int, int]] | None = None
        self._passes = 0
        self._refused = False

    def before_pass(self) -> None:
        if self._ranges is not None:
            return
        self._ranges = [(start, end) for start, end, _ in mapped_ranges(self.path)]
        for start, end in self._ranges:
            with contextlib.suppress(OSError):
                libc.madvise(start, end - start, MADV_DONTNEED)

    def after_pass(self) -> None:
        if self._ranges is None or self._passes >= WATCHED_PASSES or self._refused:
            return
        self._passes += 1
        page = mmap.PAGESIZE
        runs = [(start + low * page, start + high * page) for start, end in self._ranges
                for low, high in libc.runs_of(libc.present_pages(start, end - start))]
        self.found_bytes = sum(end - start for start, end in runs)
        limit = memory_limit()
        room = self.found_bytes if limit is None else limit.room - self.reserve - PLAIN_HEADROOM
        locked: list[tuple[int, int]] = []
        try:
            for start, end in runs:  # mlock again where it holds already: nothing changes there
                end = min(end, start + max(0, room) // page * page)
                if end <= start:
                    break
                libc.mlock(start, end - start)
                locked.append((start, end))
                room -= end - start
        except OSError:
            self._refused = True
            for start, end, _ in mapped_ranges(self.path):
                with contextlib.suppress(OSError):
                    libc.munlock(start, end - start)
            locked = []
        # what an earlier pass locked past this pass's room stays locked
        self.locked_bytes = 0 if self._refused else max(self.locked_bytes, sum(end - start for start, end in locked))
