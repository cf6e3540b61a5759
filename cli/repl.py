"""The interactive side of `edge-spec chat`: prompts, slash commands, Ctrl-C, piped input."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

from cli.render import error as report_error
from cli.render import note, reply_stats, stats_line, warning
from edge.chat import ChatSession
from edge.errors import UserError
from edge.generate import Stats
from edge.sampling import SamplingConfig

HELP = """commands:
  /help           this help
  /clear          forget the conversation (keeps the system prompt)
  /system TEXT    set the system prompt (and clear the conversation)
  /stats          totals for this session
  /exit           leave (or Ctrl-D)
Ctrl-C stops a reply and keeps the chat. Multi-line input: start and end it with \"\"\", or end lines with \\."""


def run_chat(loaded, sampling: SamplingConfig, system: str | None, max_tokens: int, no_spec: bool,
             err: Console) -> None:
    decoder = loaded.decoder(sampling, speculate=not no_spec)
    session = ChatSession(decoder, loaded.template, loaded.target.tokenizer, system)
    interactive = sys.stdin.isatty()
    if interactive:
        note(f"{loaded.name}: /help for commands, Ctrl-D to leave")
        if loaded.lossless_warning:
            warning(loaded.lossless_warning)
    totals, asked, failed = Stats(), 0, 0
    for text in _inputs(interactive):
        if text.startswith("/"):
            if not _command(text, session, totals, err):
                break
            continue
        asked += 1
        try:
            stats = _reply(session, text, max_tokens, err, interactive)
        except UserError as error:  # e.g. the conversation no longer fits the context
            report_error(str(error))
            failed += 1
            continue
        totals.add(stats)
    if not interactive and asked and failed == asked:  # a script must see that nothing was answered
        raise typer.Exit(1)


def _reply(session: ChatSession, text: str, max_tokens: int, err: Console, interactive: bool) -> Stats:
    with interruptible() as stopped:
        for step in session.send(text, max_tokens, should_stop=stopped):
            sys.stdout.write(step.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    reply_stats(step)
    return step.stats


@contextmanager
def interruptible() -> Iterator:
    """While a prompt is read or a reply streams, Ctrl-C asks it to stop at the next prefill chunk or round instead of
    killing the process (and the chat)."""
    flag = {"stop": False}

    def on_sigint(signum, frame) -> None:
        if flag["stop"]:  # a second Ctrl-C: the user means it now
            raise KeyboardInterrupt
        flag["stop"] = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield lambda: flag["stop"]
    finally:
        signal.signal(signal.SIGINT, previous)


def _inputs(interactive: bool) -> Iterator[str]:
    if not interactive:
        for number, raw in enumerate(sys.stdin.buffer, 1):  # bytes: one undecodable line costs only itself
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                report_error(f"line {number} of standard input is not UTF-8 text; skipped")
                continue
            if line.strip():
                yield line.rstrip("\r\n")
        return
    while True:
        try:
            text = _read_message()
        except EOFError:
            sys.stdout.write("\n")
            return
        except KeyboardInterrupt:
            sys.stdout.write("\n(Ctrl-D or /exit to leave)\n")
            continue
        if text.strip():
            yield text.strip()


def _read_message() -> str:
    """One message: a line, lines ending in a backslash, or a block between triple quotes."""
    first = input(">>> ")
    if first.strip().startswith('"""'):
        lines = [first.strip()[3:]]
        while not lines[-1].rstrip().endswith('"""') or (len(lines) == 1 and first.strip() == '"""'):
            lines.append(input("... "))
        return "\n".join(lines).rstrip()[:-3]
    lines = [first]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(input("... "))
    return "\n".join(lines)


def _command(text: str, session: ChatSession, totals: Stats, err: Console) -> bool:
    """Run a slash command; False means leave."""
    name, _, argument = text.partition(" ")
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name == "/help":
        err.print(HELP, markup=False)
    elif name == "/clear":
        session.clear()
        err.print("[dim]conversation cleared[/]")
    elif name == "/system":
        session.system = argument.strip() or None
        session.clear()
        note = "system prompt set, conversation cleared" if session.system else "system prompt removed"
        err.print(f"[dim]{note}[/]")
    elif name == "/stats":
        err.print(f"[dim]session: {stats_line(totals)}[/]")
    else:
        report_error(f"unknown command {name}; /help lists them")
    return True
