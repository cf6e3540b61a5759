"""Render a model's chat template (Jinja2, sandboxed) the way llama-cpp-python does."""

from __future__ import annotations

import functools
import re
import threading
import time
import types
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
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
MAX_SECONDS = 2.0  # a render's wall time, on any thread (_Clock)


class _TooBig(Exception):
    pass


class _Render(threading.local):
    """This thread's render: its deadline (time.monotonic()), None between renders."""

    deadline: float | None = None


_RENDER = _Render()


def _check_time() -> None:
    deadline = _RENDER.deadline
    if deadline is not None and time.monotonic() > deadline:
        raise _TooBig(f"it ran for more than {MAX_SECONDS:g} s")


class _Clock(jinja2.ext.Extension):
    """The render's deadline, asked by every loop iteration (and every item a loop's `if` tests) and every call a
    template makes. A template runs only loops, calls and single operations whose size the sandbox bounds, so a
    render stops within one such operation of its deadline, on any thread, with no signal or exception injected from
    outside (an alarm's exception raised inside a gc callback or a __del__ is swallowed there, and the render runs on
    unbounded). The template cannot reach it: it is an extension, not a name it could rebind."""

    @property
    def tick(self) -> bool:  # read, not called: a loop pays an attribute read an iteration, not a sandboxed call
        _check_time()
        return True


_WIDTH = re.compile(r"\d+")
_PADDING = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})  # str methods that pad to a width


def _check_widths(form: str) -> None:
    """A format string ('%50000000d', '{:50000000}') whose numbers ask for a value no chat needs."""
    for number in _WIDTH.findall(form):
        if len(number) > 9 or int(number) > MAX_OUTPUT:
            raise _TooBig(f"it formats a value {number} characters wide")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*`, `**`, `%`, the padding methods and format strings unable to build values no
    chat needs ('x' * 10**14, 'a'.center(50000000), '%50000000d' % 1)."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """The parsed template, with the clock asked at the top of every loop body and before every item a loop's
        `if` tests."""
        template = super()._parse(source, name, filename)
        for loop in list(template.find_all(nodes.For)):
            loop.body.insert(0, nodes.ExprStmt(self._tick(loop.lineno), lineno=loop.lineno))
            if loop.test is not None:
                loop.test = nodes.And(self._tick(loop.lineno), loop.test, lineno=loop.lineno)
        template.set_environment(self)
        return template

    @staticmethod
    def _tick(lineno: int) -> nodes.ExtensionAttribute:
        return nodes.ExtensionAttribute(_Clock.identifier, "tick", lineno=lineno)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_time()  # macro calls recurse: each asks the clock
        method = __obj.__wrapped__ if isinstance(__obj, functools.partial | types.FunctionType) and \
            "__wrapped__" in vars(__obj) else __obj  # the sandbox wraps str.format in a function
        owner = method.__self__ if isinstance(method, types.BuiltinMethodType) else None
        if isinstance(owner, str):
            name = method.__name__
            if name in _PADDING and any(isinstance(a, int) and a > MAX_OUTPUT for a in (*args, *kwargs.values())):
                raise _TooBig(f"it pads a string to more than {MAX_OUTPUT:,} characters")
            if name in ("format", "format_map"):
                _check_widths(owner)
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: object, right: object) -> object:
        if operator == "%" and isinstance(left, str):
            _check_widths(left)
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


def _environment() -> ImmutableSandboxedEnvironment:
    # loopcontrols only lets templates using {% break %} compile; it cannot change any other output.
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Clock]
    )
    format_filter = env.filters["format"]

    def bounded_format(value: Any, *args: Any, **kwargs: Any) -> Any:  # the `format` filter: `value % args`
        if isinstance(value, str):
            _check_widths(value)
        return format_filter(value, *args, **kwargs)

    env.filters["format"] = bounded_format
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
                "complete raw text instead (raw)", "raw"
            ) from None
        object.__setattr__(self, "_compiled", compiled)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` ([{"role": ..., "content": ...}]), opening the assistant's turn."""
        pieces, written = [], 0
        _RENDER.deadline = time.monotonic() + MAX_SECONDS
        try:
            for piece in self._compiled.generate(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
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
            raise UserError(f"the model's chat template was stopped: {what}; complete raw text instead (raw)",
                            "raw") from None
        except jinja2.TemplateError as error:
            # SecurityError (a sandbox escape attempt) lands here too.
            raise UserError(f"the model's chat template failed: {error}") from None
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as error:
            # the template's own expressions ({{ 1/0 }}, an index past a list's end): the template's fault, in one line
            raise UserError(f"the model's chat template failed: {type(error).__name__}: {error}; complete raw text "
                            "instead (raw)", "raw") from None
        finally:
            _RENDER.deadline = None
