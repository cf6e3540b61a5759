"""Soak `edge-spec serve`: N streamed chat requests from K clients at once, for a bounded time. Reports requests per
second, time to first token (p50, p95), tokens per second, and the server's resident memory after its warm-up
request, every eighth of the run and at the end (growth in %): a server that leaks grows request after request,
native buffers that reach their high-water mark (KV pages touched, arenas) grow less and less, then stop.

    python benchmarks/serve_soak.py --clients 4 --requests 40            # starts the default pair's server
    python benchmarks/serve_soak.py --url http://127.0.0.1:8080 --clients 4 --requests 40   # one already running

Prompts cycle through the repo's chat prompts; sampling at temperature 0.8 with a seed per request, so runs repeat.

    python benchmarks/serve_soak.py --clients 4 --requests 200 --hostile 0.34   # a third of them hostile

With --hostile, that share of the requests are what a careless or hostile client sends (broken or deeply nested
JSON, numbers of 5,000 digits, lone surrogates, 100,000 messages, a web page's Origin, a rebound Host, a stream left
mid-reply, a head never finished, a flood of special tokens, ...): each must get its 4xx answer (or be dropped, for
a client that left). The valid requests then use 8 (prompt, seed) pairs, each first sent alone: every valid reply
under load must equal its single-client reply, token id for token id (`return_tokens`). The report adds the server
log's tracebacks and 500s (none allowed).

    python benchmarks/serve_soak.py --clients 4 --requests 48 --hostile 0.34 --keys 2 --max-tokens 32 \
        --server-args "--budget 16 --accept match"

With --keys K the server has K API keys (principals) and the clients take them in turn; afterwards the first key sends
a prompt holding a PIN and the last sends guesses sharing its first digits: `isolation.b_cached_tokens_after_a` must
be all 0 with two keys (with one key, one principal, it counts the matching digits: 9 / 10 / 11 / 12 / 13); with
--parallel N a lane keeps B's own earlier guess, which each guess shares one digit fewer with than with the PIN
(0 / 9 / 10 / 11 / 12: a leak would read 9 / 10 / 11 / 12 / 13).
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parent.parent


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rss(url: str) -> int:
    """The server's resident memory, from its /health."""
    with urllib.request.urlopen(url + "/health", timeout=60) as response:
        return int(json.load(response)["rss_bytes"])


def one_request(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, seed: int) -> dict:
    """A streamed sampled chat reply: timings, tokens, and the reply as its token ids (`return_tokens`; its text where
    the server gives no ids), which is what replies are compared by."""
    started = time.perf_counter()
    first = None
    usage = None
    text, ids = [], []
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0.8, seed=seed, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"return_tokens": True})
    for chunk in stream:
        if chunk.choices:
            ids.extend((chunk.choices[0].model_extra or {}).get("tokens") or [])
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.perf_counter()
    tokens = usage.completion_tokens if usage else 0
    reply = ("token ids", tuple(ids)) if len(ids) == tokens else ("text", "".join(text))
    return {"ttft_s": (first or ended) - started, "total_s": ended - started, "tokens": tokens, "reply": reply}


KEY_HEADER: dict[str, str] = {}  # --keys: the first principal's key, which hostile requests carry


