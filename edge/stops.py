"""Stop strings: a reply ends where its text first contains one of them, and the stop string and what follows are
left out (OpenAI's `stop`, llama.cpp's reverse prompts). Text that could be the start of a stop string is held back
until the next tokens show whether it is one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

from edge.errors import UserError
from edge.generate import Step


class StopStrings:
    def __init__(self, stops: Sequence[str]):
        if isinstance(stops, str):
            stops = [stops]
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise UserError(f"a stop string must be non-empty text (got {stop!r:.40})")
        self.stops = tuple(stops)
        self.held = ""  # text not shown yet: it ends with what could begin a stop string
        self.found = False

    def feed(self, text: str) -> str:
        """The text that can be shown now. After a stop string completes, `found` is set and nothing more is shown."""
        if self.found:
            return ""
        self.held += text
        hits = [at for at in (self.held.find(stop) for stop in self.stops) if at >= 0]
        if hits:
            shown, self.held, self.found = self.held[: min(hits)], "", True
            return shown
        cut = len(self.held) - self._partial()
        shown, self.held = self.held[:cut], self.held[cut:]
        return shown

    def flush(self) -> str:
        """What is held back, once the reply has ended without a stop string."""
        shown, self.held = ("" if self.found else self.held), ""
        return shown

    def _partial(self) -> int:
        """The length of the longest end of the held text that begins a stop string (not all of it)."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.held)), longest, -1):
                if self.held.endswith(stop[:n]):
                    longest = n
                    break
        return longest


def stopping(stops: StopStrings, should_stop: Callable[[], bool] | None) -> Callable[[], bool]:
    """The decoder's should_stop: a stop string was found, or the caller's own stop."""
    return lambda: stops.found or (should_stop is not None and should_stop())


def cut_at_stop_strings(steps: Iterator[Step], stops: StopStrings) -> Iterator[Step]:
    """The steps of a decoder whose should_stop is `stopping(stops, ...)`, with their text cut at the first stop
    string; the reply then ends with the finish reason "stop". Each step's token stays (usage counts it)."""
    for step in steps:
        if step.finish_reason is None:
            yield dataclasses.replace(step, text=stops.feed(step.text))
            continue
        text = stops.feed(step.text)
        text += stops.flush()
        yield dataclasses.replace(step, text=text, finish_reason="stop" if stops.found else step.finish_reason)
