"""K clients at once against `edge-spec serve --parallel K`, and against llama-server with K slots (-np K), with the
real openai client: aggregate tokens/s, each client's tokens/s, first-token latency (median and worst), and whether
every reply equals the one the same server gives that request alone.

    python benchmarks/serve_load.py --clients 4                       # the default pair, 8 chat prompts x 64 tokens
    python benchmarks/serve_load.py --pair smollm2-135m --clients 4 -n 32 --peer
    python benchmarks/serve_load.py --clients 4 --peer --cap-mb 1049   # each server in a 1049 MiB memory cgroup
    python benchmarks/serve_load.py --clients 4 --peer --peer-draft default,4   # llama-server's speculative slots too

Each server runs two phases: the prompts one at a time (each reply alone, and the one-client rate), then the same
prompts from K clients at once, each client taking every K-th prompt. Greedy, streamed. `--peer` adds llama-server
(built as benchmarks/peer_llama_cpp.py builds it) with the target alone, plain, `-np K`; `--peer-draft default,4` adds
llama-server `-np K` with the pair's drafter (its default draft settings, and a draft-max of 4), and the JSON names
the best of llama-server's rows and edge-spec's aggregate against it. With `--cap-mb`, each server
runs in a memory cgroup of its own (benchmarks/memcap.py), the model files dropped from the page cache first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parent.parent


def one_reply(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    """A streamed greedy chat reply: its text, its token ids (`return_tokens`, where the server gives them: None
    otherwise), tokens (usage), first-token latency and decode rate."""
    start = time.perf_counter()
    first = None
    pieces: list[str] = []
    ids: list[int] | None = []
    usage = None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"return_tokens": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            given = (choice.model_extra or {}).get("tokens")
            if ids is not None and isinstance(given, list):
                ids.extend(given)
            elif choice.delta.content:
                ids = None  # text without ids: this server does not return them
            if choice.delta.content:
                first = first if first is not None else time.perf_counter()
                pieces.append(choice.delta.content)
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else len(pieces)
    first = end if first is None else first
    return {"text": "".join(pieces), "ids": ids, "tokens": tokens, "ttft_s": first - start, "seconds": end - start}


def reply(result: dict) -> tuple[str, object]:
    """What two replies are compared by: their token ids where the server gave them, else their text."""
    return ("token ids", tuple(result["ids"])) if result["ids"] is not None else ("text", result["text"])


def phase(base: str, model: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """The prompts from `clients` clients at once (client c takes prompts c, c + clients, ...)."""
    results: list[dict | None] = [None] * len(prompts)
    spans: list[tuple[float, float, int]] = []
    failures: list[str] = []

    def client_run(c: int) -> None:
        client = openai.OpenAI(base_url=base + "/v1", api_key="load", max_retries=0, timeout=1800)
        started, tokens = time.perf_counter(), 0
        for i in range(c, len(prompts), clients):
            try:
                results[i] = one_reply(client, model, prompts[i], max_tokens)
            except openai.OpenAIError as problem:
                failures.append(f"prompt {i}: {problem}")
                continue
            tokens += results[i]["tokens"]
        spans.append((started, time.perf_counter(), tokens))

    start = time.perf_counter()
    threads = [threading.Thread(target=client_run, args=(c,)) for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    done = [r for r in results if r is not None]
    if failures:
        raise SystemExit(f"{len(failures)} requests failed: {failures[0]}")
    ttfts = [r["ttft_s"] for r in done]
    return {"clients": clients, "requests": len(done), "tokens": sum(r["tokens"] for r in done),
            "seconds": round(seconds, 2), "aggregate_tokens_per_s": round(sum(r["tokens"] for r in done) / seconds, 2),
            "client_tokens_per_s": [round(tokens / (end - begin), 2) for begin, end, tokens in spans],
            "ttft_median_s": round(statistics.median(ttfts), 3), "ttft_worst_s": round(max(ttfts), 3),
            "replies": [reply(r) for r in results if r is not None]}


def measure(base: str, model: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    alone = phase(base, model, prompts, 1, max_tokens)
    together = phase(base, model, prompts, clients, max_tokens)
    same = sum(a == b for a, b in zip(alone["replies"], together["replies"], strict=True))
    compared = sorted({kind for kind, _ in alone["replies"] + together["replies"]})
    for row in (alone, together):
        del row["replies"]
    return {"alone": alone, "together": together, "replies_equal_alone": f"{same}/{len(prompts)}",
            "replies_compared_by": " and ".join(compared),
            "aggregate_vs_alone": round(together["aggregate_tokens_per_s"] / alone["aggregate_tokens_per_s"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="serve_load.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="qwen2.5-coder-1.5b")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prompts", type=Path, default=REPO / "benchmarks" / "chat-prompts.txt")
    parser.add_argument("-n", type=int, default=64, help="tokens per reply")
    parser.add_argument("--ctx", type=int, default=1024, help="context per request (each lane, each slot)")
    parser.add_argument("--peer", action="store_true", help="llama-server with -np CLIENTS too")
    parser.add_argument("--cap-mb", type=int, default=None, help="run each server under a memory cap of this size")
    parser.add_argument("--peer-draft", default="", help="llama-server -np CLIENTS with the pair's drafter too "
                        "(--spec-type draft-simple): 'default' for its draft settings, or draft-max values, comma "
                        "separated (e.g. default,4)")
    parser.add_argument("--server-args", default="", help="more arguments for edge-spec serve (e.g. \"--speculate on "
                        "--budget 32\": the lanes keep the drafter and grow trees)")
    args = parser.parse_args()
    if args.clients < 1 or args.n < 1:
        parser.error("--clients and -n must be at least 1")
    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    sys.path.insert(0, str(REPO / "benchmarks"))
    from peer_llama_cpp import pair_files
    from serve_process import ServerProcess

    files = list(pair_files(args.pair).values())
    cap = None if args.cap_mb is None else args.cap_mb << 20
    result: dict = {"pair": args.pair, "clients": args.clients, "max_tokens": args.n, "prompts": len(prompts),
                    "cap_mb": args.cap_mb}
    server_args = [args.pair, "--parallel", str(args.clients), "--ctx", str(args.ctx), *shlex.split(args.server_args)]
    with contextlib.ExitStack() as stack:
        wrapper: list[str] = []
        if cap is not None:
            from memcap import drop_from_cache, memory_cgroup

            cgroup = stack.enter_context(memory_cgroup(cap))
            drop_from_cache(files)
            wrapper = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup.procs)]
        server = stack.enter_context(ServerProcess(server_args, wrapper=wrapper))
        result["edge_spec"] = {"server_args": server_args, **measure(server.url, args.pair, prompts, args.clients,
                                                                      args.n)}
        if cap is not None:
            result["edge_spec"]["peak_mib"] = round(cgroup.peak_bytes() / 2**20)
    result["edge_spec"].update(server.faults())
    result["edge_spec"]["plan"] = [line.strip() for line in server.log.splitlines() if "plan" in line.lower()][:3]
    peers = ([("llama_server", [])] if args.peer else []) + [
        (f"llama_server_draft_{n}", [] if n == "default" else ["--spec-draft-n-max", n])
        for n in args.peer_draft.split(",") if n]
    if peers:
        from peer_llama_cpp import amx_crashes, build, llama_server

        bin_dir = build(lambda message: print(message, file=sys.stderr))
        target = str(pair_files(args.pair)["target"])
        peer_args = ["-m", target, "-c", str(args.ctx * args.clients)] + (["--no-repack"] if amx_crashes() else [])
        for name, draft in peers:
            # --spec-type draft-simple: llama.cpp infers the kind of drafting from the draft file's metadata, and a
            # plain model file names none (as benchmarks/peer_llama_cpp.py runs it)
            extra = [] if name == "llama_server" else ["-md", str(pair_files(args.pair)["drafter"]), "--spec-type",
                                                         "draft-simple", *draft]
            with llama_server(bin_dir, peer_args + extra, cap, files, slots=args.clients) as url:
                result[name] = {"args": [*peer_args, *extra, "-np", str(args.clients)],
                                **measure(url, args.pair, prompts, args.clients, args.n)}
        best = max((name for name, _ in peers), key=lambda name: result[name]["together"]["aggregate_tokens_per_s"])
        result["llama_server_best"] = best
        result["edge_vs_llama_server_best_aggregate"] = round(
            result["edge_spec"]["together"]["aggregate_tokens_per_s"]
            / result[best]["together"]["aggregate_tokens_per_s"], 2)
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
