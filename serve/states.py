"""Conversations a server's lane let go of, kept on the drive, so that a request continuing one finds its prompt read.

A lane holds one conversation: its principal's last prompt and reply (serve/worker.py). Where a request of another
conversation takes the lane, what the lane held would be lost, and the next turn of that conversation (or the same
prompt again) would be read anew: a pass of the whole prompt, which for a target streamed from the drive reads the
weights once more for every 256 tokens. Here the lane's cells are written to a file first (llama.cpp's sequence state:
the KV cells and the tokens they hold), and a request whose prompt starts with a kept conversation has them put back
into its lane instead of reading them. llama-server keeps its slots' prompts so too (in RAM: `--cache-ram`).

- The files are the cells as the pass computed them, so a reply from a conversation put back is the one it gets read
  anew, token for token (on the batch-invariant kernels, a cell does not depend on the pass it was computed in).
- A conversation is kept for its principal alone: another principal's request never finds it.
- They lie in a folder of the cache of their own, readable by this user only, at most `budget` bytes of them (the
  least recently used go first), and go when the server stops; a folder left by a server that did not stop cleanly
  goes when the next one starts.
- The drive, not RAM: under a memory limit every byte of RAM they took would be read from the drive again on every
  pass, as weights that no longer fit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from edge.models.cache import clean_stale

from edge.generate import common_prefix

STATES_BUDGET = 1 << 30  # bytes of kept conversations on the drive, at most
MIN_GAIN = 16  # tokens a kept conversation must hold past what the lane already holds to be put back
FOLDER = "prompt-states"  # in the cache: one folder per running server (states.tmp-PID)


@dataclass(frozen=True)
class Kept:
    """A conversation written to `path`: its cells hold context[:-1] (as a Decoder's caches do)."""

    principal: str | None
    context: tuple[int, ...]
    path: Path
    size: int


class PromptStates:
    """The kept conversations of one server, in `folder` (made here, removed by close)."""

    def __init__(self, cache: Path, budget: int = STATES_BUDGET):
        root = cache / FOLDER
        root.mkdir(parents=True, exist_ok=True)
        clean_stale(root)  # the folders of servers that did not stop cleanly (models/cache.py)
        self.folder = root / f"states.tmp-{os.getpid()}"
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(mode=0o700)
        self.budget = budget
        self.saved = self.restored = 0  # conversations written, and put back
        self._kept: list[Kept] = []  # least recently used first
        self._count = 0
        self._lock = threading.Lock()

    def best(self, principal: str | None, tokens: Sequence[int], more_than: int) -> Kept | None:
        """The kept conversation of `principal` that holds the longest start of `tokens` (all of them but the last at
        most, which a pass runs), if it holds more than `more_than` of them; it is then the most recently used."""
        with self._lock:
            scored = [(min(common_prefix(kept.context, tokens), len(tokens) - 1, len(kept.context) - 1), kept)
                      for kept in self._kept if kept.principal == principal]
            held, found = max(scored, key=lambda pair: pair[0], default=(0, None))
            if found is None or held <= more_than:
                return None
            self._kept.remove(found)
            self._kept.append(found)
            self.restored += 1
            return found

    def largest(self, principal: str | None) -> int:
        """The most cells a kept conversation of `principal` holds (0: none kept)."""
        with self._lock:
            return max((len(kept.context) - 1 for kept in self._kept if kept.principal == principal), default=0)

    def keep(self, principal: str | None, context: Sequence[int], write: Callable[[Path], int]) -> None:
        """Keep a conversation whose cells hold context[:-1]: `write(path)` writes them and returns the bytes. One
        that a kept conversation of the principal already holds whole is not written again; those it holds whole
        are replaced."""
        context = tuple(context)
        with self._lock:
            if any(kept.principal == principal and kept.context[: len(context) - 1] == context[:-1]
                   and len(kept.context) >= len(context) for kept in self._kept):
                return
            self._count += 1
            path = self.folder / f"{self._count}.state"
            size = write(path)
            covered = [kept for kept in self._kept if kept.principal == principal
                       and context[: len(kept.context) - 1] == kept.context[:-1]]
            for kept in covered:
                self._drop(kept)
            self._kept.append(Kept(principal, context, path, size))
            self.saved += 1
            while sum(kept.size for kept in self._kept) > self.budget and len(self._kept) > 1:
                self._drop(self._kept[0])

    def close(self) -> None:
        with self._lock:
            self._kept.clear()
            shutil.rmtree(self.folder, ignore_errors=True)

    def _drop(self, kept: Kept) -> None:
        self._kept.remove(kept)
        with contextlib.suppress(OSError):
            kept.path.unlink()

