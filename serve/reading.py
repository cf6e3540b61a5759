"""A request's body, read and checked before any work: its size, the time it takes to arrive, JSON, text, and the
schema; each problem one OpenAI error (Refused) naming what is wrong.

What a body may hold follows from the context (BodyBounds): a prompt is at most n_ctx tokens, so its JSON is at most
n_ctx of the vocabulary's longest tokens, escaped, plus the request's other fields. A body past that is refused from
its Content-Length (serve/gate.py) or as it arrives, and one within it but packed with values (a list of millions of
numbers) is refused from a count of its JSON values, before it is parsed. json.loads is a C call that keeps the GIL
(parsing 28 MiB of numbers held /health for 0.8 s), so a thread alone would not free the event loop; within the
bounds, each such call is short, and the parse runs on a thread between them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from edge.serve.limits import BODY_TIMEOUT_S
from edge.serve.schemas import GenerationRequest, Refused
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

RequestT = TypeVar("RequestT", bound=GenerationRequest)
MAX_BODY_BYTES = 32 << 20  # never more, whatever the context (a context of 200k tokens would allow more)
MAX_MESSAGES = 16_384  # messages in one request, counted before they are validated (and the context counts too)
FRAME_BYTES = 1 << 20  # what a request holds besides its prompt: the model's name, sampling, stop strings, metadata
FRAME_VALUES = 4096
# a prompt token's JSON besides its text: a token id and its comma, a message's or content part's keys, indentation
TOKEN_FRAME_BYTES = 64
VALUES_PER_TOKEN = 4  # JSON values per prompt token at most: an id; a message or content part costs tokens too
SCAN_BYTES = 1 << 20  # json_values reads a body this much at a time (a few bytes of numpy arrays per byte)


@dataclass(frozen=True)
class BodyBounds:
    """The largest body (bytes) and the most JSON values (`,` `[` `{` outside strings) a request to a server of this
    context can need."""

    n_ctx: int
    bytes: int
    values: int

    @classmethod
    def for_context(cls, n_ctx: int, token_texts: Iterable[bytes]) -> BodyBounds:
        """From the vocabulary: n_ctx of its longest token as JSON escapes it at most (\\u00XX for a control byte,
        \\uXXXX for non-ASCII), each with its share of the JSON around it."""
        longest = max((escaped_size(text) for text in token_texts), default=1)
        size = FRAME_BYTES + n_ctx * (longest + TOKEN_FRAME_BYTES)
        return cls(n_ctx, min(size, MAX_BODY_BYTES), FRAME_VALUES + VALUES_PER_TOKEN * n_ctx)

    def too_large(self, size: int, whole: bool = True) -> Refused:
        """`size`: the body's Content-Length, or (not `whole`) what had arrived of a chunked body when it passed."""
        said = (f"is {size} bytes, more than a request to this server can need ({self.bytes} bytes: its context "
                f"holds {self.n_ctx} tokens)" if whole else
                f"runs past {self.bytes} bytes, more than a request to this server can need (its context holds "
                f"{self.n_ctx} tokens)")
        return Refused(413, f"the request body {said}: shorten the prompt, or restart the server with a larger --ctx",
                       code="context_length_exceeded")


_HIGH = bytes(range(0x80, 0x100))
_SHORT_ESCAPES = b'\b\f\n\r\t"\\'
_CONTROLS = bytes(b for b in range(0x20) if bytes([b]) not in _SHORT_ESCAPES)


def escaped_size(text: bytes) -> int:
    """The most bytes JSON (ASCII-escaped) can write for these bytes of UTF-8: a non-ASCII byte 3 (a 4-byte character
    is a 12-byte surrogate pair), `"` `\\` and \\n-like controls 2, other controls 6."""
    def count(of: bytes) -> int:
        return len(text) - len(text.translate(None, of))
    return len(text) + 2 * count(_HIGH) + count(_SHORT_ESCAPES) + 5 * count(_CONTROLS)


def json_values(raw: bytes, at_most: int, chunk_bytes: int = SCAN_BYTES) -> int:
    """How many `,` `[` `{` a JSON text holds outside its strings (about one per value in a list or object), counted
    exactly only when the bytes themselves hold more than `at_most`: in passes of numpy over `chunk_bytes` at a time,
    not a parse."""
    if sum(raw.count(mark) for mark in (b",", b"[", b"{")) <= at_most:
        return at_most  # text included, no more than that
    values, inside, backslash_run = 0, 0, 0  # carried from one chunk to the next
    for offset in range(0, len(raw), chunk_bytes):
        chunk = np.frombuffer(raw, np.uint8, min(chunk_bytes, len(raw) - offset), offset)  # [n_bytes]
        quote = chunk == ord('"')
        backslash = chunk == ord("\\")
        quotes, backslashes = np.flatnonzero(quote), np.flatnonzero(backslash)
        if quotes.size and (backslashes.size or backslash_run):  # after an odd run of backslashes, a quote is text
            run = backslashes_before(quotes, backslashes, backslash_run)
            quote[quotes[run % 2 == 1]] = False
        parity = np.bitwise_xor.accumulate(quote.view(np.uint8)) ^ inside  # 1 inside a string
        structure = (chunk == ord(",")) | (chunk == ord("[")) | (chunk == ord("{"))
        values += int(np.count_nonzero(structure & (parity == 0)))
        inside = int(parity[-1])
        ends = np.flatnonzero(~backslash)
        backslash_run = len(chunk) - 1 - int(ends[-1]) if ends.size else backslash_run + len(chunk)
    return values


