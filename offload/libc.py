"""The C library's memory calls (mmap, munmap, madvise, mincore, mlock) and prctl: the one module in edge-spec that
calls libc through ctypes. Linux only.

Addresses are plain ints, so no caller holds a ctypes pointer; a failed call raises OSError with its errno.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import mmap
import os
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

MADV_DONTNEED = 4  # unmap the pages from this process (a read-only file mapping: nothing is lost)
MADV_POPULATE_READ = 22  # Linux >= 5.14: fault the pages in (reading them), as a read of each would
MADV_HUGEPAGE = 14  # back the range with transparent huge pages where the system has them
MADV_COLLAPSE = 25  # Linux >= 6.1: now, in place, the data kept (safe while other threads read or write it)
MAP_FIXED, MAP_NORESERVE = 0x10, 0x4000
MREMAP_MAYMOVE, MREMAP_FIXED, MREMAP_DONTUNMAP = 1, 2, 4
THP = Path("/sys/kernel/mm/transparent_hugepage")
ZERO_SCAN_PAGES = 1024  # pages checked for zeros at a time (release_zero_pages)
_MAP_FAILED = ctypes.c_void_p(-1).value
# new memory whose zero pages wait for the end of loading_side_by_side; None outside one
_held_back: list[tuple[int, int]] | None = None
_held_back_lock = threading.Lock()
_paused = 0  # collection_paused blocks open, in any thread
_collecting = True  # whether the collector ran before the outermost collection_paused block
_paused_lock = threading.Lock()


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    libc.mremap.restype = ctypes.c_void_p
    libc.pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    libc.pread.restype = ctypes.c_ssize_t
    return libc


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child process, between fork and exec (subprocess's preexec_fn): have the kernel kill it when the
    process that started it dies, even by SIGKILL, so no helper outlives an edge-spec that was killed."""
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _error(call: str) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, f"{call} failed: {os.strerror(errno)}")


def madvise(address: int, length: int, advice: int) -> None:
    """madvise(2) on this process's memory [address, address + length); address page-aligned."""
    if _libc().madvise(address, length, advice) != 0:
        raise _error("madvise")


def mlock(address: int, length: int) -> None:
    """mlock(2): fault [address, address + length) in and keep it in RAM (the kernel never reclaims it). Refused
    (EPERM, ENOMEM, EAGAIN) past RLIMIT_MEMLOCK for a process without CAP_IPC_LOCK."""
    if _libc().mlock(address, length) != 0:
        raise _error("mlock")


def munlock(address: int, length: int) -> None:
    if _libc().munlock(address, length) != 0:
        raise _error("munlock")


@contextmanager
def mapped(fd: int, length: int) -> Iterator[int]:
    """A read-only shared mapping of the file `fd`'s first `length` bytes, as its address; unmapped on exit."""
    address = _libc().mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        raise _error("mmap")
    try:
        yield address
    finally:
        _libc().munmap(address, length)


def anonymous(length: int) -> int:
    """New private, writable memory of `length` bytes (no pages yet: each is taken when first written), as its
    address; MAP_NORESERVE, as a buffer whose pages the caller writes."""
    address = _libc().mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE,
                           mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
    if address in (None, _MAP_FAILED):
        raise _error("mmap")
    return address


def munmap(address: int, length: int) -> None:
    if _libc().munmap(address, length) != 0:
        raise _error("munmap")


def map_file_at(address: int, length: int, fd: int, offset: int) -> None:
    """Map the file `fd` from `offset`, read-only and shared, at exactly [address, address + length), replacing
    what was mapped there (MAP_FIXED); no page is read until touched."""
    got = _libc().mmap(address, length, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd, offset)
    if got != address:
        raise _error("mmap")


def move_pages(source: int, length: int, destination: int) -> None:
    """Move the pages of private memory mapped at [source, source + length) to [destination, ...) without copying
    them (mremap(2), MREMAP_FIXED): what was mapped at the destination goes, and the source stays mapped, empty
    (MREMAP_DONTUNMAP, Linux >= 5.7), so that no other mapping of the process can take its addresses meanwhile. A
    thread reading the destination during the move waits for it, then reads the moved pages."""
    got = _libc().mremap(source, length, length, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, destination)
    if got != destination:
        raise _error("mremap")


def pread_into(fd: int, address: int, length: int, offset: int) -> int:
    """pread(2) into this process's memory at `address` (the GIL let go meanwhile); the bytes read."""
    got = _libc().pread(fd, address, length, offset)
    if got < 0:
        raise _error("pread")
    return got


def resident_pages(address: int, length: int) -> np.ndarray:
    """bool [pages]: which pages of [address, address + length) are in RAM (mincore(2)); address page-aligned."""
    pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    if _libc().mincore(address, length, vector) != 0:
        raise _error("mincore")
    return (np.frombuffer(vector, np.uint8) & 1).astype(bool)  # the other bits are reserved


