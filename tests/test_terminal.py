"""`edge-spec chat` in a real terminal (tmux): line editing, history across sessions, a pasted block as one message,
/set and /show, as a person at the keyboard uses them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from edge.cli.main import app
from typer.testing import CliRunner

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
STATS = "tokens/pass"


class Terminal:
    """A tmux session of its own (its own server socket) running one command in a 200-column window."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.socket = f"edge-spec-test-{os.getpid()}-{time.monotonic_ns()}"
        line = " ".join(["env", *(f"{k}={v}" for k, v in env.items()), *command, "; echo CHAT-ENDED; sleep 600"])
        self.tmux("new-session", "-d", "-s", "chat", "-x", "200", "-y", "60", line)

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True).stdout

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "chat", *keys)

    def paste(self, text: str) -> None:
        """A paste as a terminal makes it: bracketed, since the program asked for bracketed paste."""
        self.tmux("set-buffer", "-b", "paste", text)
        self.tmux("paste-buffer", "-p", "-b", "paste", "-t", "chat")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-S", "-500", "-t", "chat")

    def wait(self, done: Callable[[str], bool], what: str, timeout: float = 180) -> str:
        deadline, screen = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            try:
                screen = self.screen()
            except subprocess.CalledProcessError:
                raise AssertionError(f"the terminal closed while waiting for {what}; last screen:\n{screen}") from None
            if done(screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"waited {timeout:.0f} s for {what}; the screen:\n{screen}")

    def last_line(self) -> str:
        lines = [line for line in self.screen().splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Callable[[], Terminal]]:
    opened: list[Terminal] = []
    history = tmp_path / "history"

    def open_chat() -> Terminal:
        command = [sys.executable, "-c", "'from edge.cli.main import main; main()'", "chat", "smollm2-135m",
                   "--max-tokens", "24"]
        term = Terminal(command, {"EDGE_SPEC_CHAT_HISTORY": str(history), "TERM": "xterm-256color"})
        opened.append(term)
        term.wait(lambda s: s.rstrip().endswith(">>>"), "the first prompt")
        return term

    yield open_chat
    for term in opened:
        term.close()


def test_chat_in_a_terminal(terminal: Callable[[], Terminal], tmp_path: Path) -> None:
    term = terminal()
    first = term.screen().splitlines()[0]  # where the target runs, and whether trees pay there (tests/test_chat_lines)
    assert re.match(rf"smollm2-135m in RAM, on {os.cpu_count()} cores: trees (do not )?pay here \(", first), first
    term.keys("Say hi.", "Enter")
    screen = term.wait(lambda s: s.count(STATS) == 1 and s.rstrip().endswith(">>>"), "the first reply")
    assert len([line for line in screen.splitlines() if STATS in line]) == 1  # the stats line is one line

    term.keys("Up")  # the line just sent comes back, to edit or send again
    term.wait(lambda s: s.rstrip().endswith(">>> Say hi."), "Up to recall the last message")
    term.keys("C-c")  # Ctrl-C at the prompt drops the line, and the chat goes on
    term.wait(lambda s: s.rstrip().endswith(">>>") and "Ctrl-D or /exit" in s, "Ctrl-C to clear the line")

    term.paste("Here are two lines of a paste.\nReply to both at once.")
    term.wait(lambda s: "... Reply to both at once." in s, "the pasted block in the input")
    term.keys("Enter")
    screen = term.wait(lambda s: s.count(STATS) == 2 and s.rstrip().endswith(">>>"), "the reply to the paste")
    assert screen.count(STATS) == 2  # one reply for two pasted lines
    term.keys("/stats", "Enter")
    term.wait(lambda s: re.search(r"last reply: \d+ rounds \(\d+ with a tree, \d+ plain\) · [\d.]+ tokens a pass · "
                                  r"drafting [\d.]+s \(\d+%\), verifying", s) is not None
              and s.rstrip().endswith(">>>"), "/stats")

    for command, answer in (("/clear", "conversation cleared"), ("/set temperature 0", "greedy (temperature 0)")):
        term.keys(command, "Enter")
        term.wait(lambda s, a=answer: a in s and s.rstrip().endswith(">>>"), command)
    term.keys("/show", "Enter")
    term.wait(lambda s: re.search(r"sampling +greedy", s) is not None and "context    0 of" in s, "/show")
    term.keys("Name three colors.", "Enter")
    screen = term.wait(lambda s: s.count(STATS) == 4 and s.rstrip().endswith(">>>"), "the greedy reply")  # /stats: 1
    reply = screen[screen.rindex(">>> Name three colors.") + len(">>> Name three colors.\n"):]
    reply = reply[: reply.index(STATS)].rsplit("\n", 1)[0]  # up to the stats line
    result = CliRunner().invoke(app, ["generate", "Name three colors.", "--pair", "smollm2-135m", "-n", "24",
                                      "--temperature", "0", "--json"])
    assert reply == json.loads(result.stdout)["text"]
    assert "first token" in screen and "context" in screen  # per-turn stats

    term.keys("C-d")  # leaves; a new chat finds the history
    term.wait(lambda s: "CHAT-ENDED" in s, "Ctrl-D to leave")
    history = tmp_path / "history"  # the terminal fixture's
    assert history.stat().st_mode & 0o777 == 0o600  # what was typed is this user's alone
    again = terminal()
    again.keys("Up")
    again.wait(lambda s: s.rstrip().endswith(">>> Name three colors."), "history from the last session")