def backslashes_before(quotes: np.ndarray, backslashes: np.ndarray, carried: int) -> np.ndarray:
    """The length of the run of backslashes just before each quote (positions in one chunk), `carried` of them
    ending the chunk before."""
    if not backslashes.size:
        return np.where(quotes == 0, carried, 0)
    last = np.searchsorted(backslashes, quotes) - 1  # the last backslash before each quote, if any
    touching = (last >= 0) & (backslashes[np.maximum(last, 0)] == quotes - 1)
    run_starts = np.flatnonzero(np.diff(backslashes, prepend=-2) != 1)  # where each run begins, as indices
    start = backslashes[run_starts[np.searchsorted(run_starts, np.maximum(last, 0), side="right") - 1]]
    run = np.where(touching, quotes - start + np.where(start == 0, carried, 0), 0)
    return np.where((quotes == 0) & (carried > 0), carried, run)


async def read_body(request: Request, schema: type[RequestT], bounds: BodyBounds,
                    timeout_s: float = BODY_TIMEOUT_S) -> RequestT:
    """The request's JSON body, checked against `schema` within `bounds`, whole within `timeout_s`; read as JSON
    whatever the Content-Type says (curl -d sends a form's), as llama.cpp's server does."""
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():  # counted as it comes: a chunked body has no Content-Length to check
            size += len(chunk)
            if size > bounds.bytes:
                raise bounds.too_large(size, whole=False)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except ClientDisconnect:
        raise Refused(400, "the client closed the connection before its request body ended") from None
    except TimeoutError:
        raise Refused(408, f"the request body did not arrive within {timeout_s:g} s: send it whole") from None
    # off the event loop: within the bounds, each step that keeps the GIL (json.loads of 8 MB, a numpy pass) takes
    # milliseconds, and /health is answered between them
    return await run_in_threadpool(parse_body, b"".join(chunks), schema, bounds)


def parse_body(raw: bytes, schema: type[RequestT], bounds: BodyBounds) -> RequestT:
    """A whole body, as JSON checked against `schema` within `bounds`."""
    if (values := json_values(raw, bounds.values)) > bounds.values:
        raise Refused(400, f"the request body holds {values} JSON values, more than a request to this server can need "
                           f"({bounds.values}: its context holds {bounds.n_ctx} tokens): send fewer messages, content "
                           "parts or token ids", code="context_length_exceeded")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise Refused(400, "the request body is not UTF-8 text") from None
    except json.JSONDecodeError as problem:
        raise Refused(400, f"the request body is not valid JSON ({problem.msg} at line {problem.lineno} column "
                           f"{problem.colno})" if raw.strip() else "the request has no body: send a JSON object") \
            from None
    except RecursionError:
        raise Refused(400, "the request body nests JSON arrays or objects too deeply") from None
    except ValueError as problem:  # e.g. an integer of more digits than Python converts
        raise Refused(400, f"the request body holds a value that cannot be read: {problem}") from None
    if isinstance(data, dict) and isinstance(data.get("messages"), list) and len(data["messages"]) > MAX_MESSAGES:
        raise Refused(400, f"{len(data['messages'])} messages are more than this server takes ({MAX_MESSAGES}): send "
                           "fewer", "messages", "context_length_exceeded")
    if not isinstance(data, dict):
        raise Refused(400, f"the request body must be a JSON object (got {type(data).__name__})")
    try:
        body = schema.model_validate(data)
    except ValidationError as problem:
        message, _kind, param = describe(problem.errors())
        raise Refused(400, message, param) from None
    # what the request uses, after validation has bounded it: a walk of everything sent (fields ignored included) took
    # seconds on a body of millions of values
    if has_lone_surrogate(body.model_dump()):
        raise Refused(400, "the request body holds a lone UTF-16 surrogate (such as \\ud800): not text")
    return body


def describe(errors: Sequence[Any]) -> tuple[str, str, str | None]:
    """One line for a request that fails validation: the first problem, where it is, and the count of the rest."""
    if not errors:
        return "the request is not valid", "invalid_request_error", None
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    where = ".".join(location)
    said = str(first.get("msg", "not valid")).removeprefix("Value error, ")  # a validator's own words
    message = f"{where}: {said}" if where else said
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, "invalid_request_error", where or None


def has_lone_surrogate(data: Any) -> bool:
    """Whether a parsed JSON value holds a string with a lone surrogate (JSON's \\ud800 escape), which is not text:
    no tokenizer can encode it."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False
