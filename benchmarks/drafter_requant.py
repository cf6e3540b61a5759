"""The ONNX drafter with its file's own blocks against the same file with some block types requantized by the graph,
and against llama.cpp's drafter on that file: pass times and agreement with the target (docs/drafter.md).

    python benchmarks/drafter_requant.py --pair qwen2.5-coder-1.5b --requantize Q5_0 --vocab 32768,16384 -n 64
    python benchmarks/drafter_requant.py --pair qwen2.5-coder-1.5b --requantize Q4_K,Q5_0,Q6_K,Q8_0 --block 128

The graph keeps a Q5_0 tensor as 8-bit codes (quant/grid.py). --requantize TYPES gives the matmuls of those GGUF
types DecoderBuilder.quantize's blocks of --block weights instead (4 bits asymmetric; Q8_0 and Q6_K stay 8 bits,
symmetric and asymmetric: a Q8_0 head too), the embedding as it was. For llama.cpp's drafter (the pair's KV type, and
each --llama-kv) and each ONNX drafter (full head, and each --vocab head; kept and requantized): `expand_ms` for 1
and 8 sibling nodes after --context tokens, the drafters taking turns for --rounds rounds (the median of the rounds'
medians: other work on the machine hits every drafter alike), then how often the drafter's top token is the
target's greedy one along the target's own replies (draft_agreement.py's teacher forcing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import edge.runtimes.onnx as onnx_runtime
import numpy as np
from draft_agreement import teacher_forced  # benchmarks/, the script's folder
from edge.models.bench import read_prompts
from edge.models.opening import open_drafter
from edge.models.pair import CALIBRATION_TEXT, Pair
from edge.offload.tuning import expand_ms
from edge.runtimes.onnx import graph
from replay import plain_replies  # benchmarks/replay.py, beside this script

import edge
from edge.sampling import SamplingConfig

_kept_init = graph.DecoderBuilder.__init__
_kept_linear = graph.DecoderBuilder.linear
_kept_variant = onnx_runtime._variant


def requantize(types: set[str], block: int) -> None:
    """From now on, graphs built give the matmuls of `types` DecoderBuilder.quantize's blocks of `block` weights,
    cached under another name."""

    def init(self, weights, options: graph.GraphOptions) -> None:
        _kept_init(self, weights, replace(options, block=block))

    def linear(self, x: str, name: str, w=None, source=None, grid=None) -> str:
        if w is not None and self.w.tensors[source or name].tensor_type.name in types:
            grid = None  # not kept: requantized
        return _kept_linear(self, x, name, w, source, grid)

    graph.DecoderBuilder.__init__ = init
    graph.DecoderBuilder.linear = linear
    tag = f".q{block}-" + "-".join(sorted(types)).lower()
    onnx_runtime._variant = lambda role, head: _kept_variant(role, head) + tag


def open_drafters(pair: Pair, kv_types: list[str], vocabs: list[int], types: set[str], block: int) -> dict:
    """llama.cpp's drafter (the pair's, and with each of `kv_types`), then the ONNX ones on its file: kept blocks, and
    requantized if `types`."""
    drafters = {f"llama_cpp kv {pair.spec.drafter.kv_type}": pair.drafter}
    for kv_type in kv_types:
        model = replace(pair.spec.drafter, runtime="llama_cpp", kv_type=kv_type)
        drafters[f"llama_cpp kv {kv_type}"] = open_drafter(pair.spec, model, pair.target.path,
                                                          pair.drafter_threads, 0, print)
    variants = [("kept", set())] + ([(f"{','.join(sorted(types))} /{block}", types)] if types else [])
    for label, requantized in variants:
        if requantized:
            requantize(requantized, block)
        for vocab in [0, *vocabs]:
            model = replace(pair.spec.drafter, runtime="onnx", vocab=vocab or None)
            drafters[f"onnx{f':{vocab}' if vocab else ''} {label}"] = open_drafter(
                pair.spec, model, pair.target.path, pair.drafter_threads, 0, print)
    return drafters


def pass_times(drafters: dict, prefix: list[int], rounds: int) -> dict[str, dict[int, float]]:
    """Per drafter, the median over `rounds` of expand_ms's medians for 1 and 8 nodes; drafters take turns."""
    samples: dict[str, list[dict[int, float]]] = {name: [] for name in drafters}
    for _ in range(rounds):
        for name, drafter in drafters.items():
            samples[name].append(expand_ms(drafter, prefix, sizes=(1, 8), repeats=5))
    return {name: {n: statistics.median(s[n] for s in runs) for n in (1, 8)} for name, runs in samples.items()}


def agreement(drafter, prompts: list[list[int]], replies: list[list[int]]) -> float:
    ranks = [rank for prompt, reply in zip(prompts, replies, strict=True)
             for _, rank in teacher_forced(drafter, prompt, reply, 4)]
    return float(np.mean(np.array(ranks) == 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", required=True)
    parser.add_argument("--requantize", default="", help="GGUF block types to requantize (e.g. Q5_0,Q4_K)")
    parser.add_argument("--block", type=int, default=32, help="weights per block of the requantized tensors")
    parser.add_argument("--llama-kv", default="f16", help="llama.cpp's drafter with these KV types too")
    parser.add_argument("--vocab", default="", help="trimmed heads too (prepared K-token vocabularies: 16384,32768)")
    parser.add_argument("--prompts", type=Path, default=Path("benchmarks/chat-prompts.txt"))
    parser.add_argument("-n", type=int, default=64, help="target tokens per prompt for the agreement")
    parser.add_argument("--context", type=int, default=128, help="tokens before the timed passes")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    types = {t.strip().upper() for t in args.requantize.split(",") if t.strip()}
    vocabs = [int(v) for v in args.vocab.split(",") if v.strip()]
    kv_types = [kv.strip() for kv in args.llama_kv.split(",") if kv.strip()]

    with edge.load(args.pair, report=lambda message: print(message, file=sys.stderr), placement="ram",
                   drafter_runtime="llama_cpp") as pair:
        kv_types = [kv for kv in kv_types if kv != pair.spec.drafter.kv_type]
        drafters = open_drafters(pair, kv_types, vocabs, types, args.block)
        prefix = pair.target.tokenizer.tokenize(CALIBRATION_TEXT, add_special=True, parse_special=False)
        times = pass_times(drafters, prefix[: args.context], args.rounds)
        prompts = [pair.prompt_tokens(text) for text in read_prompts(args.prompts)]
        replies = plain_replies(pair.target, prompts, args.n, SamplingConfig())
        base = times[next(iter(drafters))][8]
        print(f"{args.pair}: expand ms after {args.context} tokens (median of {args.rounds} rounds); top-1 agreement "
              f"with the target's greedy token over {sum(map(len, replies))} positions of {len(prompts)} replies")
        print(f"{'drafter':36s} {'1 node':>8s} {'8 nodes':>8s} {'8: x the first':>14s} {'agreement':>9s}")
        for name, drafter in drafters.items():
            ms = times[name]
            print(f"{name:36s} {ms[1]:8.1f} {ms[8]:8.1f} {base / ms[8]:14.2f} "
                  f"{agreement(drafter, prompts, replies):9.3f}")
        for drafter in drafters.values():
            if drafter is not pair.drafter:
                drafter.close()


if __name__ == "__main__":
    try:
        main()
    except edge.UserError as error:
        from edge.cli.render import worded

        sys.exit(f"error: {worded(error)}")
