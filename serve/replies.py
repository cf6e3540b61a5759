"""A job's steps as the client asked for them: one JSON reply (a client that leaves cancels its job) or server-sent
events ending in `data: [DONE]`, as OpenAI's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from edge.serve.schemas import FINISH_REASONS, Reply, edge_stats, error_body
from edge.serve.worker import GenerationFailed, Job
from fastapi.responses import JSONResponse
from starlette.requests import Request

from edge.generate import Stats

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


async def whole(reply: Reply, job: Job, request: Request, return_tokens: bool = False) -> JSONResponse:
    """A non-streamed reply (with `return_tokens`, its token ids too); a client that leaves meanwhile cancels its
    job."""
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
    return JSONResponse(reply.whole(text, FINISH_REASONS[finish], len(tokens), stats,
                                    tokens if return_tokens else None))


async def _collect(job: Job) -> tuple[str, list[int], str, Stats]:
    """The reply's text, its token ids, its finish reason and figures."""
    pieces, tokens = [], []
    async for step in job.steps():
        pieces.append(step.text)
        if step.token is not None and step.finish_reason is None:
            tokens.append(step.token)
        if step.finish_reason is not None:
            return "".join(pieces), tokens, step.finish_reason, step.stats
    raise AssertionError("a job's steps end with a finish reason")


async def stream(reply: Reply, job: Job, include_usage: bool, return_tokens: bool = False) -> AsyncIterator[str]:
    """Server-sent events: a first chunk at once (chat: the role), one per piece of text, the last with the finish
    reason and edge-spec's figures, the usage if asked for, then [DONE]. With `return_tokens`, each piece carries the
    token ids generated since the last one (a token whose text is held back, part of a UTF-8 sequence, goes with the
    piece that shows it). Leaving (disconnecting) cancels the job."""
    tokens = 0
    held: list[int] = []  # token ids not sent yet

    def ids() -> list[int] | None:  # the ids not sent yet, where asked for
        if not return_tokens:
            return None
        sent, held[:] = list(held), []
        return sent

    try:
        yield json.dumps(reply.chunk("" if reply.kind == "chat" else None, first=True))
        async for step in job.steps():
            if step.token is not None and step.finish_reason is None:
                tokens += 1
                if return_tokens:
                    held.append(step.token)
            if step.finish_reason is None:
                if step.text:
                    yield json.dumps(reply.chunk(step.text, tokens=ids()))
                continue
            if step.finish_reason == "interrupted":
                yield json.dumps(error_body("the generation was stopped (the server is shutting down)",
                                            "server_error"))
                yield "[DONE]"
                return
            if step.text:
                yield json.dumps(reply.chunk(step.text, tokens=ids()))
            yield json.dumps(reply.chunk(None, FINISH_REASONS[step.finish_reason], tokens=ids(),
                                         edge_spec=edge_stats(step.stats)))
            if include_usage:
                yield json.dumps(reply.usage_chunk(step.stats, tokens))
        yield "[DONE]"
    except GenerationFailed as problem:  # an error event, then [DONE]: clients that wait for it end cleanly
        kind = "server_error" if problem.status >= 500 else "invalid_request_error"
        yield json.dumps(error_body(str(problem), kind))
        yield "[DONE]"
    finally:
        job.cancel()
