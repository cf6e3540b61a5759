"""Soak `edge-spec serve`: N streamed chat requests from K clients at once, for a bounded time. Reports requests per
second, time to first token (p50, p95), tokens per second, and the server's resident memory after its warm-up
request, every eighth of the run and at the end (growth in %): a server that leaks grows request after request,
native buffers that reach their high-water mark (KV pages touched, arenas) grow less and less, then stop.

    python benchmarks/serve_soak.py --clients 4 --requests 40            # starts the default pair's server
    python benchmarks/serve_soak.py --url http://127.0.0.1:8080 --clients 4 --requests 40   # one already running

Prompts cycle through the repo's chat prompts; sampling at temperature 0.8 with a seed per request, so runs repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
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
    started = time.perf_counter()
    first = None
    usage = None
    text = []
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0.8, seed=seed, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.perf_counter()
    return {"ttft_s": (first or ended) - started, "total_s": ended - started,
            "tokens": usage.completion_tokens if usage else 0}


def soak(url: str, model: str | None, clients: int, requests: int, max_tokens: int, time_limit: float,
         prompts: list[str]) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="soak", max_retries=0, timeout=600)
    model = model or client.models.list().data[0].id
    rss_loaded = rss(url)
    one_request(client, model, prompts[0], max_tokens, seed=0)  # warm-up: lazily made buffers, pass-time caches
    rss_warm = rss(url)
    results: list[dict] = []
    failures: list[str] = []
    next_index = iter(range(requests))
    lock = threading.Lock()
    trace: list[float] = []  # the server RSS (MB) every trace_every requests: a leak climbs, a high-water mark settles
    trace_every = max(1, requests // 8)
    deadline = time.monotonic() + time_limit

    def worker() -> None:
        own = openai.OpenAI(base_url=url + "/v1", api_key="soak", max_retries=0, timeout=600)
        while time.monotonic() < deadline:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            try:
                result = one_request(own, model, prompts[index % len(prompts)], max_tokens, seed=index + 1)
            except openai.OpenAIError as problem:
                with lock:
                    failures.append(f"{type(problem).__name__}: {problem}")
                continue
            with lock:
                results.append(result)
                if len(results) % trace_every == 0:
                    trace.append(round(rss(url) / 1e6, 1))

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
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
        "stopped_by_time_limit": len(results) + len(failures) < requests,
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
    }


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
    args = parser.parse_args()
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        parser.error("--clients, --requests and --max-tokens must be at least 1")
    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    if args.url:
        result = soak(args.url.rstrip("/"), None, args.clients, args.requests, args.max_tokens, args.time_limit,
                      prompts)
    else:
        from serve_process import ServerProcess  # benchmarks/, the script's folder

        server_args = ([args.pair] if args.pair else []) + args.server_args.split()
        with ServerProcess(server_args) as server:
            result = soak(server.url, None, args.clients, args.requests, args.max_tokens, args.time_limit, prompts)
        result["server_args"] = server_args
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
