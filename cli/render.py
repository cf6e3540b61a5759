"""What the command prints besides replies: progress lines, errors, warnings and the stats line, on stderr, so
that stdout carries only the text (or JSON) a script reads."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from edge.errors import ContextFull, Remedy, UserError
from edge.generate import Stats, Step

err = Console(stderr=True, highlight=False)


def report(message: str) -> None:
    """A progress line from the library (downloads, preparing files, building graphs)."""
    err.print(f"[dim]{escape(message)}[/]", soft_wrap=True)


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
