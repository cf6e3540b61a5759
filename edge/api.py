"""The library's face: load a pair, generate from it, or stream the generation step by step.

    import edge
    with edge.load("smollm2-135m") as pair:
        print(edge.generate(pair, "Name three colors.", max_tokens=32).text)
        for step in edge.stream_generate(pair, [{"role": "user", "content": "Hi!"}], temperature=0.8, seed=1):
            print(step.text, end="", flush=True)

The command line, the benchmarks and the tests use these same calls. Loading is library code above the engine
(models/loading.py), imported only when `load` runs, so that `import edge` stays light.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from edge.chat import Prompt
from edge.generate import Decoder, Stats, Step, check_fits
from edge.options import LoadOptions, check_max_tokens, parse_budget
from edge.sampling import SamplingConfig
from edge.stops import StopStrings, cut_at_stop_strings, stopping

if TYPE_CHECKING:
    from edge.models.pair import Pair


@dataclass
class Generation:
    text: str
    tokens: list[int]  # the new tokens (a stop token that ended the reply is not among them)
    finish_reason: str  # "stop", "length", "context" or "interrupted"
    stats: Stats
    lossless_warning: str | None  # why this target's output may differ from plain decoding, if it may

    @classmethod
    def from_steps(cls, steps: Iterable[Step], lossless_warning: str | None = None) -> Generation:
        """The reply a stream of steps makes (stream_generate's, run to its end)."""
        pieces, tokens = [], []
        for step in steps:
            pieces.append(step.text)
            if step.token is not None and step.finish_reason is None:
                tokens.append(step.token)
        assert step.finish_reason is not None, "a step stream ends with a finish reason"
        return cls("".join(pieces), tokens, step.finish_reason, step.stats, lossless_warning)

    def as_dict(self) -> dict[str, Any]:
        return {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
                "lossless_warning": self.lossless_warning, "stats": self.stats.as_dict()}


def load(pair: str | LoadOptions | None = None, *, report: Callable[[str], None] | None = None,
         **options: Any) -> Pair:
    """Load a pair of models.toml by name (None: the default pair), or `target=` / `drafter=` GGUF paths; every
    other keyword is a field of LoadOptions (ctx, budget, threads, placement, ...). `report` receives progress lines
    (downloads, preparing files, building the drafter's graph; default: the "edge" logger at INFO level). Close the
    pair, or use it in a `with` block."""
    from edge.models.loading import open_pair

    load_options = replace(pair, **options) if isinstance(pair, LoadOptions) else LoadOptions(pair=pair, **options)
    return open_pair(load_options, report or logging.getLogger("edge").info)


@dataclass(frozen=True)
class GenerateOptions:
    """stream_generate's keywords. Sampling: temperature 0 is greedy; `sampling` replaces the separate fields (it also
    holds the presence and frequency penalties). Output is the target's own whatever `speculate` and `budget`: they
    change only how many tokens each target pass yields. `raw`: complete the text as-is, no chat template. `stop`:
    stop strings; the reply ends before the first one its text contains (finish reason "stop"). `should_stop` is
    asked after each token: True ends the reply ("interrupted"). `principal`: who asks (a server's API key), where
    several share a pair: each has its own prompt cache, tree statistics and earlier replies for lookup (None: one
    principal, everyone)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    seed: int | None = None
    sampling: SamplingConfig | None = None
    speculate: bool = True
    budget: int | str | None = None
    raw: bool | None = None
    stop: str | Sequence[str] | None = None
    should_stop: Callable[[], bool] | None = None
    principal: str | None = None

    def sampled(self) -> SamplingConfig:
        return self.sampling or SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                               min_p=self.min_p, repeat_penalty=self.repeat_penalty, seed=self.seed)


def stream_generate(pair: Pair, prompt: Prompt, **options: Any) -> Iterator[Step]:
    """Yield one Step per new token, then a final Step whose `finish_reason` says why generation ended and whose
    `stats` cover the whole reply (prefill included).

    `prompt`: text (rendered with the pair's chat template unless `raw`; a base model completes it as-is), chat
    messages, or token ids. `options`: GenerateOptions' fields (max_tokens, temperature, top_k, top_p, min_p,
    repeat_penalty, seed, sampling, speculate, budget, raw, stop, should_stop, principal).

    A pair runs one generation at a time: a call from another thread waits for its turn, a second generator on the
    same thread while one is unfinished raises UserError, and a generator dropped or closed ends its turn. After
    pair.close() a generation raises UserError.
    """
    asked = GenerateOptions(**options)
    check_max_tokens(asked.max_tokens)
    sampling, max_tokens, should_stop, stop = asked.sampled(), asked.max_tokens, asked.should_stop, asked.stop
    stops = StopStrings([] if stop is None else stop)
    with pair.generating():  # one generation at a time per pair (another thread's waits its turn)
        with pair.stepping():
            tokens = pair.prompt_tokens(prompt, asked.raw)
            check_fits(tokens, pair.target.n_ctx)  # before a first --budget auto times the passes (seconds, once)
            decoder = pair.reused_decoder(sampling, asked.speculate, parse_budget(asked.budget), asked.principal)
        steps = reply_steps(decoder, tokens, max_tokens, stops, should_stop)
        while True:
            with pair.stepping():  # a pair closed meanwhile is said here, before its models are touched
                step = next(steps, None)
            if step is None:
                return
            yield step


def reply_steps(decoder: Decoder, tokens: list[int], max_tokens: int, stops: StopStrings,
                should_stop: Callable[[], bool] | None) -> Iterator[Step]:
    """A decoder's reply to `tokens`, cut at the first of `stops` (a server's lanes run their decoders this way)."""
    if stops.stops:
        return cut_at_stop_strings(decoder.reply(tokens, max_tokens, stopping(stops, should_stop)), stops)
    return decoder.reply(tokens, max_tokens, should_stop)


def generate(pair: Pair, prompt: Prompt, **kwargs: Any) -> Generation:
    """The whole reply at once: text, tokens, finish reason and stats. Takes stream_generate's keywords."""
    return Generation.from_steps(stream_generate(pair, prompt, **kwargs), pair.lossless_warning)
