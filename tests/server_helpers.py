"""What the server tests share: the key and model they serve, and raw HTTP for what the openai client would never
send (tests/test_server.py, tests/test_server_limits.py)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from benchmarks.serve_process import ServerProcess

KEY = "test-key-1234"
MODEL = "smollm2-135m"
PROMPT = "Name three colors."
# The small pair with a fixed tree budget (so every request runs trees) and an API key; sample-and-match, so that a
# seed gives plain sampling's exact text (greedy replies are the same under every rule).
SERVER_ARGS = [MODEL, "--budget", "16", "--ctx", "1024", "--api-key", KEY, "--accept", "match", "--parallel", "1"]


def request(server: ServerProcess, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """Raw HTTP, for what the openai client would never send."""
    url = urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    connection.request(method, path, body, {"Authorization": f"Bearer {KEY}", **(headers or {})})
    response = connection.getresponse()
    status, data = response.status, json.loads(response.read())
    connection.close()
    return status, data


def health(server: ServerProcess) -> dict:
    return request(server, "GET", "/health")[1]


def open_stream(server: ServerProcess, content: str, max_tokens: int) -> http.client.HTTPConnection:
    """A streamed greedy chat request left open (greedy: it runs all `max_tokens`); read with getresponse()."""
    url = urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    return connection


def wait_for(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def raw(server: ServerProcess, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, dict]:
    """Raw HTTP with exactly these headers (http.client adds Host unless one is given)."""
    url = urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    connection.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
    for name, value in {**headers, **({"Content-Length": str(len(body))} if body is not None else {})}.items():
        connection.putheader(name, value)
    connection.endheaders(body)
    response = connection.getresponse()
    status, text = response.status, response.read()
    is_json = (response.getheader("content-type") or "").startswith("application/json")
    connection.close()
    return status, json.loads(text) if is_json else {}
