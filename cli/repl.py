"""The interactive side of `edge-spec chat`: line editing and history (prompt_toolkit), slash commands, Ctrl-C,
piped input."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import typer
from edge.cli.options import MAX_INPUT_BYTES
from edge.cli.render import error as report_error
from edge.cli.render import note, rounds_line, stats_line, warning, worded
from rich.console import Console

from edge.chat import ChatSession
from edge.errors import UserError
from edge.generate import Stats, Step
from edge.options import check_max_tokens, parse_budget
from edge.sampling import SamplingConfig, chat_defaults

HELP = """commands:
  /help             this help
  /show             the pair, placement, drafter, tree budget and sampling in force
  /set NAME VALUE   change a setting: temperature, top_k, top_p, min_p, repeat_penalty, presence_penalty,
                    frequency_penalty, seed (a number, or none), budget (draft nodes, or auto), max_tokens
  /clear            forget the conversation (keeps the system prompt)
  /system TEXT      set the system prompt (and clear the conversation)
  /stats            the last reply's rounds, tokens a pass and time (drafting, verifying), and the session's totals
  /exit             leave (or Ctrl-D)
Up and Down recall earlier messages (kept across sessions). Ctrl-C clears the line, or stops a reply and keeps the
chat. Pasted text is one message, however many lines. Multi-line input: start and end it with \"\"\", or end lines
with \\."""

SAMPLING_FIELDS = {"temperature": float, "temp": float, "top_k": int, "top_p": float, "min_p": float,
                   "repeat_penalty": float, "presence_penalty": float, "frequency_penalty": float, "seed": int}
HISTORY_FILE = "chat-history"


@dataclass
class Chat:
    """A chat's settings and conversation: what /set changes and /show says."""

    loaded: object  # models.pair.Pair
    session: ChatSession
    sampling: SamplingConfig
    budget: int | str | None
    speculate: bool
    max_tokens: int
    penalty_chosen: bool = False  # the user set the repetition penalty (else greedy means generate's plain argmax)
    last: Stats | None = None  # the last reply's figures (/stats)

    def set(self, name: str, value: str) -> str:
        """Apply `/set name value`; returns what changed, in words. Raises UserError for a bad name or value."""
        name = name.replace("-", "_").lower()
        if name in SAMPLING_FIELDS:
            field = "temperature" if name == "temp" else name
            parsed = None if field == "seed" and value.lower() == "none" else _number(value, SAMPLING_FIELDS[name])
            changes = {field: parsed}
            if field == "repeat_penalty":
                self.penalty_chosen = True
            elif field == "temperature" and not self.penalty_chosen:  # greedy is generate's greedy; sampling, chat's
                changes["repeat_penalty"] = greedy_penalty(parsed, chat_defaults(self.loaded.sampling,
                                                                                 self.loaded.recommended).repeat_penalty)
            self.sampling = dataclasses.replace(self.sampling, **changes)
            self.session.decoder.set_sampling(self.sampling)
            return f"sampling: {self.sampling.described()}"
        if name == "budget":
            self.budget = parse_budget(value)
            if not self.speculate:
                return f"budget {self.budget} (it applies once speculation is on: this chat runs --no-spec)"
            self.session.decoder = self.loaded.decoder(self.sampling, True, self.budget)
            return f"tree budget: {self.budget}"
        if name in ("max_tokens", "n"):
            tokens = check_max_tokens(_number(value, int))
            self.max_tokens = tokens
            return f"at most {tokens} tokens per reply"
        raise UserError(f"/set does not know {name!r}: temperature, top_k, top_p, min_p, repeat_penalty, "
                        "presence_penalty, frequency_penalty, seed, budget, max_tokens")

    def show(self) -> str:
        loaded = self.loaded
        drafter = loaded.drafter
        if not self.speculate or drafter is None:
            drafting = "none (the target decodes alone)"
        else:
            drafting = f"{loaded.spec.drafter.source.describe()} on {drafter.runtime}"
            drafting += f", {drafter.vocab}-token head" if getattr(drafter, "vocab", None) else ""
        budget = self.budget if self.budget is not None else loaded.budget
        used = len(self.session.decoder.context)
        return "\n".join([
            f"pair       {loaded.name}: target {loaded.spec.target.source.describe()}",
            f"placement  {loaded.placement}" + (" (larger than RAM: read from its file)" if loaded.streamed else ""),
            f"drafter    {drafting}",
            f"budget     {budget if self.speculate else 'off (--no-spec)'}",
            f"sampling   {self.sampling.described()}",
            f"accept     {self._accept_rule()}",
            f"replies    at most {self.max_tokens} tokens",
            f"context    {used} of {loaded.target.n_ctx} tokens used",
        ])

    def _accept_rule(self) -> str:
        """The acceptance rule in force."""
        rule = self.loaded.options.accept
        if not self.speculate:
            return "off (--no-spec)"
        if self.sampling.greedy:
            return f"{rule} (greedy: sample-and-match)"
        if rule == "auto":  # what each candidate has yielded so far, by which auto chooses
            return f"auto ({self.session.decoder.rounds.choice.described()})"
        return rule


