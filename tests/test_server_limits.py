"""`edge-spec serve` against careless and hostile clients, as a real server process: malformed bodies, web pages
and rebound host names, prompts that cannot fit, oversized chunked bodies, slow and idle connections, shutdown with
requests in flight, and a model file changed under the server. Each gets its documented answer (docs/server.md) and
the log no traceback."""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from edge.serve.reading import FRAME_BYTES, TOKEN_FRAME_BYTES, BodyBounds, json_values

from benchmarks.serve_process import ServerProcess
from tests.server_helpers import KEY, MODEL, SERVER_ARGS, health, open_stream, raw, request, wait_for


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(SERVER_ARGS) as running:
        yield running
    assert running.process.returncode == 130, running.log[-3000:]
    assert "Traceback" not in running.log and '" 500' not in running.log, running.log[-3000:]


@pytest.fixture(scope="module")
def impatient() -> Iterator[ServerProcess]:
    """A server whose clients have 2 s for a request's head and 3 s for its body (--head-timeout, --body-timeout)."""
    with ServerProcess([*SERVER_ARGS, "--head-timeout", str(HEAD_S), "--body-timeout", str(BODY_S)]) as running:
        yield running
    assert running.process.returncode == 130, running.log[-3000:]
    assert "Traceback" not in running.log and '" 500' not in running.log, running.log[-3000:]


HEAD_S, BODY_S = 2, 3


def test_slow_and_idle_connections_are_closed(impatient: ServerProcess) -> None:
    """A connection that has sent no whole request head --head-timeout after it opened is closed, idle or trickling
    a byte at a time (uvicorn's keep-alive timer restarts on every byte); a body that does not arrive whole within
    --body-timeout gets a JSON 408. Others are served meanwhile."""
    import socket

    server = impatient
    url = urlsplit(server.url)
    address = (url.hostname, url.port)
    idle = [socket.create_connection(address) for _ in range(10)]
    slow = [socket.create_connection(address) for _ in range(10)]
    body_left = socket.create_connection(address)
    body_left.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messa".encode())
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {KEY}\r\n".encode()
    started = time.monotonic()
    sent = 0
    while time.monotonic() - started < max(HEAD_S, BODY_S) + 2:
        for connection in slow:
            with contextlib.suppress(OSError):
                connection.send(head[sent:sent + 1])
        sent += 1
        time.sleep(0.25)
    assert sent < len(head)  # no head was ever whole
    assert health(server)["status"] == "ok"
    for connection in idle + slow:
        connection.settimeout(10)
        with contextlib.suppress(ConnectionResetError):  # (a reset is closed too)
            assert connection.recv(100) == b""  # closed by the server
        connection.close()
    body_left.settimeout(10)
    answer = body_left.recv(4096)
    body_left.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within" in answer, answer


