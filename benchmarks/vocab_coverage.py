"""How much of the target's own text a trimmed drafter head can propose: the share of the target's plain (greedy)
tokens on a prompt set that lie outside each prepared K-token vocabulary.

    python benchmarks/vocab_coverage.py --pair gemma3-270m --prompts benchmarks/text-prompts.txt --vocab 32768

Every such token ends a round where a full-vocabulary drafter could have gone on, unless the context already
holds it (the ONNX drafter scores the context's tokens beside its head): otherwise the drafter cannot propose it,
so the target's pass emits it as its correction. The vocabularies are the ones `edge-spec prepare PAIR --vocab K`
wrote (counted on the calibration prompts, not on these).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from edge.models.bench import read_prompts
from edge.models.loading import resolve_spec
from edge.models.opening import head_ids
from replay import plain_replies  # benchmarks/replay.py, beside this script

import edge
from edge.sampling import SamplingConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--vocab", default="32768", help="comma-separated K of prepared vocabularies")
    parser.add_argument("-n", type=int, default=128, help="tokens per prompt")
    args = parser.parse_args()

    spec, _ = resolve_spec(edge.LoadOptions(pair=args.pair))
    sizes = [int(k) for k in args.vocab.split(",")]  # a missing vocabulary fails before the pair loads
    vocabs = {k: set(head_ids(spec, replace(spec.drafter, vocab=k)).tolist()) for k in sizes}
    # the drafter is not used: llama.cpp's opens without building an onnx graph
    with edge.load(args.pair, report=lambda message: print(message, file=sys.stderr),
                   drafter_runtime="llama_cpp") as pair:
        prompts = [pair.prompt_tokens(text) for text in read_prompts(args.prompts)]
        replies = plain_replies(pair.target, prompts, args.n, SamplingConfig())
    tokens = [token for reply in replies for token in reply]
    print(f"{args.pair}: {len(tokens)} greedy tokens of the target over {len(prompts)} prompts")
    for k, ids in vocabs.items():
        outside = sum(token not in ids for token in tokens)
        print(f"  vocab {k}: {outside} outside ({100 * outside / len(tokens):.2f}%)")


if __name__ == "__main__":
    try:
        main()
    except edge.UserError as error:
        from edge.cli.render import worded

        sys.exit(f"error: {worded(error)}")
