"""Errors a user can cause, said in the library's own terms; each front end words them its own way (cli/, serve/)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Remedy:
    """What the user can run to fix a problem, in the library's terms: one of edge-spec's tasks (prepare, pull, models,
    bench), what it runs on (a pair's name, or PAIR where the library does not know it), and its options by their
    library names (None: an option without a value). The command line words it as a command (cli/render.py)."""

    task: str
    on: str | None = None
    options: tuple[tuple[str, object], ...] = ()


class UserError(Exception):
    """Something the user can fix (a path, an option, a pair, a prompt): the message says what went wrong.

    `option` names the option the message is about as the library spells it (max_tokens, ctx, budget): the command
    line says --max-tokens there, the server "max_tokens" (`worded`). `remedy`: the task that fixes it, which the
    message says in words ("prepare the pair") and a front end may name its own way (the command line's command)."""

    def __init__(self, message: str, option: str | None = None, remedy: Remedy | None = None):
        super().__init__(message)
        self.option, self.remedy = option, remedy

    def worded(self, name: Callable[[str], str]) -> str:
        """The message with its option called `name(option)`: where it is written `option` (in backticks), else its
        first mention as a word of its own (not inside a path or another name)."""
        text = str(self)
        if self.option is None:
            return text
        quoted = f"`{self.option}`"
        if quoted in text:
            return text.replace(quoted, name(self.option), 1)
        return re.sub(rf"(?<![\w./-]){re.escape(self.option)}(?![\w/-])", lambda _: name(self.option), text, count=1)


class ContextFull(UserError):
    """A prompt leaves no room in the context for a new token: what to do depends on the front end (shorten it,
    clear a chat, or load with a larger context)."""

    def __init__(self, tokens: int, n_ctx: int):
        super().__init__(f"the prompt is {tokens} tokens but the context holds {n_ctx}")
        self.tokens, self.n_ctx = tokens, n_ctx


class ModelFault(UserError):
    """A model computed what no healthy model does (logits that are not numbers): its file is damaged, or changed
    under the running process. Not a bug of edge-spec's: one line, and what to do."""


class Interrupted(Exception):
    """The user asked to stop (Ctrl-C) while a prompt was being read; what was read so far stays in the caches."""
