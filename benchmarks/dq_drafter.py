"""The ONNX drafter with DynamicQuantizeMatMul (u8 x s8) in place of int4 MatMulNBits (docs/drafter.md).

    python benchmarks/dq_drafter.py --pair smollm2-135m

Builds, beside the pair's int4 drafter graph, one whose layers and head use DynamicQuantizeMatMul with 7-bit
weights and one scale per column (full-range int8 weights saturate the kernel's int16 pair sums on AVX2), requantized
from the drafter's GGUF weights; then grows budget-64 trees with the llama.cpp drafter, the int4 graph and this one
on the same prompts (the target in RAM) and prints `expand_ms` for 1/4/8/32 nodes, growth seconds per round and
tokens per pass for each.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import edge.runtimes.onnx as onnx_runtime
import numpy as np
from edge.models.bench import read_prompts
from edge.models.opening import materialize, open_drafter
from edge.models.pair import CALIBRATION_TEXT, Pair
from edge.offload.tuning import expand_ms
from edge.runtimes.onnx import graph

import edge
from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.sampling import SamplingConfig

FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K", "Q5_0")


def _dynamic_quantize_linear(self, x: str, name: str, w: np.ndarray | None = None, source: str | None = None,
                             grid=None) -> str:
    """DecoderBuilder.linear with DynamicQuantizeMatMul for 4-bit layers and the head."""
    w = self.w.get(name) if w is None else w
    if isinstance(w, graph.TensorRows):  # the head, which the builder packs a chunk of rows at a time: whole here
        w = self.read(w)
    kind = self.w.tensors[source or name].tensor_type.name
    head = (source or name) in ("output.weight", "token_embd.weight")
    if self.opt.weights != "int4" or (kind not in FOUR_BIT and not head):
        return _int4_linear(self, x, name, w, source, grid)
    scale = np.abs(w).max(axis=1) / 63
    scale[scale == 0] = 1
    quantized = np.ascontiguousarray(np.round(w / scale[:, None]).astype(np.int8).T)
    g = self.g
    return g.op("DynamicQuantizeMatMul", x, g.weight(name + ".q7", quantized),
                g.weight(name + ".s7", scale.astype(np.float32)), g.weight(name + ".z7", np.zeros(len(scale), np.int8)),
                hint="mm", domain="com.microsoft")


_int4_linear = graph.DecoderBuilder.linear


def _grow_with_each(pair: Pair, texts: list[str], n: int) -> dict[str, list]:
    """Prints each drafter's expand times; returns per drafter, summed over the prompts: [growth seconds, target
    passes, tokens]."""
    spec = pair.spec
    int4 = pair.swap_drafter("onnx", 0, report=print)  # the pair's file as the int4 graph with its full head
    llama = open_drafter(spec, replace(spec.drafter, runtime="llama_cpp", vocab=None), pair.target.path,
                         pair.drafter_threads, 0, print)
    graph.DecoderBuilder.linear = _dynamic_quantize_linear
    variant = onnx_runtime._variant
    onnx_runtime._variant = lambda *args: variant(*args) + ".dq7"
    options = onnx_runtime.OnnxOptions(threads=pair.drafter_threads, n_ctx=spec.ctx + 256)
    dq = onnx_runtime.load_drafter(materialize(spec.drafter, print), options, None, print)
    drafters = {"llama_cpp": llama, "onnx int4": int4, "onnx dq7": dq}

    prefix = pair.target.tokenizer.tokenize(CALIBRATION_TEXT, add_special=True, parse_special=False)
    for name, drafter in drafters.items():
        ms = expand_ms(drafter, prefix, sizes=(1, 4, 8, 32), repeats=7)
        print(f"{name:10s} expand ms for 1 / 4 / 8 / 32 nodes: " + " / ".join(f"{v:.1f}" for v in ms.values()))
    totals = {name: [0.0, 0, 0] for name in drafters}
    for text in texts:  # prompt by prompt, every drafter in turn
        for name, drafter in drafters.items():
            decoder = Decoder(pair.target, drafter, GrowConfig.for_budget(64), SamplingConfig())
            decoder.load(pair.prompt_tokens(text))
            stats = list(decoder.generate(n))[-1].stats
            totals[name][0] += stats.draft_s
            totals[name][1] += stats.target_passes
            totals[name][2] += stats.new_tokens
    llama.close()
    dq.close()
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", required=True)
    parser.add_argument("--prompts", type=Path, default=Path("benchmarks/chat-prompts.txt"))
    parser.add_argument("-n", type=int, default=64, help="tokens per prompt")
    args = parser.parse_args()

    with edge.load(args.pair, report=lambda message: print(message, file=sys.stderr), placement="ram") as pair:
        totals = _grow_with_each(pair, read_prompts(args.prompts), args.n)
    for name, (draft_s, passes, tokens) in totals.items():
        print(f"{name:10s} budget 64: grow {draft_s / passes:.4f} s/round, {tokens / passes:.2f} tokens/pass")


if __name__ == "__main__":
    try:
        main()
    except edge.UserError as error:
        from edge.cli.render import worded

        sys.exit(f"error: {worded(error)}")
