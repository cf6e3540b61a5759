"""Stop strings and the OpenAI penalties, on the engine: what the server's `stop`, `presence_penalty` and
`frequency_penalty` come to."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.errors import UserError
from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.sampling import SamplingConfig, distribution, penalized
from edge.stops import StopStrings, cut_at_stop_strings, stopping
from tests.tiny import TinyModel, generate_tokens

ALPHABET = "ab\nxé"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(pieces=st.lists(st.text(ALPHABET, max_size=4), max_size=12),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=3), min_size=1, max_size=3))
def test_stop_strings_show_exactly_the_text_before_the_first_stop(pieces: list[str], stops: list[str]) -> None:
    """However the text is split into tokens: everything before the earliest stop string, nothing after it."""
    text = "".join(pieces)
    hits = [at for at in (text.find(stop) for stop in stops) if at >= 0]
    cutter = StopStrings(stops)
    shown = "".join(cutter.feed(piece) for piece in pieces) + cutter.flush()
    assert shown == (text[: min(hits)] if hits else text)
    assert cutter.found == bool(hits)


def test_text_that_may_begin_a_stop_string_is_held_back() -> None:
    cutter = StopStrings(["</end>"])
    assert cutter.feed("Hello </") == "Hello "
    assert cutter.feed("e") == ""
    assert cutter.feed("x") == "</ex"  # it was not a stop string after all
    assert cutter.feed(" done</end> more") == " done" and cutter.found and cutter.feed("!") == ""


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [3]])
def test_empty_stop_strings_are_refused(bad: list) -> None:
    with pytest.raises(UserError, match="stop string"):
        StopStrings(bad)


def test_a_stop_string_ends_the_decoder_on_its_token() -> None:
    """The decoder stops right after the token that completes the stop string, and its caches hold exactly the
    context (a next request reuses them): the finish reason is "stop"."""
    target = TinyModel(n_vocab=9, seed=5)
    decoder = Decoder(target, target.noisy(0.7), GrowConfig.for_budget(16), SamplingConfig())
    decoder.load([1, 2, 3])
    plain = [s.token for s in decoder.generate(30) if s.finish_reason is None]
    texts = [target.tokenizer.token_bytes(t).decode() for t in plain]
    stop = texts[7] + texts[8]
    at = "".join(texts).find(stop)
    cutter = StopStrings([stop])
    decoder.load([1, 2, 3])
    steps = list(cut_at_stop_strings(decoder.reply([1, 2, 3], 30, stopping(cutter, None)), cutter))
    assert steps[-1].finish_reason == "stop" and "".join(s.text for s in steps) == "".join(texts)[:at]
    emitted = [s.token for s in steps if s.finish_reason is None]
    assert emitted == plain[: len(emitted)] and len(emitted) <= 9
    assert decoder.context == [1, 2, 3, *emitted] and target.cache == decoder.context[:-1]


def test_presence_and_frequency_penalties_as_openai_defines_them() -> None:
    logits = np.array([2.0, 1.0, 0.5, -1.0], np.float32)
    config = SamplingConfig(presence_penalty=0.5, frequency_penalty=0.25)
    out = penalized(logits, config, [1, 1, 3])
    assert np.allclose(out, [2.0, 1.0 - 0.5 - 2 * 0.25, 0.5, -1.0 - 0.5 - 0.25])
    assert penalized(logits, SamplingConfig(), [1, 1, 3]) is logits  # no penalty: no copy
    # with the repetition penalty too: divided first, then subtracted (llama.cpp's order)
    both = penalized(logits, SamplingConfig(repeat_penalty=2.0, presence_penalty=0.5), [0])
    assert np.isclose(both[0], 2.0 / 2 - 0.5)
    # greedy follows the penalized logits
    assert distribution(logits, SamplingConfig(presence_penalty=3.0), [0])[0].tolist() == [1]


@pytest.mark.parametrize("bad", [dict(presence_penalty=float("nan")), dict(frequency_penalty=float("inf"))])
def test_penalties_must_be_finite(bad: dict) -> None:
    with pytest.raises(UserError, match="finite"):
        SamplingConfig(**bad)


def test_penalized_sampling_stays_lossless() -> None:
    """With both penalties on, a seed gives plain sampling's exact text, as the other sampling rules do."""
    sampling = SamplingConfig(temperature=0.9, top_k=5, presence_penalty=0.7, frequency_penalty=0.4, seed=3)
    plain = generate_tokens(TinyModel(n_vocab=9, seed=2), None, None, [4, 5], 80, sampling)
    target = TinyModel(n_vocab=9, seed=2)
    assert generate_tokens(target, target.noisy(1.0), 32, [4, 5], 80, sampling) == plain
    greedy = SamplingConfig(presence_penalty=1.5, frequency_penalty=0.5)
    plain = generate_tokens(TinyModel(n_vocab=9, seed=2), None, None, [4, 5], 60, greedy)
    target = TinyModel(n_vocab=9, seed=2)
    assert generate_tokens(target, target.noisy(0.7), 16, [4, 5], 60, greedy) == plain