def opening_line(loaded, speculate: bool) -> str:
    """The chat's first line: where the target runs, and whether trees pay there and why (the plan's predictions)."""
    return f"{loaded.name} {_where(loaded)}: {_trees(loaded, speculate)}"


def _where(loaded) -> str:
    gpu_layers = loaded.options.gpu_layers or 0
    cores = loaded.options.threads or os.cpu_count() or 1
    if loaded.options.placement == "ssd":
        where = "read from the drive every pass (--placement ssd)"
    elif loaded.streamed:
        resident, streamed = loaded.residency() or (0, loaded.target.path.stat().st_size)
        where = (f"larger than free RAM: {resident / 2**30:.2f} GiB of it kept in RAM, {streamed / 2**30:.2f} GiB read "
                 "from the drive every pass")
    else:
        where = "in RAM"
    return where + (f", {gpu_layers} target layers on the GPU" if gpu_layers else f", on {cores} cores")


def _trees(loaded, speculate: bool) -> str:
    rates = loaded.plan_rates
    if not speculate:
        return "speculation off (--no-spec), the target decodes alone"
    if loaded.plan_use == "plain" and "drafter" in rates:
        hint = "; a model larger than memory, or --placement ssd, shows what they do" \
            if loaded.placement == "ram" and not loaded.options.gpu_layers else ""
        return (f"trees do not pay here (plain decoding {rates['plain']:.3g} tokens/s predicted, the drafter's trees "
                f"{rates['drafter']:.3g}): decoding plainly{hint}")
    if loaded.plan_use == "lookup" and "drafter" in rates:
        return (f"the drafter's memory goes to the target (lookup drafting {rates['lookup']:.3g} tokens/s predicted, "
                f"the drafter's trees {rates['drafter']:.3g}): drafting from earlier text alone")
    if loaded.plan_use == "drafter" and "plain" in rates:
        return (f"trees pay here (the drafter's trees {rates['drafter']:.3g} tokens/s predicted, plain decoding "
                f"{rates['plain']:.3g}): each pass checks a tree of guesses")
    if loaded.drafter is None:
        return "no drafter model: " + ("drafting from earlier text (lookup)" if loaded.corpus is not None
                                       else "the target decodes alone")
    if loaded.budget == "auto":
        return "trees sized round by round from measured pass times (--budget auto), none where they do not pay"
    return f"trees of {loaded.budget} draft nodes every round (--budget {loaded.budget})"


def greedy_penalty(temperature: float | None, default: float) -> float:
    """The repetition penalty that goes with a temperature the user chose without choosing a penalty: none when
    greedy (temperature 0 gives `generate`'s text), else the chat default that keeps small models from looping."""
    return 1.0 if temperature == 0 else default


def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise UserError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None


def run_chat(loaded, sampling: SamplingConfig, system: str | None, max_tokens: int, no_spec: bool,
             err: Console, history: Path | None = None, penalty_chosen: bool = False) -> None:
    decoder = loaded.decoder(sampling, speculate=not no_spec)
    chat = Chat(loaded, ChatSession(decoder, loaded.template, loaded.target.tokenizer, system), sampling, None,
                not no_spec, max_tokens, penalty_chosen)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if interactive:
        note(opening_line(loaded, not no_spec))
        note(f"{sampling.described()} · /help for commands, Ctrl-D to leave")
        if loaded.lossless_warning:
            warning(loaded.lossless_warning)
    totals, asked, failed = Stats(), 0, 0
    for text in (_terminal_inputs(history) if interactive else _piped_inputs()):
        if text.startswith("/"):
            if not _command(text, chat, totals, err):
                break
            continue
        asked += 1
        try:
            stats = _reply(chat, text)
        except UserError as error:  # e.g. the conversation no longer fits the context
            report_error(worded(error, in_chat=True))
            failed += 1
            continue
        totals.add(stats)
        chat.last = stats
    if not interactive and asked and failed == asked:  # a script must see that nothing was answered
        raise typer.Exit(1)