def present_pages(address: int, length: int) -> np.ndarray:
    """bool [pages]: which pages of [address, address + length) are mapped into this process now (/proc/self/pagemap's
    present bit), as opposed to in the page cache (resident_pages): after MADV_DONTNEED on a file mapping, the pages
    touched since; address page-aligned. All False where the system will not say."""
    page = mmap.PAGESIZE
    pages = (length + page - 1) // page
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(address // page * 8)
            entries = np.frombuffer(pagemap.read(pages * 8), np.uint64)
    except OSError:
        return np.zeros(pages, bool)
    if len(entries) != pages:
        return np.zeros(pages, bool)
    return (entries >> np.uint64(63)).astype(bool)


def anonymous_regions() -> set[tuple[int, int]]:
    """This process's private, writable mappings of no file, as (start, end) addresses (/proc/self/maps): heap
    memory, as a library's large allocations get it."""
    regions = set()
    with open("/proc/self/maps", encoding="ascii") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) == 5 and fields[1].startswith("rw") and fields[1].endswith("p"):
                start, end = fields[0].split("-")
                regions.add((int(start, 16), int(end, 16)))
    return regions


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off, in every thread, until the block ends: for a native call whose
    new memory is told from /proc/self/maps (new_memory). A collection between the snapshot and the call can free an
    unreachable model's or context's memory, and the call's new mapping then takes those addresses, hidden as old."""
    global _paused, _collecting
    with _paused_lock:
        if _paused == 0:
            _collecting = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused -= 1
            if _paused == 0 and _collecting:
                gc.enable()


def new_memory(before: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of this process's anonymous mappings (anonymous_regions) that none of `before` covered: what was
    mapped since. A new mapping the kernel merged into a neighbouring one counts without its neighbour."""
    return ranges_outside(sorted(anonymous_regions()), before)


def ranges_outside(ranges: Iterable[tuple[int, int]], taken: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the [start, end) `ranges` that no range of `taken` covers."""
    taken = sorted(taken)
    left = []
    for start, end in ranges:
        for low, high in taken:
            if high <= start or low >= end:
                continue
            if low > start:
                left.append((start, low))
            start = max(start, high)
        if start < end:
            left.append((start, end))
    return left


def ranges_inside(ranges: Iterable[tuple[int, int]], within: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the [start, end) `ranges` that some range of `within` covers."""
    ranges, within = list(ranges), list(within)
    return ranges_outside(ranges, ranges_outside(ranges, within))


def release_zero_pages(regions: Iterable[tuple[int, int]]) -> int:
    """Give back the resident pages of these private anonymous regions that hold only zero bytes (MADV_DONTNEED): such
    a page reads as zeros again, and takes memory again once written. Returns the bytes given back. Only for memory no
    other thread writes meanwhile: a write between the check and the advice would be lost."""
    page = mmap.PAGESIZE
    released = 0
    for start, end in regions:
        first, last = -(-start // page) * page, end // page * page
        if last <= first:
            continue
        resident = resident_pages(first, last - first)
        words = np.ctypeslib.as_array((ctypes.c_uint64 * ((last - first) // 8)).from_address(first))
        pages = words.reshape(-1, page // 8)
        zero = np.zeros(len(pages), bool)
        for low, high in runs_of(resident):  # a page not resident is not read: reading would map it
            for chunk in range(low, high, ZERO_SCAN_PAGES):
                stop = min(high, chunk + ZERO_SCAN_PAGES)
                zero[chunk:stop] = ~pages[chunk:stop].any(axis=1)
        for low, high in runs_of(zero):
            madvise(first + low * page, (high - low) * page, MADV_DONTNEED)
            released += (high - low) * page
    return released


@contextmanager
def loading_side_by_side() -> Iterator[None]:
    """For models loading on two threads at once (models/loading.py: a target beside its drafter). A new llama.cpp
    context tells its KV cache from /proc/self/maps alone (anonymous memory mapped while it was made), so its regions
    can be the other load's, which that thread is still writing (a page found zero, written, then given back would
    lose the write) or frees (mincore fails on it). Inside the block, release_new_zero_pages holds them back; at its
    end, after both loads, the regions still mapped are checked once, while nothing writes to them."""
    global _held_back
    with _held_back_lock:
        outermost = _held_back is None
        if outermost:
            _held_back = []
    try:
        yield
    finally:
        if outermost:
            with _held_back_lock:
                regions, _held_back = _held_back or [], None
            if regions:
                release_zero_pages(ranges_inside(regions, anonymous_regions()))


def release_new_zero_pages(regions: list[tuple[int, int]]) -> int:
    """release_zero_pages for memory a native call just mapped: now (the bytes given back), or at the end of
    loading_side_by_side while models load side by side (0 here)."""
    with _held_back_lock:
        if _held_back is not None:
            _held_back.extend(regions)
            return 0
    return release_zero_pages(regions)


def runs_of(flags: np.ndarray) -> list[tuple[int, int]]:
    """The [low, high) runs of True in a bool array."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], flags, [False]]).astype(np.int8)))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def huge_page_size() -> int:
    """The size of a transparent huge page (PMD-mapped), or 0 where the system gives none (turned off, or no THP)."""
    try:
        if "[never]" in (THP / "enabled").read_text():
            return 0
        return int((THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 0


def collapse_to_huge_pages(regions: Iterable[tuple[int, int]]) -> int:
    """Move the populated memory of these regions onto transparent huge pages, in place (MADV_COLLAPSE), and mark
    them for huge pages (MADV_HUGEPAGE): fewer TLB misses for memory read through on every pass (a
    virtualized CPU walks two page tables a miss). Only whole huge pages inside each region move. Returns the bytes
    moved; 0 where the system has no huge pages or refuses (a kernel before 6.1, no free huge page): a hint,
    never an error."""
    size = huge_page_size()
    moved = 0
    for start, end in regions if size else ():
        first, last = -(-start // size) * size, end // size * size
        if last <= first:
            continue
        if _libc().madvise(first, last - first, MADV_HUGEPAGE) != 0:
            continue
        if _libc().madvise(first, last - first, MADV_COLLAPSE) == 0:
            moved += last - first
    return moved
