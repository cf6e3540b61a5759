"""What a run keeps in edge-spec's cache for the next one: `--budget auto`'s pass times (pass-times.json, one entry
per machine, placement and file; a plainly decoding target's one-token pass in RAM, and a streamed target's, too),
the tokens a pass each acceptance rule yielded when sampling (rule-yields.json, one entry per target and drafter
file: `--accept auto` starts on the rule that yielded more) and lookup keep's earlier replies
(lookup/<target>-<size>.npy).

Each is read whole and written whole (a crash leaves the old file), and a damaged one is said in one line and
started over: neither is more than a measurement or a convenience.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from edge.models.cache import JsonFile, cache_dir, clean_stale, file_stamp

from edge.lookup import MAX_CORPUS, Corpus

Report = Callable[[str], None]

PASS_TIMES = "pass-times.json"
PASS_TIMES_KEPT = 64  # pass-times.json keeps the newest entries: one is made per machine, placement and file
MAX_FILE_TOKENS = 2 * MAX_CORPUS  # a kept corpus holds MAX_CORPUS tokens at most, separators included: a larger file
SEPARATOR = -1  # what ends each reply in the file (Corpus.to_array)
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


RULE_YIELDS = "rule-yields.json"
RULE_YIELDS_KEPT = 32  # rule-yields.json keeps the newest entries: one a pair of files


def rule_yields_key(target: Path, drafter: Path, drafter_kind: str) -> str:
    """The entry of a pair's rule yields: the target and drafter files as they are now, and how the drafter runs
    (its runtime and head: what its trees are grown from). The machine does not change them."""
    stamps = ["{}|{}|{}".format(path.name, *file_stamp(path)[:2]) for path in (target, drafter)]
    return f"{stamps[0]}|{stamps[1]}|{drafter_kind}"


def rule_yields(key: str, kept: dict[str, Any] | None = None) -> dict[str, Any]:
    """The yields an earlier run kept for this pair (in `kept`, rule-yields.json as read; None: read it), by
    measurement (edge.policy.Measured's keys); empty where none were kept. Each is checked where it is read
    (RuleChoice.kept)."""
    entry = (JsonFile(cache_dir() / RULE_YIELDS).read() if kept is None else kept).get(key)
    yields = entry.get("yields") if isinstance(entry, dict) else None
    return yields if isinstance(yields, dict) else {}


def keep_rule_yields(key: str, yields: dict[str, Any]) -> None:
    """Keep a pair's yields (dated now) over what was kept for it, and the RULE_YIELDS_KEPT newest pairs."""
    if not yields:
        return
    store = JsonFile(cache_dir() / RULE_YIELDS)
    kept = store.read()
    entry = {"yields": {**rule_yields(key, kept), **yields}, "measured": time.time()}
    store.write(_newest({**kept, key: entry}, RULE_YIELDS_KEPT))


PLAIN_PASSES_KEPT = 16  # a run keeps its stock target's one-token pass time once it ran at least this many


def keep_plain_pass(target: Path, seconds: float, passes: int) -> None:
    """Keep the mean one-token pass of a target decoding plainly in RAM on llama.cpp's own kernels (a run of at least
    PLAIN_PASSES_KEPT passes): the plan's RAM rate is fitted to it (models.planning.measured_rates), where nothing
    else timed this file's passes in RAM here."""
    if passes < PLAIN_PASSES_KEPT or not target.is_file():
        return
    key = pass_times_key(target, "stock", "ram", "None", None, None)
    keep_pass_times(key, {"target_ms": {"1": round(seconds / passes * 1000, 3)}, "passes": passes})


MAPPED, STREAMED = "mapped", "streamed"  # the placements of a streamed target's passes (keep_streamed_pass)


def keep_streamed_pass(target: Path, timing: dict[str, float], threads: int) -> None:
    """Keep a streamed target's one-token passes (offload.window.PassTiming's sums, over at least PLAIN_PASSES_KEPT
    passes on `threads` CPU threads): where it all stayed resident ("mapped") the plan's rate for a streamed target's
    resident part is fitted to them, where part of it streamed ("streamed") the drive's rate during passes
    (models.planning.streamed_rates). One entry of each, the newest."""
    if timing.get("passes", 0) < PLAIN_PASSES_KEPT or threads < 1 or not target.is_file():
        return
    placement = STREAMED if timing.get("streamed_bytes", 0) > 0 else MAPPED
    keep_pass_times(pass_times_key(target, "none", placement, "window", None, None), {**timing, "threads": threads})


def target_entries(target: Path) -> dict[str, Any]:
    """The kept entries of this target file on this machine, whatever drafter and placement timed them."""
    from edge.offload.probe import machine_key

    stat = target.stat()
    prefix = f"{machine_key(target)}|{target.name}|{stat.st_size}|{stat.st_mtime_ns}|"
    return {key: entry for key, entry in pass_times().items() if key.startswith(prefix) and isinstance(entry, dict)}


def measured_at(entry: Any) -> float:
    """When a kept entry was measured (time.time()); 0 for one without a date (the oldest)."""
    value = entry.get("measured") if isinstance(entry, dict) else None
    return float(value) if isinstance(value, int | float) else 0.0


def _newest(entries: dict[str, Any], most: int = PASS_TIMES_KEPT) -> dict[str, Any]:
    """The `most` most recently measured entries."""
    return dict(sorted(entries.items(), key=lambda item: measured_at(item[1]))[-most:])


def corpus_path(target: Path) -> Path:
    """Where lookup keep saves the replies drafted from: in the cache, one file per target file (token ids are its
    vocabulary's)."""
    size = target.stat().st_size if target.is_file() else 0
    return cache_dir() / "lookup" / f"{target.name}-{size}.npy"


def open_corpus(target: Path, mode: str, vocab: int, report: Report = _quiet) -> Corpus | None:
    """The replies lookup drafts from: None with lookup off; empty with on; with keep, those an earlier run saved. The
    file is untrusted input (anyone who could write the cache made it): its header is read first, a file larger than
    a kept corpus can be is not read, and ids outside the target's vocabulary of `vocab` tokens make it damaged. A
    damaged file is said in one line and started over."""
    if mode == "off":
        return None
    path = corpus_path(target)
    if mode != "keep" or not path.is_file():
        return Corpus()
    try:
        return Corpus.from_array(read_tokens(path, vocab))
    except (OSError, ValueError) as problem:
        report(f"lookup keep: {path} cannot be read ({problem}); starting a new one")
        return Corpus()


def read_tokens(path: Path, vocab: int) -> np.ndarray:
    """A saved corpus's token ids, checked before and after reading (ValueError says what is wrong)."""
    with path.open("rb") as file:
        version = np.lib.format.read_magic(file)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f".npy format {version[0]}.{version[1]}, not one this version writes")
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        try:
            shape, _fortran, dtype = read_header(file, max_header_size=1024)
        except Exception as problem:  # numpy parses the header as Python source: SyntaxError, TokenError, ... too
            raise ValueError(f"its header cannot be read: {type(problem).__name__}") from None
        if dtype != np.dtype("<i4") or len(shape) != 1:
            raise ValueError(f"{dtype} array of {len(shape)} dimensions, not int32 tokens")
        if not 0 <= shape[0] <= MAX_FILE_TOKENS:
            raise ValueError(f"{shape[0]} tokens, more than the {MAX_FILE_TOKENS} a kept corpus can hold")
        tokens = np.fromfile(file, dtype=dtype, count=shape[0])
    if len(tokens) != shape[0]:
        raise ValueError(f"{len(tokens)} of its {shape[0]} tokens: the file is truncated")
    if len(tokens) and (tokens.min() < SEPARATOR or tokens.max() >= vocab):
        raise ValueError(f"token ids outside the target's vocabulary of {vocab}")
    return tokens


def save_corpus(corpus: Corpus, target: Path, report: Report = _quiet) -> None:
    """Save the replies for the next run's lookup (written whole, then renamed: a crash leaves the old file). They are
    what clients were told: readable by this user alone, in a folder only this user can list."""
    path = corpus_path(target)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        clean_stale(path.parent)
        partial = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(descriptor, "wb") as file:
                np.save(file, corpus.to_array(), allow_pickle=False)
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
    except OSError as problem:
        report(f"lookup keep: cannot save {path} ({problem.strerror}); this run's replies are not kept")
