"""offload/pass_pages.py: a stock target's first passes find the pages of its file's mapping they read, and those are
locked within what the memory limit leaves (a file mapping of this process stands in for llama.cpp's)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
from edge.offload.pass_pages import PassPages
from edge.offload.plan import PLAIN_HEADROOM
from edge.offload.probe import MemoryLimit

PAGE = mmap.PAGESIZE


def limit_leaving(monkeypatch: pytest.MonkeyPatch, room: int | None) -> None:
    limit = None if room is None else MemoryLimit(room + (1 << 30), 1 << 30, "memory.max")
    monkeypatch.setattr("edge.offload.pass_pages.memory_limit", lambda: limit)


@pytest.fixture
def weights(tmp_path: Path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(64 * PAGE))
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    for page in range(64):  # loaded: every page read once (llama.cpp repacks from the mapping)
        _ = mapping[page * PAGE]
    yield path, mapping
    mapping.close()  # unmapping unlocks


def a_pass(mapping: mmap.mmap) -> None:
    for page in range(8, 24):  # the tensors a pass reads from the mapping
        _ = mapping[page * PAGE]


FAULT_AROUND = 16  # pages the kernel maps around a read fault where they are cached (fault_around_bytes, 64 KiB)


@pytest.mark.parametrize("room_pages, locked_pages", [(None, None), (100, None), (10, 10), (0, 0)])
def test_the_pages_a_pass_read_are_locked_within_the_limits_room(weights, monkeypatch: pytest.MonkeyPatch,
                                                                 room_pages: int | None,
                                                                 locked_pages: int | None) -> None:
    """Locked: all the pages found (None), or as many as the limit's room holds."""
    path, mapping = weights
    reserve = 3 * PAGE  # the KV cache's growth, kept out of the lock
    limit_leaving(monkeypatch, None if room_pages is None else reserve + PLAIN_HEADROOM + room_pages * PAGE)
    pages = PassPages(path, reserve=reserve)
    pages.before_pass()
    a_pass(mapping)
    pages.after_pass()
    found = pages.found_bytes
    assert 16 * PAGE <= found <= (16 + 2 * FAULT_AROUND) * PAGE < 64 * PAGE  # not what loading read
    locked = found if locked_pages is None else locked_pages * PAGE
    assert pages.locked_bytes == locked
    pages.before_pass()  # the mapping is emptied once: a pass that reads nothing new changes nothing
    pages.after_pass()
    assert (pages.found_bytes, pages.locked_bytes) == (found, locked)
