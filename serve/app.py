"""The HTTP face: OpenAI's chat and completion endpoints, /v1/models and /health, over one loaded pair.

Each endpoint is a function of the request and the app's state (`Served`: the pair, its generation thread, what a
request is checked against). Requests are checked (types, sizes, the prompt against the context) on arrival and
refused with an OpenAI error body at once (serve/reading.py reads the body); what passes queues for the one generation
thread (serve/worker.py). serve/replies.py answers: streaming replies are server-sent events ending in `data: [DONE]`,
as OpenAI's. A client that leaves stops its generation after the current token.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from edge.serve.gate import Gate
from edge.serve.limits import BODY_TIMEOUT_S
from edge.serve.reading import BodyBounds, describe, read_body
from edge.serve.replies import stream, whole
from edge.serve.schemas import ChatRequest, CompletionRequest, GenerationRequest, Refused, Reply, error_body
from edge.serve.worker import GenerationFailed, Work, Worker
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from edge.errors import ContextFull, UserError
from edge.generate import check_fits

if TYPE_CHECKING:
    from edge.models.pair import Pair

SHUTDOWN_GRACE_S = 4.0  # on shutdown a stream has this long to send its error event and [DONE] (uvicorn waits 5 s)
ENDPOINTS = ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health"]


@dataclass
class Served:
    """The app's state: the pair served, its generation thread, and what each request is checked against."""

    pair: Pair
    worker: Worker
    api_keys: Sequence[str] = ()  # none: anyone may ask; one: every client is one principal; more: each a principal
    body_timeout_s: float = BODY_TIMEOUT_S
    created: int = field(default_factory=lambda: int(time.time()))
    name: str = field(init=False)
    n_ctx: int = field(init=False)
    longest_token: int = field(init=False)  # bytes of the vocabulary's longest token (refuse_oversized)
    body_bounds: BodyBounds = field(init=False)  # what a body may hold, from the context (serve/reading.py)

    def __post_init__(self) -> None:
        self.name, self.n_ctx = self.pair.name, self.pair.target.n_ctx
        tokenizer = self.pair.target.tokenizer
        texts = [tokenizer.token_bytes(token) for token in range(self.pair.target.n_vocab)]
        self.longest_token = max(map(len, texts))
        self.body_bounds = BodyBounds.for_context(self.n_ctx, texts)

    def authorize(self, authorization: str) -> str | None:
        """The principal the request's key names (None: the server's one principal), or a 401. Every key is compared,
        in constant time, whichever matches."""
        if not self.api_keys:
            return None
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode("latin-1", "replace")  # the header's own bytes (HTTP decodes it as latin-1)
        matched = [secrets.compare_digest(given, key.encode("utf-8")) for key in self.api_keys]
        if scheme.lower() != "bearer" or not any(matched):
            raise Refused(401, "a missing or wrong API key: send the header `Authorization: Bearer KEY` with a key "
                               "the server was started with (--api-key)", code="invalid_api_key")
        return principal(self.api_keys[matched.index(True)]) if len(self.api_keys) > 1 else None

    def check_model(self, asked: str | None) -> None:
        if asked is not None and asked != self.name:
            raise Refused(404, f"the model {asked!r} is not served here: this server serves {self.name!r} "
                               "(GET /v1/models)", "model", "model_not_found")

    def model_entry(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "edge-spec",
                "context_length": self.n_ctx, "chat_template": self.pair.template is not None}

    def refuse_oversized(self, prompt: Any, raw: bool) -> None:
        """Refuse, before rendering or tokenizing, a prompt that cannot fit the context whatever its tokens: more
        messages than the context has tokens (each takes one at least), or more text than n_ctx of the vocabulary's
        longest tokens hold."""
        if isinstance(prompt, str):
            texts = [prompt]
        elif prompt and isinstance(prompt[0], dict):
            if len(prompt) >= self.n_ctx:
                raise Refused(400, f"{len(prompt)} messages cannot fit this server's context of {self.n_ctx} tokens: "
                                   "send fewer", "messages", "context_length_exceeded")
            texts = [message["content"] for message in prompt]
        else:
            return  # token ids: counted as they are
        size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
        if size > self.n_ctx * self.longest_token:
            raise Refused(400, f"the prompt's {size} bytes of text are more than this server's context of "
                               f"{self.n_ctx} tokens can hold: shorten it, or restart the server with a larger --ctx",
                          "prompt" if raw else "messages", "context_length_exceeded")

    async def prepare(self, body: GenerationRequest, prompt: Any, raw: bool, max_tokens: int | None,
                      principal: str | None = None) -> Work:
        """The request as work for the generation thread: checked, its prompt rendered and tokenized (off the event
        loop), and refused here if it cannot fit the context. Sampling a request leaves out is the pair's (the model's
        recommended, else llama.cpp's), with no repetition penalty unless the model recommends one, as OpenAI's API
        and llama-server."""
        self.check_model(body.model)
        body.refuse_unsupported()
        self.refuse_oversized(prompt, raw)
        try:
            sampling = body.sampling(self.pair.sampling)
            stop = body.stop_strings()
            tokens = await run_in_threadpool(self.pair.prompt_tokens, prompt, raw)
        except UserError as problem:
            raise Refused(400, str(problem), problem.option) from None
        n_vocab = self.pair.target.n_vocab
        if not tokens:
            raise Refused(400, "the prompt is empty", "prompt")
        if any(not 0 <= token < n_vocab for token in tokens):
            raise Refused(400, f"a token id of the prompt is outside the vocabulary (0 to {n_vocab - 1})", "prompt")
        try:
            check_fits(tokens, self.n_ctx)
        except ContextFull:
            raise Refused(400, f"the prompt is {len(tokens)} tokens but this server's context holds {self.n_ctx}: "
                               "shorten it, or restart the server with a larger --ctx",
                          "prompt" if raw else "messages", "context_length_exceeded") from None
        room = self.n_ctx - len(tokens)
        return Work(tokens, sampling, room if max_tokens is None else min(max_tokens, room), stop, principal)

    async def respond(self, reply: Reply, body: GenerationRequest, work: Work, request: Request) -> Any:
        try:
            job = self.worker.submit(work)
        except GenerationFailed as problem:
            raise Refused(problem.status, str(problem), kind="server_error") from None
        if body.stream:
            # On shutdown the worker ends every job; the stream then sends its error event and [DONE] itself.
            events = stream(reply, job, body.include_usage, bool(body.return_tokens))
            return EventSourceResponse(events, sep="\n", ping=15, shutdown_event=anyio.Event(),
                                       shutdown_grace_period=SHUTDOWN_GRACE_S)
        return await whole(reply, job, request, bool(body.return_tokens))


