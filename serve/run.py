"""Running the server: the port is bound before the models load (a port in use costs no load), then uvicorn serves
the app on that socket until Ctrl-C, which stops the generation in progress and closes the pair."""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from edge.serve.hosts import is_loopback
from edge.serve.limits import BODY_TIMEOUT_S, HEAD_TIMEOUT_S

from edge.errors import UserError

if TYPE_CHECKING:
    from edge.models.pair import Pair

KEEP_ALIVE_S = 5  # an idle kept-alive connection is closed after this (uvicorn's default)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free port), or one line saying why not."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be 0 to 65535 (got {port})")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as problem:
        raise UserError(f"cannot listen on {host!r}: not an address or a known host name ({problem.strerror}); "
                        "use 127.0.0.1, or 0.0.0.0 for every interface") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(128)
    except OSError as problem:
        sock.close()
        if problem.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is in use (another server?): stop it, or pick another port with "
                            "--port") from None
        if problem.errno == errno.EACCES:
            raise UserError(f"not allowed to listen on port {port} (ports below 1024 need root): pick another with "
                            "--port, e.g. 8080") from None
        if problem.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"{host} is not an address of this machine: use 127.0.0.1, or 0.0.0.0 for every "
                            "interface") from None
        raise UserError(f"cannot listen on {host}:{port}: {problem.strerror}") from None
    sock.set_inheritable(True)
    return sock


def url(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    shown = host.strip("[]") if host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def serve(pair: Pair, sock: socket.socket, *, api_keys: Sequence[str] = (), cors_origins: Sequence[str] = (),
          speculate: bool = True, budget: int | str | None = None, log_level: str = "info",
          ready: Callable[[], None] | None = None, head_timeout_s: float = HEAD_TIMEOUT_S,
          body_timeout_s: float = BODY_TIMEOUT_S, parallel: int = 1) -> None:
    """Serve `pair` on `sock` until Ctrl-C (or SIGTERM); closes the socket, not the pair. A client has
    `head_timeout_s` to send a request's head and `body_timeout_s` its body; `parallel` requests decode together."""
    import uvicorn
    from edge.serve.app import create_app
    from edge.serve.worker import Worker

    worker = Worker(pair, speculate, budget, parallel)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # the first Ctrl-C: stop generating, then shut down
            worker.close(timeout=0)
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if ready is not None and not self.should_exit:
                ready()

    bound = sock.getsockname()[0]
    app = create_app(pair, worker, api_keys, cors_origins, loopback_only=is_loopback(str(bound)),
                     body_timeout_s=body_timeout_s)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="off",
                            log_config=_log_config(log_level), http=_guarded_protocol(head_timeout_s),
                            timeout_keep_alive=KEEP_ALIVE_S)
    try:
        Server(config).run(sockets=[sock])
    finally:
        worker.close()
        sock.close()


def _guarded_protocol(head_timeout_s: float = HEAD_TIMEOUT_S) -> type:
    """uvicorn's h11 protocol with a deadline on each request's head: a connection that has not sent a whole
    request line and headers `head_timeout_s` after it opened (or after its last reply) is closed. uvicorn's own
    keep-alive timer restarts on every byte, so a client trickling a byte a second would hold a connection for
    ever; this deadline does not move. The body has its own bound (BODY_TIMEOUT_S, serve/reading.py)."""
    import asyncio

    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Guarded(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a whole head arrived: the request runs

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is None or self.cycle.response_complete:  # (a pipelined request may have begun)
                self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(head_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return Guarded


def _log_config(level: str) -> dict[str, Any]:
    """uvicorn's loggers and edge-spec's own (edge.serve) on stderr, one line per event."""
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "plain"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(message)s", "datefmt": "%H:%M:%S"}},
        "handlers": {"stderr": handler},
        "loggers": {name: {"handlers": ["stderr"], "level": level.upper(), "propagate": False}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "edge.serve")},
    }


logging.getLogger("edge.serve").addHandler(logging.NullHandler())
