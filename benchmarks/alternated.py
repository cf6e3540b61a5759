"""edge-spec's `auto` against llama.cpp's plain decoding, alternated: where the two run the same kernels (the target
in RAM, where `auto` loads it as llama.cpp does), one run of each, one after the other, differs by the machine's drift
(several per cent on a shared 2-core VM), so this runs the two sides in turn `--rounds` times, the first side changing
every round, and reports each round's ratio and their median.

    python benchmarks/alternated.py -m qwen2.5-coder-1.5b --rounds 3 --json                  # in RAM
    python benchmarks/alternated.py -m qwen2.5-coder-1.5b --rounds 3 --cap-mb 1700 --json    # under a memory cap

Each side runs as in benchmarks/peer_llama_cpp.py (the same prompts as token ids, greedy, decode tokens/s with the
prompt's pass excluded; llama-server built from the source llama-cpp-python vendors), in a fresh process and, with
--cap-mb, in its own memory cgroup with the pair's files dropped from the page cache first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from peer_llama_cpp import amx_crashes, build, edge_job, llama_server, pair_files, peer_rows, summary  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--pair", default="qwen2.5-coder-1.5b")
    parser.add_argument("--prompts", type=Path, default=REPO / "benchmarks" / "chat-prompts.txt")
    parser.add_argument("-n", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, alternated")
    parser.add_argument("--cap-mb", type=int, default=None, help="run each side under a memory cap of this size")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tokens", action="store_true", help="each round's token ids, both sides, in the JSON")
    args = parser.parse_args()
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    bin_dir = build(say)
    from edge.runtimes import default_threads
    from memcap import call_capped

    threads = args.threads or default_threads()
    cap = None if args.cap_mb is None else args.cap_mb << 20
    files = list(pair_files(args.pair).values())
    job = {"pair": args.pair, "prompts": str(args.prompts), "n": args.n, "threads": threads, "gpu_layers": 0,
           "temperature": 0.0, "accept": ["auto"], "speculate": "auto"}

    def edge_side() -> tuple[list[dict], dict]:
        done = call_capped(edge_job, job, limit_bytes=cap, drop_cache=files)
        return done.value["rows"]["edge-spec auto"], done.value

    def peer_side(ours: dict) -> list[dict]:
        common = ["-m", ours["target"], "-c", str(ours["ctx"]), "-t", str(threads), "-tb", str(threads)]
        if amx_crashes():
            common.append("--no-repack")  # as peer_llama_cpp.py runs it there
        with llama_server(bin_dir, common, cap, files) as url:
            return peer_rows(url, ours["prompts"], args.n, ours["stops"])

    rounds, plan = [], []
    ours = None
    for i in range(args.rounds):
        if i % 2 == 0 or ours is None:  # edge-spec first (it gives the prompts' token ids and the target's settings)
            edge_rows, ours = edge_side()
            peer = peer_side(ours)
        else:
            peer = peer_side(ours)
            edge_rows, ours = edge_side()
        plan = ours["plan"]
        edge_speed = summary("edge-spec auto", edge_rows, None)["decode_tokens_per_s"]
        peer_speed = summary("llama.cpp plain", peer, None)["decode_tokens_per_s"]
        same = sum(a["tokens"] == b["tokens"] for a, b in zip(edge_rows, peer, strict=True))
        rounds.append({"first": "edge-spec" if i % 2 == 0 else "llama.cpp", "edge_auto": edge_speed,
                       "llama_plain": peer_speed, "ratio": round(edge_speed / peer_speed, 3),
                       "prompts_matching_llama_plain": same, "prompts": len(peer)})
        if args.tokens:  # which side changed, where a round's texts differ
            rounds[-1] |= {"edge_tokens": [r["tokens"] for r in edge_rows], "llama_tokens": [r["tokens"] for r in peer]}
        say(json.dumps({key: value for key, value in rounds[-1].items() if not key.endswith("_tokens")}))
    ratios = [r["ratio"] for r in rounds]
    out = {"pair": args.pair, "n": args.n, "cap_mb": args.cap_mb, "threads": threads, "rounds": rounds,
           "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
           "edge_auto_median": statistics.median(r["edge_auto"] for r in rounds),
           "llama_plain_median": statistics.median(r["llama_plain"] for r in rounds), "plan": plan}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for r in rounds:
        print(f"{r['first']:>9s} first: edge-spec auto {r['edge_auto']} tok/s, llama.cpp plain {r['llama_plain']} "
              f"tok/s, {r['ratio']}x, {r['prompts_matching_llama_plain']}/{r['prompts']} the same tokens")
    print(f"median {out['median_ratio']}x (from {out['min_ratio']} to {out['max_ratio']})")


if __name__ == "__main__":
    main()
