"""Lookup drafting against the peer, in one run: llama-cpp-python's `LlamaPromptLookupDecoding` (prompt lookup:
the last n-gram matched in the prompt, its continuation verified as a chain) and its plain decoding, then
edge-spec's plain decoding, lookup alone (`--drafter lookup`) and the pair's drafter with lookup, all greedy, on the
same target file, prompts and token count, with the target in RAM.

    python benchmarks/lookup_peer.py --pair qwen2.5-coder-1.5b --prompts benchmarks/editing-prompts.jsonl -n 128
    python benchmarks/lookup_peer.py --pair smollm2-135m --prompts benchmarks/json-prompts.jsonl -n 32 --json
    python benchmarks/lookup_peer.py --pair qwen2.5-coder-1.5b --target-dtype q4_0 --json

The peer runs in a child process with llama.cpp's stock kernel switches (edge-spec's K-quant switches are its own:
runtimes/llama_cpp/kernels.py), on the prompts' token ids as edge-spec renders them in the chat template, once per
`--pred` (its num_pred_tokens: llama-cpp-python suggests 10, or 2 on a CPU; 0 is its plain decoding). Each prompt
starts from an empty cache on both sides. Figures per row: decode tokens/s (the reply after the prompt's pass),
end-to-end tokens/s (prompt included), and whether its tokens are edge-spec's plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PEER = """
import json, os, sys, time
import llama_cpp.llama_cpp as native
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
from edge.runtimes.llama_cpp._native import USE_EXTRA_BUFFERS
for switch in ("GGML_CPU_TILED_MM", "GGML_CPU_TILED_MM_FORCE"):  # stock llama.cpp: no pass has run yet
    os.environ.pop(switch, None)
defaults = native.llama_model_default_params
def model_params():
    params = defaults()
    params.use_extra_bufts = USE_EXTRA_BUFFERS  # the weight buffers edge-spec loads (no AMX where it crashes)
    return params
native.llama_model_default_params = model_params
job = json.loads(sys.stdin.read())
rows = []
for pred in job["pred"]:
    draft = LlamaPromptLookupDecoding(num_pred_tokens=pred) if pred else None
    # logits_all: with a draft model llama-cpp-python keeps every row's logits, but sizes that array from this argument
    llm = Llama(job["model"], n_ctx=job["ctx"], n_threads=job["threads"], n_threads_batch=job["threads"],
                draft_model=draft, logits_all=draft is not None, verbose=False)
    stops = set(job["stops"])
    for ids in job["prompts"]:
        llm.reset()
        out, start, first = [], time.perf_counter(), None
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            first = first or time.perf_counter()
            if token in stops:
                break
            out.append(token)
            if len(out) >= job["n"]:
                break
        end = time.perf_counter()
        rows.append({"pred": pred, "tokens": out, "total_s": end - start, "decode_s": end - first})
    llm.close()
