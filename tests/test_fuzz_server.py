"""Property-based fuzzing of what reaches the server from outside and the chat templates a model file carries: request
bodies through the app itself, the JSON walk that bounds a body, and templates that would run away. Every input must
end as an OpenAI error body, a request queued, or one clear refusal, never another exception. Bounds:
tests/fuzzing.py.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.errors import UserError
from tests.fuzzing import EXAMPLES, FUZZ, JSON_VALUES, OUTCOMES, print_outcomes  # noqa: F401

pytestmark = pytest.mark.usefixtures("print_outcomes")

# --- what a client sends the server: the request schema, through the app itself ---

REQUEST_KEYS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "n", "stream",
                "stream_options", "logprobs", "top_logprobs", "logit_bias", "response_format", "tools", "echo",
                "suffix", "best_of", "user", "nonsense"]
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", ""]) | JSON_VALUES},
    optional={"content": st.text(max_size=40) | JSON_VALUES
              | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | JSON_VALUES},
                                               optional={"text": st.text(max_size=20) | JSON_VALUES}), max_size=3),
              "name": JSON_VALUES})


class _Refusing:
    """The generation thread's place in the app, for fuzzing what happens before a request queues: it checks the
    work it is given (tokens in the vocabulary, a positive token count) and generates nothing."""

    completed = cancelled = failed = waiting = 0
    running = None

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab

    def submit(self, work: object) -> None:
        from edge.serve.worker import GenerationFailed

        assert work.max_tokens >= 1 and work.tokens and all(0 <= t < self.n_vocab for t in work.tokens)  # type: ignore[attr-defined]
        raise GenerationFailed("fuzzing: nothing is generated", 503)


@pytest.fixture(scope="module")
def api(smollm2: object) -> object:
    from edge.serve.app import create_app
    from starlette.testclient import TestClient

    app = create_app(smollm2, _Refusing(smollm2.target.n_vocab))  # type: ignore[arg-type, attr-defined]
    return TestClient(app, raise_server_exceptions=True)


@FUZZ
@given(data=st.data())
def test_request_bodies_are_served_or_refused_in_openai_json(api: object, data: st.DataObject) -> None:
    """A chat or completions body: a valid one with values replaced or added, or bytes that are barely JSON. Every
    answer is an OpenAI error body with a 4xx status (or the stand-in's 503 for one that would run); nothing raises
    (a 500 would)."""
    endpoint = data.draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    body: dict = ({"messages": [{"role": "user", "content": "Hi"}]} if endpoint.endswith("chat/completions")
                  else {"prompt": "Once"})
    for _ in range(data.draw(st.integers(0, 3))):
        key = data.draw(st.sampled_from(REQUEST_KEYS))
        if key == "messages":
            body[key] = data.draw(st.lists(MESSAGE, max_size=4) | JSON_VALUES)
        elif key == "prompt":
            body[key] = data.draw(st.text(max_size=60) | st.lists(st.integers(-5, 1 << 20), max_size=6) | JSON_VALUES)
        else:
            body[key] = data.draw(JSON_VALUES)
    barely_json = [b"[" * 5000, b'{"a":' * 3000, b'{"max_tokens": 1' + b"0" * 5000 + b"}", b'{"prompt": "\\ud800"}',
                   b"", b"null"]
    raw = json.dumps(body).encode() if data.draw(st.integers(0, 9)) else data.draw(
        st.binary(max_size=80) | st.sampled_from(barely_json))
    response = api.post(endpoint, content=raw,  # type: ignore[attr-defined]
                        headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500 or response.status_code == 503, (response.status_code, raw[:200])
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    OUTCOMES["requests refused" if response.status_code != 503 else "requests queued"] += 1


def _values_walked(text: bytes) -> int:
    """`,` `[` `{` outside strings, by walking the bytes one at a time: what json_values counts with numpy."""
    count, inside, escaped = 0, False, False
    for byte in text:
        if inside:
            escaped, inside = (False, True) if escaped else (byte == ord("\\"), byte != ord('"'))
        elif byte == ord('"'):
            inside = True
        else:
            count += byte in b",[{"
    return count


JSON_TREES = st.recursive(st.none() | st.integers() | st.text(alphabet='ab,[{"\\\n', max_size=8),
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(
                              alphabet='k,{"\\', max_size=4), inner, max_size=3), max_leaves=12)


@FUZZ
@given(value=JSON_TREES, noise=st.binary(max_size=40).map(lambda b: b.replace(b"\x00", b'"')),
       chunk=st.integers(1, 64))
def test_a_bodys_json_values_are_counted_as_a_walk_counts_them(value: object, noise: bytes, chunk: int) -> None:
    """The server's count of JSON values (serve/reading.py), read in chunks of any size, equals a byte-by-byte walk,
    on JSON with quotes, backslashes and separators inside its strings, and on bytes that are not JSON."""
    from edge.serve.reading import json_values

    for text in (json.dumps(value).encode(), noise, json.dumps(value).encode() + noise):
        assert json_values(text, -1, chunk) == _values_walked(text), text


# --- what a model file's chat template may do: the render's bounds ---

SIZES = st.sampled_from([0, 1, 3, 1000, 100_000, 10**7, 10**12])
ITERABLES = st.one_of(SIZES.map(lambda n: f"range({n})"), SIZES.map(lambda n: f"'x' * {n}"),
                      SIZES.map(lambda n: f"[1] * {n}"), st.just("messages"), st.just("'abc'"))
VALUES_EXPR = st.one_of(SIZES.map(str), st.just("'y'"), SIZES.map(lambda n: f"'y' * {n}"),
                        SIZES.map(lambda n: f"'a'.center({n})"), SIZES.map(lambda n: f"'%{n}d' % 1"),
                        SIZES.map(lambda n: f"'{{:{n}}}'.format(1)"), SIZES.map(lambda n: f"'%{n}s' | format('z')"),
                        SIZES.map(lambda n: f"2 ** {n}"), SIZES.map(lambda n: f"'q' ~ ('r' * {n})"),
                        st.just("1 / 0"), st.just("messages[5]"), st.just("messages[0]['content'] * 3"),
                        SIZES.map(lambda n: f"('s' * {n}) | list | length"))


@st.composite
def _templates(draw: st.DrawFn) -> str:
    """Loops nested up to three deep over ranges, strings and lists of many sizes, around values that pad, format,
    multiply, raise or recurse."""
    body = "{{ " + draw(VALUES_EXPR) + " }}"
    for depth in range(draw(st.integers(0, 3))):
        body = "{% for v" + str(depth) + " in " + draw(ITERABLES) + " %}" + body + "{% endfor %}"
    if draw(st.booleans()):
        body = "{% macro m(n) %}" + body + "{{ m(n) if n > 0 else '' }}{% endmacro %}{{ m(" + str(
            draw(SIZES)) + ") }}"
    return body


@settings(FUZZ, max_examples=max(10, EXAMPLES // 3))
@given(source=_templates())
def test_chat_templates_render_within_their_bounds_or_say_why(source: str) -> None:
    """A rendered prompt stays within MAX_OUTPUT characters, and a render that would run past its bounds (time,
    steps, size, recursion) or fails is one UserError line; the time bound is lowered here to keep the run short
    (its mechanism is the same)."""
    import time
    from unittest.mock import patch

    from edge import chat_template
    from edge.chat_template import ChatTemplate

    start = time.perf_counter()
    with patch.object(chat_template, "MAX_SECONDS", 0.25):
        try:
            text = ChatTemplate(source, "", "").render([{"role": "user", "content": "Hi"}])
        except UserError as problem:
            assert "\n" not in str(problem), source
            OUTCOMES["templates stopped"] += 1
        else:
            assert len(text) <= chat_template.MAX_OUTPUT, source
            OUTCOMES["templates rendered"] += 1
    assert time.perf_counter() - start < 5, source  # the bound itself, not a speed target: 0.25 s plus teardown