def _raw(url: str, body: bytes, headers: dict[str, str] | None = None, path: str = "/v1/chat/completions") -> int:
    """POST `body` as it is; the status (the body must be an OpenAI error when it is not 200)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        connection.request("POST", path, body, {"Content-Type": "application/json", **KEY_HEADER, **(headers or {})})
        response = connection.getresponse()
        data = response.read()
        if response.status != 200:
            json.loads(data)["error"]["message"]
        return response.status
    finally:
        connection.close()


def _chat_body(**extra: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}).encode()


def _left_mid_stream(url: str) -> int:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    connection.request("POST", "/v1/chat/completions", _chat_body(stream=True, max_tokens=200),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    response.readline()
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    return 499  # (nginx's word for a client that left)


def _unfinished_head(url: str) -> int:
    parts = urllib.parse.urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        return 408 if sock.recv(100) == b"" else 200  # closed by the server's head deadline


HOSTILE: dict[str, Callable[[str], int]] = {
    "broken JSON": lambda url: _raw(url, b'{"messages": [{"role": "user", "content": "Hi"}'),
    "nested 100,000 deep": lambda url: _raw(url, b"[" * 100_000),
    "5,000-digit max_tokens": lambda url: _raw(url, b'{"messages": [{"role": "user", "content": "Hi"}], '
                                                    b'"max_tokens": ' + b"9" * 5000 + b"}"),
    "lone surrogate": lambda url: _raw(url, b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    "100,000 messages": lambda url: _raw(url, json.dumps(
        {"messages": [{"role": "user", "content": "x"}] * 100_000}).encode()),
    "a web page's Origin": lambda url: _raw(url, _chat_body(), {"Origin": "http://evil.example",
                                                                "Content-Type": "text/plain"}),
    "a rebound Host": lambda url: _raw(url, _chat_body(), {"Host": "attacker.example:8080"}),
    "repeat_penalty 1e-300": lambda url: _raw(url, _chat_body(temperature=0.8, repeat_penalty=1e-300)),
    "n=2 and tools": lambda url: _raw(url, _chat_body(n=2, tools=[{"type": "function"}])),
    "a special-token flood": lambda url: _raw(url, json.dumps({"prompt": "<|im_end|>x" * 16_000, "max_tokens": 2}
                                                              ).encode(), path="/v1/completions"),
    "a 40 MiB Content-Length": lambda url: _raw(url, b"{}", {"Content-Length": str(40 << 20)}),
    "a stream left mid-reply": _left_mid_stream,
    "a head never finished": _unfinished_head,
}


def soak(url: str, model: str | None, clients: int, requests: int, max_tokens: int, time_limit: float,
         prompts: list[str], hostile: float = 0.0, keys: Sequence[str] = ("soak",)) -> dict:
    """`keys`: the principals' API keys; client thread i uses keys[i % len(keys)]."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=keys[0], max_retries=0, timeout=600)
    model = model or client.models.list().data[0].id
    rss_loaded = rss(url)
    one_request(client, model, prompts[0], max_tokens, seed=0)  # warm-up: lazily made buffers, pass-time caches
    rss_warm = rss(url)
    # With hostile requests, valid ones use 8 (prompt, seed) pairs, each sent alone first: its single-client text.
    variants = 8 if hostile else requests
    alone = {v: one_request(client, model, prompts[v % len(prompts)], max_tokens, seed=v + 1)["reply"]
             for v in range(variants)} if hostile else {}
    hostile_every = round(1 / hostile) if hostile else 0
    refused: dict[str, list[int]] = {}
    mismatches: list[int] = []
    results: list[dict] = []
    failures: list[str] = []
    next_index = iter(range(requests))
    lock = threading.Lock()
    trace: list[float] = []  # the server RSS (MB) every trace_every requests: a leak climbs, a high-water mark settles
    trace_every = max(1, requests // 8)
    deadline = time.monotonic() + time_limit

    def worker(key: str) -> None:
        own = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)
        while time.monotonic() < deadline:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            if hostile_every and index % hostile_every == hostile_every - 1:
                kind = list(HOSTILE)[(index // hostile_every) % len(HOSTILE)]
                try:
                    status = HOSTILE[kind](url)
                except Exception as problem:
                    status = 0
                    with lock:
                        failures.append(f"{kind}: {type(problem).__name__}: {problem}")
                with lock:
                    refused.setdefault(kind, []).append(status)
                continue
            variant = index % variants
            try:
                result = one_request(own, model, prompts[variant % len(prompts)], max_tokens, seed=variant + 1)
            except openai.OpenAIError as problem:
                with lock:
                    failures.append(f"{type(problem).__name__}: {problem}")
                continue
            with lock:
                if hostile and result["reply"] != alone[variant]:
                    mismatches.append(index)
                results.append(result)
                if len(results) % trace_every == 0:
                    trace.append(round(rss(url) / 1e6, 1))

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(keys[i % len(keys)],)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    rss_end = rss(url)
    ttft = [r["ttft_s"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {
        "url": url, "model": model, "clients": clients, "requests": requests, "max_tokens": max_tokens,
        "completed": len(results), "failed": len(failures), "failures": failures[:5],
        "stopped_by_time_limit": len(results) + len(failures) + sum(map(len, refused.values())) < requests,
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 3) if wall else None,
        "tokens_per_s": round(tokens / wall, 2) if wall else None,
        "ttft_p50_s": round(quantile(ttft, 0.5), 3) if ttft else None,
        "ttft_p95_s": round(quantile(ttft, 0.95), 3) if ttft else None,
        "request_s_mean": round(statistics.mean(r["total_s"] for r in results), 3) if results else None,
        "rss_after_load_mb": round(rss_loaded / 1e6, 1),
        "rss_after_warmup_mb": round(rss_warm / 1e6, 1),
        "rss_end_mb": round(rss_end / 1e6, 1),
        "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
        "rss_trace_every": trace_every,
        "rss_trace_mb": trace,
        **({"hostile": len([s for v in refused.values() for s in v]),
            "hostile_statuses": {kind: sorted(set(v)) for kind, v in refused.items()},
            "hostile_5xx": sum(1 for v in refused.values() for s in v if s >= 500 or s == 0),
            "valid": len(results), "valid_equal_to_alone": len(results) - len(mismatches),
            "compared_by": sorted({r["reply"][0] for r in results} | {kind for kind, _ in alone.values()}),
            "valid_mismatches": mismatches[:10]} if hostile else {}),
    }


def isolation_probe(url: str, keys: Sequence[str]) -> dict:
    """After the soak, two principals: A's prompt holds a PIN, then B sends guesses sharing its first digits. B's
    cached_tokens (and prefill) must not count A's matching tokens: with one principal they did (9 / 10 / 11 ...)."""
    def cached(key: str, prompt: str) -> int:
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)
        reply = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=1,
                                          temperature=0)
        return reply.usage.prompt_tokens_details.cached_tokens

    secret = "Customer 1182 PIN: 4821\nAnswer OK:"
    guesses = {}
    # each guess shares one more digit with the PIN than with any guess before it: with --parallel N, B's earlier
    # guesses stay in B's lanes (its own prompt cache), so B's count is its shared prefix with them, one digit short
    # of what A's prompt would give it
    for guess in ("9821", "4021", "4871", "4829", "4821"):
        cached(keys[0], secret)
        guesses[guess] = cached(keys[-1], f"Customer 1182 PIN: {guess}Z")
    return {"principals": len(keys), "b_cached_tokens_after_a": guesses}


def main() -> None:
    parser = argparse.ArgumentParser(prog="serve_soak.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a server already running (default: start one for --pair)")
    parser.add_argument("--pair", default=None, help="the pair to serve when starting one (default: the default)")
    parser.add_argument("--server-args", default="", help="more `edge-spec serve` options, e.g. '--budget 16'")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=900, help="seconds; requests not started by then are "
                                                                       "skipped")
    parser.add_argument("--prompts", type=Path, default=REPO / "benchmarks" / "chat-prompts.txt")
    parser.add_argument("--hostile", type=float, default=0.0, help="the share of hostile requests, 0 to 0.5")
    parser.add_argument("--keys", type=int, default=0,
                        help="start the server with this many API keys, each a principal; clients take them in turn, "
                             "and an isolation probe runs after the soak: the first key's PIN prompt, then the last "
                             "key's guesses (0: no key)")
    args = parser.parse_args()
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        parser.error("--clients, --requests and --max-tokens must be at least 1")
    if not 0 <= args.hostile <= 0.5:
        parser.error("--hostile must be 0 to 0.5")
    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    keys = [f"soak-key-{i}" for i in range(args.keys)] or ["soak"]
    if args.keys:
        KEY_HEADER["Authorization"] = f"Bearer {keys[0]}"
    if args.url:
        result = soak(args.url.rstrip("/"), None, args.clients, args.requests, args.max_tokens, args.time_limit,
                      prompts, args.hostile, keys)
        if args.keys:
            result["isolation"] = isolation_probe(args.url.rstrip("/"), keys)
    else:
        from serve_process import ServerProcess  # benchmarks/, the script's folder

        server_args = ([args.pair] if args.pair else []) + args.server_args.split()
        server_args += [flag for key in keys[: args.keys] for flag in ("--api-key", key)]
        with ServerProcess(server_args) as server:
            result = soak(server.url, None, args.clients, args.requests, args.max_tokens, args.time_limit, prompts,
                          args.hostile, keys)
            if args.keys:
                result["isolation"] = isolation_probe(server.url, keys)
        result["server_args"] = server_args
        result["server_exit"] = server.process.returncode
        result.update(server.faults())
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