def test_shutdown_answers_every_request_then_exits_130() -> None:
    """Ctrl-C with one stream running, one stream and one whole reply queued: the running stream and the queued one
    get an error event then [DONE], the queued whole reply a JSON 503; the server exits with 130, no traceback."""
    with ServerProcess([MODEL, "--budget", "4", "--ctx", "1024", "--api-key", KEY, "--parallel", "1"]) as running:
        first = open_stream(running, "Write a very long story about a dragon.", 1000)
        first_reply = first.getresponse()
        assert first_reply.readline().startswith(b"data:")
        queued_stream = open_stream(running, "Write a very long story about a knight.", 1000)
        url = urlsplit(running.url)
        queued_whole = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        queued_whole.request("POST", "/v1/chat/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
        wait_for(lambda: health(running)["queue"]["waiting"] == 2, 60)
        assert health(running)["queue"]["waiting"] == 2
        running.process.send_signal(signal.SIGINT)
        whole = queued_whole.getresponse()
        assert whole.status == 503 and "shutting down" in json.loads(whole.read())["error"]["message"]
        for reply in (first_reply, queued_stream.getresponse()):
            events = [line.strip() for line in reply.read().splitlines() if line.startswith(b"data:")]
            assert events[-1] == b"data: [DONE]" and b"shutting down" in events[-2] and b'"error"' in events[-2], \
                events[-3:]
        assert running.process.wait(30) == 130
    assert "Traceback" not in running.log and '" 500' not in running.log, running.log[-3000:]


@pytest.mark.parametrize(("body", "status", "says"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"}).encode(), 400,
     "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400, "messages.0.content"),
    (json.dumps({"messages": [{"role": "robot", "content": "Hi"}]}).encode(), 400, "messages.0.role"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "n": 2}).encode(), 400, "n=2"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]}).encode(), 400,
     "tools"),
    (json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}]}).encode(), 404, "gpt-4o"),
    (json.dumps({"messages": [{"role": "user", "content": "word " * 2000}]}).encode(), 400, "context holds 1024"),
    (b"[" * 5000, 400, "nests JSON arrays or objects too deeply"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": ' + b"9" * 5000 + b"}", 400,
     "cannot be read"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "lone UTF-16 surrogate"),
    # refused from its Content-Length, before it is read: parsing and validating it held the event loop for seconds
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1_000_000}]}).encode(),
     413, "is 31000045 bytes, more than a request to this server can need (1198080 bytes: its context holds 1024"),
    # within the byte bound, refused from a count of its JSON values before it is parsed
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 20_000}]}).encode(),
     400, "holds 60004 JSON values, more than a request to this server can need (8192"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "stop": [1] * 200_000}).encode(), 400,
     "holds 200005 JSON values"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0.8,
                 "repeat_penalty": 1e-300}).encode(), 400, "repeat_penalty"),
    # counted before their items are validated: an error for each of millions of items held the event loop for minutes
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "stop": [1] * 4000}).encode(), 400,
     "stop: at most 16 stop strings (got 4000)"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {str(i): 1 for i in range(4000)}})
     .encode(), 400, "logit_bias: logit_bias is not supported"),
])
def test_bad_requests_get_one_clear_error(server: ServerProcess, body: bytes, status: int, says: str) -> None:
    got, data = request(server, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert got == status and says in data["error"]["message"], data
    assert set(data["error"]) == {"message", "type", "param", "code"}


def test_web_pages_and_rebound_names_are_refused(server: ServerProcess) -> None:
    """A page's cross-origin "simple request" (text/plain, no preflight) and a rebound Host are refused before any
    work, with OpenAI's error body; curl's request (no Origin, a loopback Host) is served; the OpenAPI document
    asks for the key."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    key = {"Authorization": f"Bearer {KEY}"}
    before = health(server)["requests"]["completed"]
    status, answer = raw(server, "POST", "/v1/chat/completions", body,
                         {**key, "Origin": "http://evil.example", "Content-Type": "text/plain"})
    assert status == 403 and answer["error"]["code"] == "origin_not_allowed", answer
    port = urlsplit(server.url).port
    status, answer = raw(server, "POST", "/v1/chat/completions", body,
                         {**key, "Host": f"attacker.example:{port}", "Content-Type": "application/json"})
    assert status == 403 and answer["error"]["code"] == "host_not_allowed", answer
    assert health(server)["requests"]["completed"] == before  # nothing ran
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        status, answer = raw(server, "POST", "/v1/chat/completions", body,
                             {**key, "Host": host, "Content-Type": "application/json"})
        assert status == 200 and answer["choices"][0]["message"]["content"] is not None
    assert raw(server, "GET", "/openapi.json", None, {})[0] == 401
    status, document = raw(server, "GET", "/openapi.json", None, key)
    assert status == 200 and "/v1/chat/completions" in document["paths"]


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_rendered(server: ServerProcess) -> None:
    """2,000 messages, or 1 MB of text, against a 1024-token context: refused as too long from their counts, not
    after minutes of rendering and tokenizing; 4 MB of text, from the body's size before it is read. The server
    answers the next request at once."""
    many = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 2000, "max_tokens": 1}
    status, answer = request(server, "POST", "/v1/chat/completions", json.dumps(many).encode(),
                             {"Content-Type": "application/json"})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert "2000 messages" in answer["error"]["message"]
    for words, status_then in ((200_000, 400), (800_000, 413)):
        big = {"model": MODEL, "prompt": "word " * words, "max_tokens": 1}
        status, answer = request(server, "POST", "/v1/completions", json.dumps(big).encode(),
                                 {"Content-Type": "application/json"})
        assert status == status_then and answer["error"]["code"] == "context_length_exceeded", answer
    assert health(server)["queue"] == {"running": 0, "waiting": 0}


def test_a_chunked_body_past_the_bound_is_refused(server: ServerProcess) -> None:
    """A body with no Content-Length (chunked) is counted as it arrives: past what the context can need, 413."""
    url = urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    piece = b" " * (1 << 20)
    connection.request("POST", "/v1/chat/completions", body=iter([b'{"messages": ['] + [piece] * 40),
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                       encode_chunked=True)
    try:
        response = connection.getresponse()
        status, answer = response.status, json.loads(response.read())
    except (BrokenPipeError, ConnectionResetError):  # the server answered and closed before all 40 MiB were sent
        status, answer = 413, {"error": {"message": "runs past 1198080 bytes"}}
    connection.close()
    assert status == 413 and "runs past 1198080 bytes" in answer["error"]["message"], answer
    assert health(server)["status"] == "ok"


def test_the_body_bounds_hold_the_largest_requests_the_context_takes() -> None:
    """The worst a real client sends for a full context fits the bounds: n_ctx of the vocabulary's longest token as a
    message escaped to ASCII, n_ctx token ids pretty-printed, one message a token; one byte or value more than the
    bounds allow is refused."""
    vocabulary = [b"a" * 81, "\u00e9".encode() * 30, b"\x01" * 12, b"\n" * 40]  # escaped: 81, 180, 72, 80 bytes
    n_ctx = 512
    bounds = BodyBounds.for_context(n_ctx, vocabulary)
    widest = vocabulary[1].decode() * n_ctx
    largest = [json.dumps({"model": "m" * 256, "messages": [{"role": "user", "content": widest}],
                           "stop": ["x" * 64] * 16, "metadata": {f"key{i}": "v" * 512 for i in range(16)},
                           "user": "u" * 256}, indent=4),
               json.dumps({"prompt": [151_642] * n_ctx, "max_tokens": 1}, indent=8),
               json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a" * 81}]}] * n_ctx},
                          indent=2)]
    for body in largest:
        assert len(body.encode()) <= bounds.bytes and json_values(body.encode(), 0) <= bounds.values
    assert bounds.bytes == FRAME_BYTES + n_ctx * (180 + TOKEN_FRAME_BYTES)
    assert json_values(json.dumps([1] * bounds.values).encode(), 0) == bounds.values  # taken
    assert json_values(json.dumps([1] * (bounds.values + 1)).encode(), bounds.values) == bounds.values + 1  # refused


def test_a_model_file_changed_under_the_server_is_refused_and_the_server_stays_up(tmp_path: Path) -> None:
    """`cp new.gguf live.gguf` under a running server (here: a byte of the file rewritten in place): the next
    request gets a 503 that says so, in one line, with no traceback in the log; the server keeps answering."""
    import shutil

    from edge.models.registry import load_registry
    from edge.models.sources import model_path

    live = tmp_path / "live.gguf"
    shutil.copyfile(model_path(load_registry().pair(MODEL).target), live)
    with ServerProcess([str(live), "--drafter", "lookup", "--ctx", "512", "--api-key", KEY]) as running:
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
        assert request(running, "POST", "/v1/chat/completions", body)[0] == 200
        size = live.stat().st_size
        time.sleep(0.05)  # past the filesystem's timestamp granularity
        with live.open("r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(byte)
        status, data = request(running, "POST", "/v1/chat/completions", body)
        assert status == 503 and "changed on disk since" in data["error"]["message"], data
        assert health(running)["status"] == "ok"
    assert "Traceback" not in running.log and running.log.count("changed on disk since") == 1, running.log[-3000:]
