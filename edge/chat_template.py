"""Render a model's chat template (Jinja2, sandboxed) the way llama-cpp-python does."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edge.errors import UserError


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself, e.g. for a role it does not support."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(format_string: str = "%Y-%m-%d %H:%M:%S") -> str:
    return datetime.now().strftime(format_string)


# A template comes with a model file, from anyone: what one render may cost is bounded. Real chat templates loop over
# the messages and write their text once; these bounds are orders of magnitude above that.
MAX_OUTPUT = 4 << 20  # characters a render may write (and a string or list that `*` may build)
MAX_STEPS = 2_000_000  # items that range() may produce in one render, all loops together
MAX_SECONDS = 2.0  # a render's wall time, where a timer can be set (the main thread)


class _TooBig(Exception):
    pass


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*` and `**` unable to build values no chat needs ('x' * 10**14)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: object, right: object) -> object:
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, str | list | tuple) and isinstance(count, int) \
                        and len(sequence) * count > MAX_OUTPUT:
                    raise _TooBig(f"it builds a value of {len(sequence) * count:,} items")
        if operator == "**" and isinstance(right, int | float) and abs(right) > 1024:
            raise _TooBig(f"it raises to the power {right}")
        return super().call_binop(context, operator, left, right)


class _Steps:
    """range() for one render, counting what all its loops iterate against MAX_STEPS."""

    def __init__(self) -> None:
        self.left = MAX_STEPS

    def range(self, *args: int) -> range:
        items = range(*args)
        self.left -= len(items)
        if self.left < 0:
            raise _TooBig(f"its loops run more than {MAX_STEPS:,} steps")
        return items


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Stop the block after `seconds` (SIGALRM), where a timer can be set: the main thread; elsewhere the step and
    size bounds alone hold a template in."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise _TooBig(f"it ran for more than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _environment() -> ImmutableSandboxedEnvironment:
    # loopcontrols only lets templates using {% break %} compile; it cannot change any other output.
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str
    eos_token: str
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as error:
            raise UserError(
                f"the model's chat template has a syntax error (line {error.lineno}: {error.message}); "
                "complete raw text instead (--raw, or raw=True in Python)"
            ) from None
        object.__setattr__(self, "_compiled", compiled)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` ([{"role": ..., "content": ...}]), opening the assistant's turn."""
        pieces, written = [], 0
        try:
            with _time_limit(MAX_SECONDS):
                for piece in self._compiled.generate(messages=messages, bos_token=self.bos_token,
                                                     eos_token=self.eos_token,
                                                     add_generation_prompt=add_generation_prompt, range=_Steps().range):
                    written += len(piece)
                    if written > MAX_OUTPUT:
                        raise _TooBig(f"it writes more than {MAX_OUTPUT:,} characters")
                    pieces.append(piece)
            return "".join(pieces)
        except _TemplateRaised as error:
            raise UserError(f"the model's chat template refused this conversation: {error}") from None
        except (_TooBig, RecursionError, MemoryError) as error:
            what = {RecursionError: "it recurses without end", MemoryError: "it needs more memory than there is"}.get(
                type(error), str(error))
            raise UserError(f"the model's chat template was stopped: {what}; complete raw text instead "
                            "(--raw, or raw=True in Python)") from None
        except jinja2.TemplateError as error:
            # SecurityError (a sandbox escape attempt) lands here too.
            raise UserError(f"the model's chat template failed: {error}") from None
