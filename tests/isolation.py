"""Tests own their state. A test run gets an edge-spec cache of its own: a temporary folder whose model files are links
to those the user's cache already holds (read there, never written: every write into the cache is a new file renamed
over the old name, which replaces a link, not what it points to), and a check that the user's cache is left as found.
Each test starts with the runtimes registry as the run began and with the shared pairs' lookup replies forgotten."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from edge.models.cache import cache_dir
from edge.models.pair import Pair

USER_CACHE = "EDGE_SPEC_TESTS_USER_CACHE"  # set by the run that made the cache; its workers and children inherit it
# What a run may read from the user's cache: downloads and their sha256 stamps, and what was prepared from them that
# costs time to make again (requantized copies, ONNX graphs). Vocabularies (prepare --vocab), measurements
# (pass-times.json, machine.json) and saved lookup replies are not shared: a test that needs one makes it.
MODEL_FOLDERS = ("models", "prepared", "prepared/graphs", "stamps")
MODEL_FILES = (".gguf", ".sha256", ".onnx", ".onnx.data")

SHARED_PAIRS: weakref.WeakSet[Pair] = weakref.WeakSet()  # pairs that outlive a test (session and module fixtures)


def link_models(source: Path, cache: Path) -> None:
    """Give `cache` links to the model files `source` holds (a half-written NAME.tmp-PID is not one). Files only, never
    a folder: whatever is written lands in `cache`."""
    for folder in MODEL_FOLDERS:
        if not (source / folder).is_dir():
            continue
        (cache / folder).mkdir(parents=True, exist_ok=True)
        for file in sorted((source / folder).iterdir()):
            if file.is_file() and file.name.endswith(MODEL_FILES):
                (cache / folder / file.name).symlink_to(file.resolve())


def tree_state(folder: Path) -> dict[str, tuple[int, int, int]]:
    """What tells one state of a folder tree from another without reading a file: each entry's kind, size and mtime,
    by path ("." the folder itself; {} when it is absent). A folder's mtime counts too: it changes when an entry is
    made in it, even one removed again."""
    state = {}
    if not os.path.lexists(folder):
        return state
    for root, folders, files in os.walk(folder):
        for name in [".", *files, *folders]:
            path = Path(root, name)
            try:
                info = path.lstat()
            except FileNotFoundError:  # removed since it was listed: as if never seen
                continue
            size = 0 if stat.S_ISDIR(info.st_mode) else info.st_size
            state[str(path.relative_to(folder))] = (stat.S_IFMT(info.st_mode), size, info.st_mtime_ns)
    return state


def changes(before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]]) -> list[str]:
    """The paths made, removed or changed between two states of a tree."""
    return sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))


def default_cache() -> Path:
    """The cache edge-spec uses when EDGE_SPEC_CACHE is not set: $XDG_CACHE_HOME/edge-spec or ~/.cache/edge-spec."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("EDGE_SPEC_CACHE", raising=False)
        return cache_dir()


@dataclass
class RunCache:
    """A test run's EDGE_SPEC_CACHE, set in this process's environment (so every test and every process a test
    starts sees it), and the user's caches it stands in for, with their state when the run began."""

    folder: Path
    guarded: dict[Path, dict]  # the user's caches (the one their commands use, the default one) as the run began
    before: str | None  # EDGE_SPEC_CACHE as the run found it

    @classmethod
    def start(cls) -> RunCache:
        """A new temporary cache whose model files are those of the user's cache: a model that cache lacks is
        downloaded once for the run, into the temporary one."""
        user = cache_dir()
        guarded = {path: tree_state(path) for path in dict.fromkeys([user, default_cache()])}
        folder = Path(tempfile.mkdtemp(prefix="edge-spec-tests-"))
        link_models(user, folder)
        before = os.environ.get("EDGE_SPEC_CACHE")
        os.environ["EDGE_SPEC_CACHE"], os.environ[USER_CACHE] = str(folder), str(user)
        return cls(folder, guarded, before)

    def changed(self) -> str | None:
        """What is not as the run found it in the user's caches, in a few words (None: nothing)."""
        said = []
        for cache, before in self.guarded.items():
            if changed := changes(before, tree_state(cache)):
                said.append(f"{cache} ({len(changed)} changed, first {changed[0]})")
        return ", ".join(said) or None

    def close(self) -> None:
        os.environ.pop(USER_CACHE, None)
        if self.before is None:
            os.environ.pop("EDGE_SPEC_CACHE", None)
        else:
            os.environ["EDGE_SPEC_CACHE"] = self.before
        shutil.rmtree(self.folder, ignore_errors=True)


def share(pair: Pair) -> Pair:
    """Mark a pair that several tests use: each of them starts with its lookup replies forgotten."""
    SHARED_PAIRS.add(pair)
    return pair


def forget_shared_replies() -> None:
    for pair in list(SHARED_PAIRS):
        pair.forget_replies()


@contextmanager
def restored_registries() -> Iterator[None]:
    """The runtimes registry put back as it was (runtimes.register adds to it): a test's runtime is gone after it."""
    from edge import runtimes

    saved = [(table, dict(table)) for table in (runtimes.PACKAGES, runtimes.TRAITS)]
    try:
        yield
    finally:
        for table, entries in saved:
            table.clear()
            table.update(entries)
