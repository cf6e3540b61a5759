"""What the command prints besides replies: progress lines, errors, warnings and the stats line, on stderr, so
that stdout carries only the text (or JSON) a script reads."""

from __future__ import annotations

import time
from collections import deque
from datetime import timedelta
from typing import Any

from edge.models.pypi import DownloadReporter
from rich.console import Console, Group, RenderableType
from rich.filesize import decimal
from rich.markup import escape

from edge.errors import ContextFull, Remedy, UserError
from edge.generate import Stats, Step

err = Console(stderr=True, highlight=False)


def report(message: str) -> None:
    """A progress line from the library (downloads, preparing files, building graphs)."""
    err.print(f"[dim]{escape(message)}[/]", soft_wrap=True)


SPEED_WINDOW_S = 5.0  # a download's speed: its bytes over the last few seconds


class Working(DownloadReporter):
    """A step under way, on a terminal: a spinner saying the step at hand, and above it a row for each download
    (its file, bar, bytes, speed, time left). As the library's reporter (models/sources.py Report), a progress line is
    printed and moves the spinner to it; `download` draws the rows. Shown in a rich Live."""

    def __init__(self, what: str):
        from rich import progress
        from rich.spinner import Spinner

        self.spinner = Spinner("dots", text=escape(what), style="status.spinner")
        self.downloads = progress.Progress(
            progress.TextColumn("{task.description}"), progress.BarColumn(), progress.DownloadColumn(),
            progress.TextColumn("{task.fields[speed]}", style="progress.data.speed"),
            progress.TextColumn("{task.fields[left]}", style="progress.remaining"), console=err)
        self.rows: dict[str, progress.TaskID] = {}
        self.seen: dict[str, deque[tuple[float, int]]] = {}  # each download's (time, bytes done) of the last seconds

    def __call__(self, message: str) -> None:
        report(message)
        self.spinner.update(text=escape(message))

    def download(self, name: str, done: int, total: int | None, finished: bool) -> None:
        """A download's row: its bytes so far of `total` (None: not known yet); gone once `finished` (the library's
        next line says how it went)."""
        if finished:
            if name in self.rows:
                self.downloads.remove_task(self.rows.pop(name))
                del self.seen[name]
            return
        speed, left = self._pace(name, done, total)
        if name not in self.rows:
            self.rows[name] = self.downloads.add_task(escape(name), total=total, speed=speed, left=left)
        self.downloads.update(self.rows[name], completed=done, total=total, speed=speed, left=left)

    def _pace(self, name: str, done: int, total: int | None) -> tuple[str, str]:
        """The download's speed over the last seconds, and the time left at that speed, as text. Not rich's own
        columns: they start over whenever the total changes, and a download of many wheels has a total that is an
        estimate until pip has named them all."""
        now = time.monotonic()
        seen = self.seen.setdefault(name, deque())
        seen.append((now, done))
        while now - seen[0][0] > SPEED_WINDOW_S:
            seen.popleft()
        then, before = seen[0]
        if now - then < 0.5 or done == before:
            return "?", "-:--:--"
        speed = (done - before) / (now - then)
        left = "-:--:--" if total is None else str(timedelta(seconds=round((total - done) / speed)))
        return f"{decimal(round(speed))}/s", left

    def __rich__(self) -> RenderableType:
        parts: list[Any] = [self.downloads] if self.rows else []
        return Group(*parts, self.spinner)


def error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


FLAGS = {"models_file": "--models"}  # library options whose flag is not their name


def flag(option: str) -> str:
    """The command line's name for a library option: max_tokens -> --max-tokens."""
    return FLAGS.get(option) or "--" + option.replace("_", "-")


def worded(problem: UserError, in_chat: bool = False) -> str:
    """A library error in the command line's words: its option as a flag (in a chat, as /set names it: the library's
    own name), its remedy as the command to run, and for a prompt that does not fit, what to do here."""
    if isinstance(problem, ContextFull):
        return f"{problem}: shorten it, {'/clear the chat, ' if in_chat else ''}or raise --ctx"
    text = str(problem) if in_chat else problem.worded(flag)
    return text if problem.remedy is None else f"{text}: `{command(problem.remedy)}`"


def command(remedy: Remedy) -> str:
    """The command line that runs `remedy`: Remedy("prepare", "gemma3-270m", (("vocab", 16384),)) ->
    edge-spec prepare gemma3-270m --vocab 16384."""
    words = ["edge-spec", remedy.task, *([remedy.on] if remedy.on else [])]
    for option, value in remedy.options:
        words += [flag(option), *([] if value is None else [str(value)])]
    return " ".join(words)


def warning(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def note(message: str) -> None:
    err.print(f"[dim]{escape(message)}[/]", soft_wrap=True)


def reply_stats(step: Step) -> None:
    """The line under a reply: its stats, and whether Ctrl-C cut it short."""
    note = " (interrupted)" if step.finish_reason == "interrupted" else ""
    err.print(f"[dim]{stats_line(step.stats)}{note}[/]", soft_wrap=True)


def stats_line(stats: Stats) -> str:
    """One reply's (or a session's) figures: the one way edge-spec renders Stats as text."""
    return (f"{stats.new_tokens} tokens · {stats.tokens_per_s:.1f} tok/s · {stats.tokens_per_pass:.2f} tokens/pass · "
            f"draft {stats.draft_s:.2f}s · verify {stats.verify_s:.2f}s · {stats.target_passes} target passes"
            + (f" · {stats.lookup_rounds} by lookup" if stats.lookup_rounds else ""))


def rounds_line(stats: Stats) -> str:
    """How a reply's rounds went: with a tree or without, the tokens each target pass gave, and where the time went
    (drafting, verifying, the prompt's prefill)."""
    trees = stats.rounds - stats.plain_rounds
    kinds = [f"{trees} with a tree" + (f" ({stats.lookup_rounds} by lookup)" if stats.lookup_rounds else ""),
             f"{stats.plain_rounds} plain"]
    spent = stats.draft_s + stats.verify_s + stats.prefill_s
    share = (lambda s: f" ({100 * s / spent:.0f}%)") if spent else (lambda s: "")
    return (f"{stats.rounds} rounds ({', '.join(kinds)}) · {stats.tokens_per_pass:.2f} tokens a pass · "
            f"drafting {stats.draft_s:.2f}s{share(stats.draft_s)}, verifying {stats.verify_s:.2f}s"
            f"{share(stats.verify_s)}, prompt {stats.prefill_s:.2f}s{share(stats.prefill_s)}")