print(json.dumps(rows))
"""


def peer_rows(model: Path, prompts: list[list[int]], n: int, ctx: int, threads: int, preds: list[int],
              stops: list[int]) -> list[dict]:
    job = {"model": str(model), "prompts": prompts, "n": n, "ctx": ctx, "threads": threads, "pred": preds,
           "stops": stops}
    run = subprocess.run([sys.executable, "-c", PEER], input=json.dumps(job), capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"the peer failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout)


def edge_rows(pair, prompts: list[list[int]], n: int, label: str, speculate: bool) -> list[dict]:
    from edge.sampling import SamplingConfig

    decoder = pair.decoder(SamplingConfig(), speculate=speculate, budget="auto" if speculate else None)
    rows = []
    for ids in prompts:
        decoder.reset()
        start = time.perf_counter()
        steps = list(decoder.reply(ids, n))
        end = time.perf_counter()
        stats = steps[-1].stats
        rows.append({"row": label, "tokens": [s.token for s in steps[:-1]], "total_s": end - start,
                     "decode_s": stats.decode_s, "passes": stats.target_passes, "lookup_rounds": stats.lookup_rounds,
                     "plain_rounds": stats.plain_rounds, "rounds": stats.rounds})
    return rows


def summary(label: str, rows: list[dict], reference: list[list[int]]) -> dict:
    tokens = sum(len(r["tokens"]) for r in rows)
    decode = sum(r["decode_s"] for r in rows)
    total = sum(r["total_s"] for r in rows)
    figures = {"row": label, "new_tokens": tokens, "decode_tokens_per_s": round(tokens / decode, 2),
               "end_to_end_tokens_per_s": round(tokens / total, 2),
               "matches_plain": [r["tokens"] for r in rows] == reference}
    if "passes" in rows[0]:
        passes = sum(r["passes"] for r in rows)
        figures |= {"tokens_per_pass": round(tokens / passes, 3),
                    **{key: sum(r[key] for r in rows) for key in ("lookup_rounds", "plain_rounds", "rounds")}}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="qwen2.5-coder-1.5b")
    parser.add_argument("--prompts", type=Path, default=Path("benchmarks/editing-prompts.jsonl"))
    parser.add_argument("-n", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--pred", default="0,2,10", help="the peer's num_pred_tokens to run (0: its plain decoding)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--target-dtype", default=None,
                        help="rewrite the target first, as edge-spec's --target-dtype (q4_0, q8_0...); the peer "
                             "runs the same rewritten file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    from edge.models.bench import read_prompts
    from edge.offload.probe import probe_machine
    from edge.runtimes import default_threads

    import edge

    threads = args.threads or default_threads()
    preds = [int(p) for p in args.pred.split(",")]
    texts = read_prompts(args.prompts)
    say = lambda message: print(message, file=sys.stderr)  # noqa: E731
    load = {"placement": "ram", "threads": threads, "target_dtype": args.target_dtype, "report": say}
    with edge.load(args.pair, **load) as pair:
        prompts = [pair.prompt_tokens(text) for text in texts]
        model, ctx, stops = pair.target.path, pair.target.n_ctx, sorted(pair.target.special.stop)
        say(f"edge-spec: plain, then {pair.drafter.runtime if pair.drafter else 'no'} drafter with lookup, auto")
        plain = edge_rows(pair, prompts, args.n, "edge-spec plain", speculate=False)
        both = edge_rows(pair, prompts, args.n, "edge-spec drafter+lookup auto", speculate=True)
    with edge.load(args.pair, drafter="lookup", **load) as pair:
        say("edge-spec: lookup alone, auto")
        alone = edge_rows(pair, prompts, args.n, "edge-spec lookup auto", speculate=True)
    say(f"llama-cpp-python: num_pred_tokens {args.pred}")
    peer = peer_rows(model, prompts, args.n, ctx, threads, preds, stops)

    reference = [r["tokens"] for r in plain]
    results = [summary("edge-spec plain", plain, reference), summary("edge-spec lookup auto", alone, reference),
               summary("edge-spec drafter+lookup auto", both, reference)]
    for pred in preds:
        label = f"llama-cpp-python {'plain' if pred == 0 else f'LlamaPromptLookupDecoding({pred})'}"
        results.append(summary(label, [r for r in peer if r["pred"] == pred], reference))
    base = results[0]["decode_tokens_per_s"]
    for row in results:
        row["vs_edge_plain"] = round(row["decode_tokens_per_s"] / base, 3)
    out = {"pair": args.pair, "target_dtype": args.target_dtype, "prompts": str(args.prompts), "n": args.n,
           "threads": threads, "machine": probe_machine()["cpu"], "rows": results}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for row in results:
        print(f"{row['row']:45s} decode {row['decode_tokens_per_s']:7.2f} tok/s ({row['vs_edge_plain']:.2f}x) · "
              f"end to end {row['end_to_end_tokens_per_s']:7.2f} tok/s · same as edge-spec plain: "
              f"{row['matches_plain']}" + (f" · {row['tokens_per_pass']:.2f} tokens/pass" if "tokens_per_pass" in row
                                           else ""))


if __name__ == "__main__":
    main()
