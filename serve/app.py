"""The HTTP face: OpenAI's chat and completion endpoints, /v1/models and /health, over one loaded pair.

Requests are checked (types, sizes, the prompt against the context) on arrival and refused with an OpenAI error body
at once; what passes queues for the one generation thread (serve/worker.py). Streaming replies are server-sent events
ending in `data: [DONE]`, as OpenAI's. A client that leaves stops its generation after the current token.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from edge.serve.hosts import loopback_host
from edge.serve.limits import BODY_TIMEOUT_S
from edge.serve.schemas import (
    FINISH_REASONS,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    Refused,
    Reply,
    edge_stats,
    error_body,
)
from edge.serve.worker import GenerationFailed, Job, Work, Worker
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from edge.errors import ContextFull, UserError
from edge.generate import Stats, check_fits

if TYPE_CHECKING:
    from edge.models.pair import Pair

RequestT = TypeVar("RequestT", bound=GenerationRequest)
MAX_BODY_BYTES = 32 << 20  # a request body larger than this is refused before it is read (413)
TRIM_AFTER_BYTES = 1 << 20  # after a request body this large, freed memory is handed back to the OS
MAX_MESSAGES = 16_384  # messages in one request, counted before they are validated (and the context counts too)
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
SHUTDOWN_GRACE_S = 4.0  # on shutdown a stream has this long to send its error event and [DONE] (uvicorn waits 5 s)


def create_app(pair: Pair, worker: Worker, api_key: str | None = None,
               cors_origins: Sequence[str] = (), loopback_only: bool = False,
               body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The app over `pair`. A request from a web page (its Origin header) is served only from `cors_origins` ("*":
    any); `loopback_only` (a server bound to a loopback address) also refuses a Host header that names another
    machine (DNS rebinding). With `api_key`, every endpoint but /health asks for it, the OpenAPI document too."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("edge-spec")
    except PackageNotFoundError:
        release = "0"
    app = FastAPI(title="edge-spec", version=release, docs_url=None, redoc_url=None, openapi_url=None)
    allowed_origins = set(cors_origins)
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        # any request header: OpenAI's JS SDK sends its own (x-stainless-*, openai-*) and preflights them
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    model_name, created = pair.name, int(time.time())
    # Sampling for what a request leaves out: the pair's (the model's recommended, else llama.cpp's); no repetition
    # penalty unless the model recommends one, as OpenAI's API and llama-server
    defaults = pair.sampling

    app.add_middleware(_Gate, origins=allowed_origins, loopback_only=loopback_only)  # outside CORS: it runs first

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, problem: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(*_describe(problem.errors())), 400)

    @app.exception_handler(Refused)
    async def refused(_request: Request, problem: Refused) -> JSONResponse:
        return JSONResponse(problem.body(), problem.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, problem: HTTPException) -> JSONResponse:
        if problem.status_code == 404:
            return JSONResponse(error_body(f"no such endpoint: {request.method} {request.url.path} (GET / lists "
                                           "them)", "not_found_error"), 404)
        return JSONResponse(error_body(str(problem.detail)), problem.status_code, headers=problem.headers)

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode("latin-1", "replace")  # the header's own bytes (HTTP decodes it as latin-1)
        if scheme.lower() != "bearer" or not secrets.compare_digest(given, api_key.encode("utf-8")):
            raise Refused(401, "a missing or wrong API key: send the header `Authorization: Bearer KEY` with the key "
                               "the server was started with (--api-key)", code="invalid_api_key")

    def check_model(asked: str | None) -> None:
        if asked is not None and asked != model_name:
            raise Refused(404, f"the model {asked!r} is not served here: this server serves {model_name!r} "
                               "(GET /v1/models)", "model", "model_not_found")

    n_ctx = pair.target.n_ctx
    longest_token = max(len(pair.target.tokenizer.token_bytes(token)) for token in range(pair.target.n_vocab))

    def refuse_oversized(prompt: Any, raw: bool) -> None:
        """Refuse, before rendering or tokenizing, a prompt that cannot fit the context whatever its tokens: more
        messages than the context has tokens (each takes one at least), or more text than n_ctx of the vocabulary's
        longest tokens hold."""
        if isinstance(prompt, str):
            texts = [prompt]
        elif prompt and isinstance(prompt[0], dict):
            if len(prompt) >= n_ctx:
                raise Refused(400, f"{len(prompt)} messages cannot fit this server's context of {n_ctx} tokens: "
                                   "send fewer", "messages", "context_length_exceeded")
            texts = [message["content"] for message in prompt]
        else:
            return  # token ids: counted as they are
        size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
        if size > n_ctx * longest_token:
            raise Refused(400, f"the prompt's {size} bytes of text are more than this server's context of {n_ctx} "
                               "tokens can hold: shorten it, or restart the server with a larger --ctx",
                          "prompt" if raw else "messages", "context_length_exceeded")

    async def prepare(body: GenerationRequest, prompt: Any, raw: bool, max_tokens: int | None) -> Work:
        """The request as work for the generation thread: checked, its prompt rendered and tokenized (off the event
        loop), and refused here if it cannot fit the context."""
        check_model(body.model)
        body.refuse_unsupported()
        refuse_oversized(prompt, raw)
        try:
            sampling = body.sampling(defaults)
            stop = body.stop_strings()
            tokens = await run_in_threadpool(pair.prompt_tokens, prompt, raw)
        except UserError as problem:
            raise Refused(400, str(problem), problem.option) from None
        n_vocab = pair.target.n_vocab
        if not tokens:
            raise Refused(400, "the prompt is empty", "prompt")
        if any(not 0 <= token < n_vocab for token in tokens):
            raise Refused(400, f"a token id of the prompt is outside the vocabulary (0 to {n_vocab - 1})", "prompt")
        try:
            check_fits(tokens, n_ctx)
        except ContextFull:
            raise Refused(400, f"the prompt is {len(tokens)} tokens but this server's context holds {n_ctx}: "
                               "shorten it, or restart the server with a larger --ctx",
                          "prompt" if raw else "messages", "context_length_exceeded") from None
        room = n_ctx - len(tokens)
        return Work(tokens, sampling, room if max_tokens is None else min(max_tokens, room), stop)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        import psutil

        return {"status": "ok", "model": model_name,
                "queue": {"running": int(worker.running is not None), "waiting": worker.waiting},
                "requests": {"completed": worker.completed, "cancelled": worker.cancelled, "failed": worker.failed},
                "rss_bytes": psutil.Process().memory_info().rss}

    @app.get("/openapi.json", dependencies=[Depends(authorize)], include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_entry()]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorize)])
    async def one_model(name: str) -> dict[str, Any]:
        check_model(name)
        return model_entry()

    def model_entry() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "edge-spec",
                "context_length": pair.target.n_ctx, "chat_template": pair.template is not None}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Any:
        body = await _body(request, ChatRequest, body_timeout_s)
        if pair.template is None:
            check_model(body.model)
            raise Refused(400, f"{model_name} has no chat template (a base model): use /v1/completions to complete "
                               "text", "messages", "no_chat_template")
        messages = body.template_messages()
        work = await prepare(body, messages, False, body.reply_tokens())
        return await respond(Reply("chat", model_name), body, work, request)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Any:
        body = await _body(request, CompletionRequest, body_timeout_s)
        work = await prepare(body, body.one_prompt(), True, body.reply_tokens())
        return await respond(Reply("text", model_name), body, work, request)

    async def respond(reply: Reply, body: GenerationRequest, work: Work, request: Request) -> Any:
        try:
            job = worker.submit(work)
        except GenerationFailed as problem:
            raise Refused(problem.status, str(problem), kind="server_error") from None
        if body.stream:
            # On shutdown the worker ends every job; the stream then sends its error event and [DONE] itself.
            return EventSourceResponse(_stream(reply, job, body.include_usage), sep="\n", ping=15,
                                       shutdown_event=anyio.Event(), shutdown_grace_period=SHUTDOWN_GRACE_S)
        return await _whole(reply, job, request)

    @app.get("/")
    async def root() -> dict[str, Any]:
        return {"name": "edge-spec", "model": model_name, "api": "/v1",
                "endpoints": ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health"]}

    return app


async def _body(request: Request, schema: type[RequestT], timeout_s: float = BODY_TIMEOUT_S) -> RequestT:
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
    if _has_lone_surrogate(data):
        raise Refused(400, "the request body holds a lone UTF-16 surrogate (such as \\ud800): not text")
    if not isinstance(data, dict):
        raise Refused(400, f"the request body must be a JSON object (got {type(data).__name__})")
    try:
        return schema.model_validate(data)
    except ValidationError as problem:
        message, _kind, param = _describe(problem.errors())
        raise Refused(400, message, param) from None


async def _whole(reply: Reply, job: Job, request: Request) -> JSONResponse:
    """A non-streamed reply; a client that leaves meanwhile cancels its job."""
    collected = asyncio.ensure_future(_collect(job))
    try:
        while True:
            done, _ = await asyncio.wait({collected}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                job.cancel()
        text, tokens, finish, stats = collected.result()
    except GenerationFailed as problem:
        kind = "server_error" if problem.status >= 500 else "invalid_request_error"
        return JSONResponse(error_body(str(problem), kind), problem.status)
    finally:
        job.cancel()  # ended (a no-op) or left
    if finish == "interrupted":
        return JSONResponse(error_body("the generation was stopped (the client left, or the server is shutting "
                                       "down)", "server_error"), 503)
    return JSONResponse(reply.whole(text, FINISH_REASONS[finish], tokens, stats))


async def _collect(job: Job) -> tuple[str, int, str, Stats]:
    pieces, tokens = [], 0
    async for step in job.steps():
        pieces.append(step.text)
        if step.token is not None and step.finish_reason is None:
            tokens += 1
        if step.finish_reason is not None:
            return "".join(pieces), tokens, step.finish_reason, step.stats
    raise AssertionError("a job's steps end with a finish reason")


async def _stream(reply: Reply, job: Job, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a first chunk at once (chat: the role), one per piece of text, the last with the finish
    reason and edge-spec's figures, the usage if asked for, then [DONE]. Leaving (disconnecting) cancels the job."""
    tokens = 0
    try:
        yield json.dumps(reply.chunk("" if reply.kind == "chat" else None, first=True))
        async for step in job.steps():
            if step.token is not None and step.finish_reason is None:
                tokens += 1
            if step.finish_reason is None:
                if step.text:
                    yield json.dumps(reply.chunk(step.text))
                continue
            if step.finish_reason == "interrupted":
                yield json.dumps(error_body("the generation was stopped (the server is shutting down)",
                                            "server_error"))
                yield "[DONE]"
                return
            if step.text:
                yield json.dumps(reply.chunk(step.text))
            yield json.dumps(reply.chunk(None, FINISH_REASONS[step.finish_reason], edge_spec=edge_stats(step.stats)))
            if include_usage:
                yield json.dumps(reply.usage_chunk(step.stats, tokens))
        yield "[DONE]"
    except GenerationFailed as problem:  # an error event, then [DONE]: clients that wait for it end cleanly
        kind = "server_error" if problem.status >= 500 else "invalid_request_error"
        yield json.dumps(error_body(str(problem), kind))
        yield "[DONE]"
    finally:
        job.cancel()


