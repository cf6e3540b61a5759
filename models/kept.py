"""What a run keeps in edge-spec's cache for the next one: `--budget auto`'s pass times (pass-times.json, one entry
per machine, placement and file) and lookup keep's earlier replies (lookup/<target>-<size>.npy).

Each is read whole and written whole (a crash leaves the old file), and a damaged one is said in one line and
started over: neither is more than a measurement or a convenience.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge.models.cache import JsonFile, cache_dir

from edge.lookup import Corpus

Report = Callable[[str], None]

PASS_TIMES = "pass-times.json"
PASS_TIMES_KEPT = 64  # pass-times.json keeps the newest entries: one is made per machine, placement and file
COSTS_VERSION = "costs 6"  # bumped when what the cached pass times measure changes (tree shapes, eviction, sizes)


def _quiet(_message: str) -> None:
    pass


def pass_times() -> dict[str, Any]:
    """Every kept entry of pass-times.json, by key (empty where there is none)."""
    return JsonFile(cache_dir() / PASS_TIMES).read()


def keep_pass_times(key: str, entry: dict[str, Any]) -> None:
    """Keep one entry (dated now), and the PASS_TIMES_KEPT newest with it."""
    store = JsonFile(cache_dir() / PASS_TIMES)
    store.write(_newest({**store.read(), key: {**entry, "measured": time.time()}}))


def pass_times_key(target: Path, drafter: str, placement: str, readahead: str, drafter_threads: int | None,
                   max_tree: int | None) -> str:
    """The entry of a pair's pass times: this machine and drive, the target file as it is now, and what changes the
    passes (the drafter, the placement, reading ahead, the drafter's threads, a memory limit's largest tree)."""
    from edge.offload.probe import machine_key

    stat = target.stat()
    return (f"{machine_key(target)}|{target.name}|{stat.st_size}|{stat.st_mtime_ns}|{drafter}|{placement}|"
            f"readahead {readahead}|drafter threads {drafter_threads}|{COSTS_VERSION}"
            + ("" if max_tree is None else f"|trees up to {max_tree}"))


def target_entries(target: Path) -> dict[str, Any]:
    """The kept entries of this target file on this machine, whatever drafter and placement timed them."""
    from edge.offload.probe import machine_key

    stat = target.stat()
    prefix = f"{machine_key(target)}|{target.name}|{stat.st_size}|{stat.st_mtime_ns}|"
    return {key: entry for key, entry in pass_times().items() if key.startswith(prefix) and isinstance(entry, dict)}


def _newest(entries: dict[str, Any]) -> dict[str, Any]:
    """The PASS_TIMES_KEPT most recently measured entries (entries without a date count as oldest)."""
    def measured(item: tuple[str, Any]) -> float:
        value = item[1].get("measured") if isinstance(item[1], dict) else None
        return float(value) if isinstance(value, int | float) else 0.0

    return dict(sorted(entries.items(), key=measured)[-PASS_TIMES_KEPT:])


def corpus_path(target: Path) -> Path:
    """Where lookup keep saves the replies drafted from: in the cache, one file per target file (token ids are its
    vocabulary's)."""
    size = target.stat().st_size if target.is_file() else 0
    return cache_dir() / "lookup" / f"{target.name}-{size}.npy"


def open_corpus(target: Path, mode: str, report: Report = _quiet) -> Corpus | None:
    """The replies lookup drafts from: None with lookup off; empty with on; with keep, those an earlier run saved (a
    damaged file is said and started over)."""
    if mode == "off":
        return None
    path = corpus_path(target)
    if mode != "keep" or not path.is_file():
        return Corpus()
    try:
        import numpy as np

        tokens = np.load(path, allow_pickle=False)
        if tokens.dtype != np.int32 or tokens.ndim != 1:
            raise ValueError(f"{tokens.dtype} array of {tokens.ndim} dimensions, not int32 tokens")
        return Corpus.from_array(tokens)
    except (OSError, ValueError) as problem:
        report(f"lookup keep: {path} cannot be read ({problem}); starting a new one")
        return Corpus()


def save_corpus(corpus: Corpus, target: Path, report: Report = _quiet) -> None:
    """Save the replies for the next run's lookup (written whole, then renamed: a crash leaves the old file)."""
    import numpy as np

    path = corpus_path(target)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial.npy")
        np.save(partial, corpus.to_array(), allow_pickle=False)
        partial.replace(path)
    except OSError as problem:
        report(f"lookup keep: cannot save {path} ({problem.strerror}); this run's replies are not kept")
