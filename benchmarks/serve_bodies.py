"""How `edge-spec serve` holds up while large hostile bodies arrive: each body's answer (status, message, seconds) and
/health's latency meanwhile, polled every 20 ms from another connection (the server's event loop must keep answering;
parsing a body there would stall it).

    python benchmarks/serve_bodies.py                        # the default pair's server, at its context
    python benchmarks/serve_bodies.py --pair smollm2-135m --server-args "--ctx 512" --scale 0.1

The bodies (sizes at --scale 1): a million content parts (31 MB), fifteen million stop items (28 MiB), 31 MB of
text, the same text chunked (no Content-Length), then two just within the server's byte bound: text, and numbers
(refused by its count of JSON values). Each must be refused with a 4xx; `health_ms` gives /health's latency during
each, and `idle_health_ms` before any.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator

CHAT = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4'


def bodies(scale: float, bound: int) -> Iterator[tuple[str, bytes, bool]]:
    """(name, body, chunked) for each hostile body."""
    parts = int(1_000_000 * scale)
    yield "content_parts", json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] *
                                                                              parts}]}).encode(), False
    yield "stop_items", CHAT + b', "stop": [' + b",".join([b"1"] * int(15_000_000 * scale)) + b"]}", False
    text = json.dumps({"messages": [{"role": "user", "content": "word, " * int(31_000_000 * scale / 6)}],
                       "max_tokens": 4}).encode()
    yield "text", text, False
    yield "text_chunked", text, True
    packed = (bound - len(CHAT) - 16) // 2
    yield "text_within_bound", json.dumps({"messages": [{"role": "user", "content": "word, " * ((bound - 200) // 6)}],
                                           "max_tokens": 4}).encode(), False
    yield "packed_values", CHAT + b', "stop": [' + b",".join([b"1"] * packed) + b"]}", False


def health_ms(url: urllib.parse.SplitResult) -> float:
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    start = time.perf_counter()
    connection.request("GET", "/health")
    connection.getresponse().read()
    connection.close()
    return 1000 * (time.perf_counter() - start)


def send(url: urllib.parse.SplitResult, body: bytes, chunked: bool) -> tuple[int, str]:
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    headers = {"Content-Type": "application/json"}
    try:
        if chunked:
            pieces = (body[i:i + (1 << 16)] for i in range(0, len(body), 1 << 16))
            connection.request("POST", "/v1/chat/completions", pieces, headers, encode_chunked=True)
        else:
            connection.request("POST", "/v1/chat/completions", body, headers)
        response = connection.getresponse()
        status, text = response.status, response.read()
    except (BrokenPipeError, ConnectionResetError) as problem:  # the server answered and closed mid-body
        return 0, f"connection closed while sending: {problem}"
    finally:
        connection.close()
    try:
        return status, json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return status, text[:200].decode("utf-8", "replace")


def summary(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {"polls": len(ordered), "median": round(statistics.median(ordered), 1),
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1), "max": round(ordered[-1], 1)}


def measure(base: str, scale: float) -> dict:
    url = urllib.parse.urlsplit(base)
    idle = [health_ms(url) for _ in range(20)]
    # the byte bound the server derives from its context: its 413 for an oversized Content-Length names it
    probe = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    probe.putrequest("POST", "/v1/chat/completions")
    probe.putheader("Content-Length", str(1 << 40))
    probe.endheaders()
    message = json.loads(probe.getresponse().read())["error"]["message"]
    probe.close()
    bound = int(message.split("(")[1].split(" bytes")[0])
    rows = []
    for name, body, chunked in bodies(scale, bound):
        latencies: list[float] = []
        done = threading.Event()

        def poll(into: list[float] = latencies, until: threading.Event = done) -> None:
            while not until.is_set():
                into.append(health_ms(url))
                time.sleep(0.02)

        poller = threading.Thread(target=poll)
        poller.start()
        start = time.perf_counter()
        status, said = send(url, body, chunked)
        took = time.perf_counter() - start
        time.sleep(0.2)
        done.set()
        poller.join()
        rows.append({"body": name, "bytes": len(body), "chunked": chunked, "status": status, "message": said[:160],
                     "answered_s": round(took, 3), "health_ms": summary(latencies)})
    return {"body_bound_bytes": bound, "idle_health_ms": summary(idle), "bodies": rows,
            "worst_health_ms": max(row["health_ms"]["max"] for row in rows),
            "all_refused": all(400 <= row["status"] < 500 for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="serve_bodies.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a server already running, with no API key (default: start one for --pair)")
    parser.add_argument("--pair", default=None, help="the pair to serve when starting one (default: the default)")
    parser.add_argument("--server-args", default="", help="more `edge-spec serve` options, e.g. '--ctx 512'")
    parser.add_argument("--scale", type=float, default=1.0, help="the hostile bodies' size, 1 = about 30 MB each")
    args = parser.parse_args()
    if not 0 < args.scale <= 4:
        parser.error("--scale must be above 0 and at most 4")
    if args.url:
        result = measure(args.url.rstrip("/"), args.scale)
    else:
        from serve_process import ServerProcess  # benchmarks/, the script's folder

        server_args = ([args.pair] if args.pair else []) + args.server_args.split()
        with ServerProcess(server_args) as server:
            result = measure(server.url, args.scale)
        result["server_args"] = server_args
        result.update(server.faults())
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