def _reply(chat: Chat, text: str) -> Stats:
    started, first = time.perf_counter(), None
    with interruptible() as stopped:
        for step in chat.session.send(text, chat.max_tokens, should_stop=stopped):
            if first is None and step.token is not None:
                first = time.perf_counter() - started
            sys.stdout.write(step.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    _turn_stats(chat, step, first)
    return step.stats


def _turn_stats(chat: Chat, step: Step, first_token_s: float | None) -> None:
    """The line under a reply: its stats, the time to its first token (the prompt's prefill and a first round), the
    context used, and whether Ctrl-C cut it short."""
    from edge.cli.render import err

    extra = f" · first token {first_token_s:.2f}s" if first_token_s is not None else ""
    extra += f" · context {len(chat.session.decoder.context)}/{chat.loaded.target.n_ctx}"
    extra += " (interrupted)" if step.finish_reason == "interrupted" else ""
    err.print(f"[dim]{stats_line(step.stats)}{extra}[/]", soft_wrap=True)


@contextmanager
def interruptible() -> Iterator:
    """While a prompt is read or a reply streams, Ctrl-C asks it to stop at the next prefill chunk or token instead
    of killing the process (and the chat)."""
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


def _piped_inputs() -> Iterator[str]:
    number = 0
    while raw := sys.stdin.buffer.readline(MAX_INPUT_BYTES + 1):  # bytes: one undecodable line costs only itself
        number += 1
        if len(raw) > MAX_INPUT_BYTES and not raw.endswith(b"\n"):  # /dev/zero has no end of line
            report_error(f"line {number} of standard input is longer than {MAX_INPUT_BYTES >> 20} MiB; the chat "
                         "stops here")
            return
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            report_error(f"line {number} of standard input is not UTF-8 text; skipped")
            continue
        if line.strip():
            yield line.rstrip("\r\n")


def _terminal_inputs(history: Path | None) -> Iterator[str]:
    """Messages typed at the terminal, with prompt_toolkit's line editing: arrows, history across sessions (in the
    cache folder), a paste of many lines as one message (bracketed paste), and multi-line input by \"\"\" or \\."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    class QuietFileHistory(FileHistory):
        def store_string(self, string: str) -> None:  # a read-only cache folder costs the history, not the chat
            with suppress(OSError):
                super().store_string(string)

    bindings = KeyBindings()

    @bindings.add("enter")
    def _(event) -> None:
        buffer = event.current_buffer
        if buffer.text.endswith("\\") and buffer.cursor_position == len(buffer.text):
            buffer.delete_before_cursor(1)
            buffer.insert_text("\n")
        elif _open_block(buffer.text):
            buffer.insert_text("\n")
        else:
            buffer.validate_and_handle()

    store = InMemoryHistory()
    if history is not None:
        with suppress(OSError):
            history.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(history, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))  # what was typed: this user's
            history.chmod(0o600)
            store = QuietFileHistory(str(history))
    session = PromptSession(history=store, key_bindings=bindings, multiline=True,
                            prompt_continuation=lambda width, line, wrap: "... ".rjust(width))
    while True:
        try:
            text = session.prompt(">>> ")
        except EOFError:  # Ctrl-D
            return
        except KeyboardInterrupt:  # Ctrl-C at the prompt: the line is dropped
            sys.stderr.write("(Ctrl-D or /exit to leave)\n")
            continue
        text = text.strip()
        if text.startswith('"""'):
            text = text[3:-3] if text.endswith('"""') and len(text) >= 6 else text[3:]
        if text.strip():
            yield text.strip()


def _open_block(text: str) -> bool:
    """A \"\"\" block begun and not yet closed: Enter adds a line."""
    stripped = text.strip()
    return stripped.startswith('"""') and (len(stripped) < 6 or not stripped.endswith('"""'))


def _command(text: str, chat: Chat, totals: Stats, err: Console) -> bool:
    """Run a slash command; False means leave."""
    name, _, argument = text.partition(" ")
    session = chat.session
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name in ("/help", "/?"):
        err.print(HELP, markup=False)
    elif name == "/show":
        err.print(chat.show(), markup=False, highlight=False)
    elif name == "/set":
        setting, _, value = argument.strip().partition(" ")
        if not setting or not value.strip():
            report_error("/set takes a name and a value, e.g. /set temperature 0.7 (/help lists the names)")
            return True
        try:
            note(chat.set(setting, value.strip()))
        except UserError as problem:
            report_error(worded(problem, in_chat=True))
    elif name == "/clear":
        session.clear()
        err.print("[dim]conversation cleared[/]")
    elif name == "/system":
        session.system = argument.strip() or None
        session.clear()
        said = "system prompt set, conversation cleared" if session.system else "system prompt removed"
        err.print(f"[dim]{said}[/]")
    elif name == "/stats":
        if chat.last is not None:
            err.print(f"[dim]last reply: {rounds_line(chat.last)}[/]", soft_wrap=True)
        err.print(f"[dim]session: {stats_line(totals)}[/]", soft_wrap=True)
    else:
        report_error(f"unknown command {name}; /help lists them")
    return True
