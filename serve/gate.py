"""What the server refuses before any endpoint runs (a web page's origin, a rebinding Host header, an oversized body),
as plain ASGI."""

from __future__ import annotations

from typing import Any

from edge.serve.hosts import loopback_host
from edge.serve.reading import BodyBounds
from edge.serve.schemas import error_body
from fastapi.responses import JSONResponse

TRIM_AFTER_BYTES = 1 << 20  # after a request body this large, freed memory is handed back to the OS


class Gate:
    """What is refused before any endpoint runs, as plain ASGI (a BaseHTTPMiddleware would hide a client's
    disconnect from the endpoint, which then could not cancel its generation):

    - a web page's request, unless --cors-origin allows its origin: a browser sends a cross-origin POST of
      text/plain with no preflight, and CORS only hides the reply, after the work;
    - with `loopback_only`, a Host header that names another machine (a page reaching us by DNS rebinding);
    - a body whose Content-Length is past what a request to this context can need (BodyBounds; a chunked one is
      counted as it is read: serve/reading.py)."""

    def __init__(self, app: Any, origins: set[str], loopback_only: bool, bounds: BodyBounds) -> None:
        self.app, self.origins, self.loopback_only, self.bounds = app, origins, loopback_only, bounds

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
                    release_memory()
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
        if length is not None and not length.isdigit():
            return error_body(f"the Content-Length header {length[:32]!r} is not a number of bytes"), 400
        if length is not None and int(length) > self.bounds.bytes:
            return self.bounds.too_large(int(length)).body(), 413
        return None


def release_memory() -> None:
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