def _describe(errors: Sequence[Any]) -> tuple[str, str, str | None]:
    """One line for a request that fails validation: the first problem, where it is, and the count of the rest."""
    if not errors:
        return "the request is not valid", "invalid_request_error", None
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    where = ".".join(location)
    message = f"{where}: {first.get('msg', 'not valid')}" if where else str(first.get("msg", "not valid"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, "invalid_request_error", where or None


class _Gate:
    """What is refused before any endpoint runs, as plain ASGI (a BaseHTTPMiddleware would hide a client's
    disconnect from the endpoint, which then could not cancel its generation):

    - a web page's request, unless --cors-origin allows its origin: a browser sends a cross-origin POST of
      text/plain with no preflight, and CORS only hides the reply, after the work;
    - with `loopback_only`, a Host header that names another machine (a page reaching us by DNS rebinding);
    - a body whose Content-Length is past MAX_BODY_BYTES (a chunked one is counted as it is read: _body)."""

    def __init__(self, app: Any, origins: set[str], loopback_only: bool) -> None:
        self.app, self.origins, self.loopback_only = app, origins, loopback_only

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            from starlette.datastructures import Headers

            refusal = self.refusal(Headers(scope=scope))
            if refusal is not None:
                await JSONResponse(*refusal)(scope, receive, send)
                return
            received = 0

            async def counted() -> Any:
                nonlocal received
                message = await receive()
                received += len(message.get("body", b""))
                return message

            try:
                await self.app(scope, counted, send)
            finally:
                if received >= TRIM_AFTER_BYTES:  # the parsed body's memory goes back to the OS, not to a high-water
                    _release_memory()
            return
        await self.app(scope, receive, send)

    def refusal(self, headers: Any) -> tuple[dict, int] | None:
        origin = headers.get("origin")
        if origin is not None and "*" not in self.origins and origin not in self.origins:
            return error_body(f"a request from the web page origin {origin!r} is refused: start the server with "
                              f"--cors-origin {origin} to allow that page", "permission_error",
                              code="origin_not_allowed"), 403
        if self.loopback_only and not loopback_host(headers.get("host", "")):
            return error_body("the Host header names another machine, and this server listens on a loopback address "
                              "only: call it as localhost or 127.0.0.1 (DNS rebinding is refused)", "permission_error",
                              code="host_not_allowed"), 403
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return error_body(f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB"), 413
        return None


def _release_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim): a large request body parsed into many small
    objects leaves the heap fragmented, and the process's resident memory would keep that peak."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        pass


def _has_lone_surrogate(data: Any) -> bool:
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