def served(request: Request) -> Served:
    return request.app.state.served


def principal(key: str) -> str:
    """A key's principal, as the pair keeps its state apart: a digest, so the key itself is kept nowhere else."""
    return "key " + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


async def authorize(request: Request) -> None:
    request.state.principal = served(request).authorize(request.headers.get("authorization", ""))


public = APIRouter()  # no API key asked
api = APIRouter(dependencies=[Depends(authorize)])


@public.get("/health")
async def health(request: Request) -> dict[str, Any]:
    import psutil

    state = served(request)
    worker = state.worker
    return {"status": "ok", "model": state.name,
            "queue": {"running": worker.running, "waiting": worker.waiting},
            "requests": {"completed": worker.completed, "cancelled": worker.cancelled, "failed": worker.failed},
            "rss_bytes": psutil.Process().memory_info().rss}


@api.get("/")
async def root(request: Request) -> dict[str, Any]:
    return {"name": "edge-spec", "model": served(request).name, "api": "/v1", "endpoints": ENDPOINTS}


@api.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> dict[str, Any]:
    return request.app.openapi()


@api.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [served(request).model_entry()]}


@api.get("/v1/models/{name:path}")
async def one_model(name: str, request: Request) -> dict[str, Any]:
    served(request).check_model(name)
    return served(request).model_entry()


@api.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    state = served(request)
    body = await read_body(request, ChatRequest, state.body_bounds, state.body_timeout_s)
    if state.pair.template is None:
        state.check_model(body.model)
        raise Refused(400, f"{state.name} has no chat template (a base model): use /v1/completions to complete "
                           "text", "messages", "no_chat_template")
    work = await state.prepare(body, body.template_messages(), False, body.reply_tokens(), request.state.principal)
    return await state.respond(Reply("chat", state.name), body, work, request)


@api.post("/v1/completions")
async def completions(request: Request) -> Any:
    state = served(request)
    body = await read_body(request, CompletionRequest, state.body_bounds, state.body_timeout_s)
    work = await state.prepare(body, body.one_prompt(), True, body.reply_tokens(), request.state.principal)
    return await state.respond(Reply("text", state.name), body, work, request)


async def invalid(_request: Request, problem: RequestValidationError) -> JSONResponse:
    return JSONResponse(error_body(*describe(problem.errors())), 400)


async def refused(_request: Request, problem: Refused) -> JSONResponse:
    return JSONResponse(problem.body(), problem.status)


async def http_error(request: Request, problem: HTTPException) -> JSONResponse:
    if problem.status_code == 404:
        return JSONResponse(error_body(f"no such endpoint: {request.method} {request.url.path} (GET / lists them)",
                                       "not_found_error"), 404)
    return JSONResponse(error_body(str(problem.detail)), problem.status_code, headers=problem.headers)


def create_app(pair: Pair, worker: Worker, api_keys: Sequence[str] = (),
               cors_origins: Sequence[str] = (), loopback_only: bool = False,
               body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The app over `pair`. A request from a web page (its Origin header) is served only from `cors_origins` ("*":
    any); `loopback_only` (a server bound to a loopback address) also refuses a Host header that names another
    machine (DNS rebinding). With `api_keys`, every endpoint but /health asks for one, the OpenAPI document too; with
    several, each key is a principal whose prompt cache, tree statistics and earlier replies are its own."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("edge-spec")
    except PackageNotFoundError:
        release = "0"
    app = FastAPI(title="edge-spec", version=release, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = state = Served(pair, worker, tuple(api_keys), body_timeout_s)
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        # any request header: OpenAI's JS SDK sends its own (x-stainless-*, openai-*) and preflights them
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    # outside CORS: it runs first
    app.add_middleware(Gate, origins=set(cors_origins), loopback_only=loopback_only, bounds=state.body_bounds)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(Refused, refused)
    app.add_exception_handler(HTTPException, http_error)
    app.include_router(public)
    app.include_router(api)
    return app
