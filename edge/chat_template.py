"""Render a model's chat template (Jinja2, sandboxed) the way llama-cpp-python does."""

from __future__ import annotations

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


def _environment() -> ImmutableSandboxedEnvironment:
    # loopcontrols only lets templates using {% break %} compile; it cannot change any other output.
    env = ImmutableSandboxedEnvironment(
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
                "set a working template for this model in models.toml"
            ) from None
        object.__setattr__(self, "_compiled", compiled)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` ([{"role": ..., "content": ...}]), opening the assistant's turn."""
        try:
            return self._compiled.render(
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
            )
        except _TemplateRaised as error:
            raise UserError(f"the model's chat template refused this conversation: {error}") from None
        except jinja2.TemplateError as error:
            # SecurityError (a sandbox escape attempt) lands here too.
            raise UserError(f"the model's chat template failed: {error}") from None
