"""`edge-spec serve` in a child process, for the tests and the soak benchmark: started on a free port, ready once it
says so, its log kept, stopped with SIGINT as Ctrl-C would."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from edge.errors import UserError

READY = re.compile(r"serving .* at (http://\S+)/v1")


class ServerProcess:
    def __init__(self, args: Sequence[str], timeout: float = 300.0, cwd: Path | None = None,
                 wrapper: Sequence[str] = ()):
        """Start `edge-spec serve ARGS --port 0` (after `wrapper`: a command that execs the rest, such as one that
        enters a memory cgroup) and wait (up to `timeout` s) until it serves."""
        # Ctrl-C as a terminal delivers it, even from a suite started in the background (a non-interactive shell
        # starts `cmd &` with SIGINT ignored, and the child would inherit that: it would stop but exit 0, not 130)
        command = [*wrapper, sys.executable, "-c", "import signal; signal.signal(signal.SIGINT, "
                   "signal.default_int_handler); from edge.cli.main import main; main()", "serve", *args, "--port", "0"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        cwd=cwd)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read_log, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise UserError(f"edge-spec serve did not start: {self.log[-2000:]}")

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def faults(self) -> dict[str, int]:
        """What the log says went wrong on the server's side: tracebacks and 500s (a client's fault writes neither)."""
        log = self.log
        return {"log_tracebacks": log.count("Traceback"), "log_500s": log.count('" 500')}

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            found = READY.search(line)
            if found and not self._ready.is_set():
                self.url = found.group(1)
                self._ready.set()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGINT (Ctrl-C), then SIGKILL if it has not ended within `timeout`; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
