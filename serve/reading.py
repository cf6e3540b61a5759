"""A request's body, read and checked before any work: its size, the time it takes to arrive, JSON, text, and the
schema; each problem one OpenAI error (Refused) naming what is wrong."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, TypeVar

from edge.serve.limits import BODY_TIMEOUT_S
from edge.serve.schemas import GenerationRequest, Refused
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request

RequestT = TypeVar("RequestT", bound=GenerationRequest)
MAX_BODY_BYTES = 32 << 20  # a request body larger than this is refused before it is read (413)
MAX_MESSAGES = 16_384  # messages in one request, counted before they are validated (and the context counts too)
# JSON objects in one body, counted (as `{` bytes, text included) before it is parsed: parsing and validating a
# million content parts held the event loop for seconds (/health waited), in C that another thread would not free
MAX_OBJECTS = 8 * MAX_MESSAGES


async def read_body(request: Request, schema: type[RequestT], timeout_s: float = BODY_TIMEOUT_S) -> RequestT:
    """The request's JSON body, checked against `schema`, whole within `timeout_s`; read as JSON whatever the
    Content-Type says (curl -d sends a form's), as llama.cpp's server does."""
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():  # counted as it comes: a chunked body has no Content-Length to check
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise Refused(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except ClientDisconnect:
        raise Refused(400, "the client closed the connection before its request body ended") from None
    except TimeoutError:
        raise Refused(408, f"the request body did not arrive within {timeout_s:g} s: send it whole") from None
    raw = b"".join(chunks)
    if (objects := raw.count(b"{")) > MAX_OBJECTS:
        raise Refused(400, f"the request body holds {objects} JSON objects (or braces), more than this server reads "
                           f"({MAX_OBJECTS}): send fewer messages or content parts")
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
    # seconds on a body of millions of values, on the event loop
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
