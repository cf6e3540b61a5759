"""Model files are mapped into memory, not read: a file truncated under a running process (`cp new.gguf live.gguf`
writes the same inode) makes the next read of a lost page a bus error (SIGBUS), which kills the process with no
word. Here a SIGBUS handler says which file changed, in one line, and exits with 135 as a shell reports a SIGBUS.

The handler is native code's callback (ctypes): it runs on whichever thread touched the page, llama.cpp's workers
included, takes the interpreter's lock, writes its line and ends the process at once (it cannot resume: the read
would fault again). The checks before each generation (Pair.check_open) catch most changes first; this is for a
change that lands mid-pass. Where the platform has no SIGBUS, or ctypes cannot reach libc, nothing is installed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

from edge.models.cache import file_stamp

# what a shell reports for a process killed by SIGBUS (135 on Linux)
EXIT_BUS_ERROR = 128 + int(signal.Signals["SIGBUS"]) if "SIGBUS" in signal.Signals.__members__ else 135

_watched: dict[Path, tuple[int, ...]] = {}
_users: dict[Path, int] = {}  # how many loaded models map each file
_lock = threading.Lock()
_installed: list[object] = []  # the callback, kept alive while it is the handler
_said: list[bool] = []  # the line was written (by the first thread to fault)


def watch(path: Path) -> None:
    """Name `path` in the line a bus error prints if it changes on disk (call once it is mapped)."""
    with _lock, contextlib.suppress(OSError):
        _watched[Path(path)] = file_stamp(path)[:3]
        _users[Path(path)] = _users.get(Path(path), 0) + 1
    _install()


def forget(path: Path) -> None:
    """A model mapping `path` was closed."""
    with _lock:
        _users[Path(path)] = _users.get(Path(path), 1) - 1
        if _users[Path(path)] <= 0:
            _watched.pop(Path(path), None)
            _users.pop(Path(path), None)


def bus_error_line() -> str:
    """What a bus error means here: the watched files that changed on disk since they were mapped, else a read
    that failed (a drive or network share that went away)."""
    changed = []
    for path, stamp in list(_watched.items()):
        try:
            now: tuple[int, ...] | None = file_stamp(path)[:3]
        except OSError:
            now = None
        if now != stamp:
            changed.append(path)
    if changed:
        return (f"edge-spec: {changed[0]} changed on disk while it was in use (replaced in place or truncated, as "
                "`cp new.gguf live.gguf` does): restart the command; to swap a model under a server, write the new "
                "file beside it and rename it over the old one (mv)")
    return ("edge-spec: a model file could not be read from its mapping (bus error: the drive or share holding it "
            "went away, or the file shrank): check the drive and restart the command")


def _on_bus_error(_signum: int) -> None:
    if _said:  # another thread faulted first (llama.cpp's workers read the same pages): it ends the process
        while True:
            time.sleep(1)
    _said.append(True)
    try:
        os.write(2, (bus_error_line() + "\n").encode("utf-8", "replace"))
    finally:
        os._exit(EXIT_BUS_ERROR)


def _install() -> None:
    if _installed or sys.platform not in ("linux", "darwin") or "SIGBUS" not in signal.Signals.__members__:
        return
    try:
        libc = ctypes.CDLL(None)
        handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
        callback = handler_type(_on_bus_error)
        libc.signal.argtypes = (ctypes.c_int, handler_type)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(int(signal.Signals["SIGBUS"]), callback)
    except (OSError, AttributeError):  # no libc to reach: the process dies of SIGBUS as before
        return
    _installed.append(callback)
