"""edge-spec's cache folder and the way files are written into it: atomically, so a reader never sees half a file."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from edge.errors import UserError

_CHUNK = 1 << 20


def cache_dir() -> Path:
    """edge-spec's own cache: $EDGE_SPEC_CACHE, else $XDG_CACHE_HOME/edge-spec, else ~/.cache/edge-spec. A path that
    is there but not a folder (a file, /dev/null) is refused in one line."""
    if os.environ.get("EDGE_SPEC_CACHE"):
        folder = Path(os.environ["EDGE_SPEC_CACHE"]).expanduser()
    else:
        folder = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "edge-spec"
    if os.path.lexists(folder) and not folder.is_dir():
        raise UserError(f"the cache {folder} is not a folder; set EDGE_SPEC_CACHE to a folder edge-spec may write "
                        "to (or unset it)")
    return folder


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_stamp(path: Path) -> tuple[int, int, int, int]:
    """What tells one state of a file from another without reading it: size, mtime, inode and ctime. The ctime is
    set by every write and by every change of the mtime, so an edit with its mtime put back still shows; it is also
    set by a chmod or a new hard link, so a check that must not refuse a file for those (a loaded pair's) compares the
    first three only, and a sha256 stamp that sees a new ctime just hashes the file again."""
    stat = Path(path).stat()
    return stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns


@contextmanager
def atomic_path(dest: Path, size: int = 0) -> Iterator[Path]:
    """Yield a temporary path beside `dest`: renamed to `dest` if the block succeeds, removed otherwise. With the
    `size` in bytes the file will take, refused first where the drive has not that much free; a drive that fills
    up anyway ends in one line naming the path."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create {dest.parent}: {error.strerror}; set EDGE_SPEC_CACHE to a writable "
                        "folder") from None
    ensure_space(dest, size)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        _sync(tmp)
        os.replace(tmp, dest)
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        raise UserError(f"the drive filled up writing {dest}; free some space (or set EDGE_SPEC_CACHE to another "
                        "drive) and run again") from None
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def one_at_a_time(key: str, report: Callable[[str], None]) -> Iterator[None]:
    """Hold the cache's lock for `key` (a model's source) through the block: a second process that fetches or
    prepares the same model (a `serve` and a `chat` started together on a new machine, two test workers) waits for
    the first, saying so once, then finds the file there, where it would have downloaded and written the same
    gigabytes beside it. A cache that cannot hold the lock file (read-only) runs the block unlocked."""
    from filelock import FileLock, Timeout

    folder = cache_dir() / "locks"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", key)[-80:] + "-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    lock = FileLock(folder / f"{name}.lock")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            report(f"waiting for another edge-spec process, which is preparing {key}")
            lock.acquire()
    except OSError:
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _sync(path: Path) -> None:
    """Write the file's pages to the drive before it takes its name: a crash after the rename leaves the whole file
    or none, and its pages are clean, so a streamed model's eviction (posix_fadvise DONTNEED, which leaves dirty
    pages) drops them from its first pass on."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_space(dest: Path, size: int) -> None:
    """Refuse, in one line, to write `size` bytes to `dest` on a drive with less free (and a 1% margin)."""
    if size <= 0:
        return
    folder = dest.parent
    while not folder.exists() and folder != folder.parent:  # the drive it will be on
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # the write itself will tell
    if free < size * 1.01:
        raise UserError(f"{dest.name} needs {size / 1e9:.2f} GB but {folder} has {free / 1e9:.2f} GB free; "
                        "free some space, or set EDGE_SPEC_CACHE to another drive")


STALE_AFTER_S = 24 * 3600  # a temporary whose process still seems alive is someone else's after this long
_TEMPORARY = re.compile(r"^(?:.+\.tmp-(?P<pid>\d+)|\.pip-(?P<pip>\d+)-.*)$")


def clean_stale(folder: Path) -> list[Path]:
    """Remove what killed runs left in `folder`: a file or folder named `NAME.tmp-PID` (atomic_path, graph builds)
    or `.pip-PID-...` (downloads) whose process is gone, or which is older than STALE_AFTER_S (its PID reused).
    Returns what was removed; what cannot be removed (a read-only cache) is left."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _TEMPORARY.match(entry.name)
        if match is None:
            continue
        pid = int(match["pid"] or match["pip"])
        try:
            old = time.time() - entry.lstat().st_mtime > STALE_AFTER_S
        except OSError:
            continue
        if pid == os.getpid() or (_alive(pid) and not old):
            continue
        with suppress(OSError):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def read_json(path: Path) -> dict:
    """A JSON object cached on disk; {} when the file is missing, damaged (nested past the parser's depth too) or not
    an object: what it held is measured again."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: dict) -> None:
    """Write a JSON object atomically (a reader never sees half a file)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1))


class JsonFile:
    """A JSON object kept in a file (offload.probe.JsonStore): what a measurement stores between runs. A cache on
    a read-only or full drive keeps nothing new: the measurement is used, and made again next time."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> dict:
        return read_json(self.path)

    def write(self, data: dict) -> None:
        with suppress(OSError):
            write_json(self.path, data)
