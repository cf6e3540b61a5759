"""A streamed layer's weights read past the page cache: from the drive straight into memory kept from pass to pass
(O_DIRECT), then moved, without a copy, onto the addresses where the target's mapping of its file holds them.

Read through the page cache, every pass of a streamed target has the kernel allocate, map and drop each streamed page
again. The streamed part of Qwen2.5-Coder-1.5B under 1049 MiB (9 layers, 228 MB) took 184 ms and 115 ms of the CPU's
time that way, and 112 ms and 10 ms read directly into slots on huge pages (`python benchmarks/direct_reads.py
--streamed-mb 217`, medians of 6): the drive's large requests land in memory contiguous enough to take whole, and the
CPU is left to the pass's arithmetic.

- A slot: anonymous memory on transparent huge pages, as large as the largest streamed layer. A few are allocated
  once (their pages taken at the first read) and the drive writes them on every pass.
- A layer's interior: the whole pages of each of its runs in the mapping, less the first (it may hold another
  layer's last bytes) and a last page it fills only in part. Those edge pages stay the page cache's, asked for ahead
  (posix_fadvise WILLNEED) as the rest of the layer used to be.
- Placed: the slot's pages moved (mremap) onto the interior's addresses, where the pass reads them as it reads any
  page of the file. Released, once the pass has computed the layer: moved back into the slot, and the file mapped
  there again, so that whatever touches those addresses later reads the file, as before. A move leaves its source
  mapped, empty (MREMAP_DONTUNMAP): addresses left unmapped, even for a moment, could be given to another mapping
  of the process (a slot allocated next, a library's memory), which the move back would then overwrite.

A layer is the file's bytes whether placed or not, so a pass reads the same weights either way (a thread that reads
an interior while its pages move waits for the move, then reads the moved pages). What must never happen is a drop
(MADV_DONTNEED) of a placed interior: that would free the slot's pages, not the file's, and the pass would read
zeros. The window (offload/window.py) releases a layer before it drops its pages.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from edge.offload import libc

PAGE = mmap.PAGESIZE
# "0": streamed layers go through the page cache, as before (to compare, or where a file system misreads O_DIRECT)
OFF_SWITCH = "EDGE_SPEC_DIRECT_READS"


@dataclass(frozen=True)
class Piece:
    """The interior of one run of a layer: its address in the target's mapping, its bytes, their file offset and
    where in a slot they are read to."""

    address: int
    length: int
    offset: int
    at: int


@dataclass
class Slot:
    memory: int  # the mapping's address and bytes (as unmapped)
    size: int
    start: int  # its first huge-page boundary: where pieces are read to


def interiors(runs: Sequence[tuple[int, int, int]]) -> tuple[list[Piece], list[tuple[int, int]]]:
    """A layer's runs (start, end, file offset; start page-aligned) as pieces, one after another in a slot, and the
    edge pages left to the page cache (file offset, bytes)."""
    pieces: list[Piece] = []
    edges: list[tuple[int, int]] = []
    at = 0
    for start, end, offset in runs:
        if end <= start:
            continue
        first = start - start % PAGE + PAGE
        last = max(first, end - end % PAGE)
        if last > first:
            pieces.append(Piece(first, last - first, offset + first - start, at))
            at += last - first
        edges.append((offset, min(first, end) - start))
        if end > last:
            edges.append((offset + last - start, end - last))
    return pieces, edges


class DirectReads:
    """The streamed layers of one target file, read directly into slots and placed in its mapping, one layer to a
    slot. `regions`: each streamed layer's runs in the mapping (start, end, file offset); `fd`: the file, open for
    reading (mapped back over a released interior). Raises OSError where the file system cannot read it directly."""

    def __init__(self, path: Path, regions: Mapping[int, Sequence[tuple[int, int, int]]], fd: int, slots: int):
        self._direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self._fd = fd
        self._layers = {layer: interiors(runs) for layer, runs in regions.items()}
        huge = libc.huge_page_size() or PAGE
        largest = max((sum(piece.length for piece in pieces) for pieces, _ in self._layers.values()), default=0)
        self.slot_bytes = -(-largest // huge) * huge
        self._huge = huge
        self._free: list[Slot] = []
        self._placed: dict[int, Slot] = {}
        self._slots = 0  # allocated, placed ones included
        self._wanted = 0
        self._lock = threading.Lock()
        self.resize(slots)

    @property
    def bytes(self) -> int:
        """The memory the slots take once read into."""
        return self._slots * self.slot_bytes

    def slots_for(self, window: int) -> int:
        """The slots a read-ahead window of `window` bytes holds, at most one a streamed layer; none where it holds
        less than a layer (a 70B's layer is most of a GiB): the page cache then reads every layer, within the window."""
        return min(len(self._layers), window // max(self.slot_bytes, 1))

    def resize(self, slots: int) -> None:
        """Keep `slots` slots: more are allocated as needed, fewer freed as soon as they are not placed."""
        with self._lock:
            self._wanted = slots
            while self._free and self._slots > slots:
                self._free_slot(self._free.pop())

    def placed(self, layer: int) -> bool:
        with self._lock:
            return layer in self._placed

    def read(self, layer: int) -> bool:
        """Ask for the layer's edge pages, read its interior into a slot and place it; False when it streams no
        interior or no slot is free (it is left to the page cache: the pass faults it in). Raises OSError where a
        read fails or comes back short (the layer is then left as it was)."""
        pieces, edges = self._layers.get(layer, ([], []))
        for offset, length in edges:
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_WILLNEED)
        if not pieces:
            return False
        slot = self._take(layer)
        if slot is None:
            return False
        try:
            for piece in pieces:
                if libc.pread_into(self._direct_fd, slot.start + piece.at, piece.length, piece.offset) != piece.length:
                    raise OSError(f"a direct read of {piece.length} bytes at {piece.offset} came back short")
            with self._lock:
                moved = []
                try:
                    for piece in pieces:
                        libc.move_pages(slot.start + piece.at, piece.length, piece.address)
                        moved.append(piece)
                except OSError:
                    self._put_back(slot, moved)
                    raise
                self._placed[layer] = slot
        except OSError:
            with self._lock:
                self._give(slot)
            raise
        return True

    def release(self, layer: int) -> None:
        """The pass is done with the layer: its pages back into their slot, the file mapped there again."""
        with self._lock:
            slot = self._placed.pop(layer, None)
            if slot is not None:
                self._put_back(slot, self._layers[layer][0])
                self._give(slot)

    def release_all(self) -> None:
        with self._lock:
            for layer in list(self._placed):
                slot = self._placed.pop(layer)
                self._put_back(slot, self._layers[layer][0])
                self._give(slot)

    def close(self) -> None:
        self.release_all()
        self.resize(0)
        with contextlib.suppress(OSError):
            os.close(self._direct_fd)

    def _take(self, layer: int) -> Slot | None:
        with self._lock:
            if layer in self._placed:
                return None
            if self._free:
                return self._free.pop()
            if self._slots >= self._wanted:
                return None
            size = self.slot_bytes + self._huge
            memory = libc.anonymous(size)
            start = memory + (-memory) % self._huge
            with contextlib.suppress(OSError):  # no huge pages: 4 KiB ones, the direct reads a little slower
                libc.madvise(start, self.slot_bytes, libc.MADV_HUGEPAGE)
            self._slots += 1
            return Slot(memory, size, start)

    def _give(self, slot: Slot) -> None:
        """(holding the lock) A slot no layer holds: kept, or freed past the slots wanted."""
        if self._slots > self._wanted:
            self._free_slot(slot)
        else:
            self._free.append(slot)

    def _free_slot(self, slot: Slot) -> None:
        with contextlib.suppress(OSError):
            libc.munmap(slot.memory, slot.size)
        self._slots -= 1

    def _put_back(self, slot: Slot, pieces: Sequence[Piece]) -> None:
        """(holding the lock) Move placed pieces back into their slot and map the file over their addresses again. The
        file is mapped back whatever happens: empty memory left in the target's mapping would be read as zeros. A
        piece that cannot move back loses its pages, and the slot takes new ones at its next read."""
        for piece in pieces:
            with contextlib.suppress(OSError):
                libc.move_pages(piece.address, piece.length, slot.start + piece.at)
            libc.map_file_at(piece.address, piece.length, self._fd, piece.offset)


def open_direct(path: Path, regions: Mapping[int, Sequence[tuple[int, int, int]]], fd: int,
                window: int) -> DirectReads | None:
    """Direct reads for these streamed layers, with the slots a window of `window` bytes holds; None where the file
    system refuses O_DIRECT (tmpfs, some network file systems), the system cannot move pages (not Linux, before 5.7),
    or the environment turns them off (OFF_SWITCH=0: the page cache reads every layer, as before)."""
    if not regions or not reads_directly(path):
        return None
    try:
        direct = DirectReads(path, regions, fd, 1)
    except (OSError, AttributeError):
        return None
    direct.resize(direct.slots_for(window))
    return direct


def reads_directly(path: Path) -> bool:
    """Whether a target streamed from `path` beside a resident set will have its layers read directly here (as
    open_direct decides, before anything loads)."""
    if sys.platform != "linux" or os.environ.get(OFF_SWITCH) == "0" or not _moves_pages():
        return False
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


def _moves_pages() -> bool:
    """Whether this system moves pages and leaves their source mapped (MREMAP_DONTUNMAP: Linux 5.7 and later)."""
    try:
        memory = libc.anonymous(2 * PAGE)
    except (OSError, AttributeError):
        return False
    try:
        libc.move_pages(memory, PAGE, memory + PAGE)
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            libc.munmap(memory, 2 * PAGE)
