"""A drafter pass's cost as the committed context grows (docs/drafter.md, "What a pass costs in a real round").

    python benchmarks/drafter_context.py --pair smollm2-135m

`expand_ms` (offload.tuning, as the bench reports it) for 1, 4 and 8 sibling nodes after 20, 60, 120 and 200 tokens
of context, for the pair's drafter and for llama.cpp's on the same GGUF file, alternating, the target in RAM.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from edge.models.opening import open_drafter
from edge.models.pair import CALIBRATION_TEXT
from edge.offload.tuning import expand_ms

import edge

CONTEXTS = (20, 60, 120, 200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", required=True)
    args = parser.parse_args()

    with edge.load(args.pair, report=lambda message: print(message, file=sys.stderr), placement="ram") as pair:
        spec = pair.spec
        llama = open_drafter(spec, replace(spec.drafter, runtime="llama_cpp", vocab=None), pair.target.path,
                             pair.drafter_threads, 0, print)
        try:
            text = pair.target.tokenizer.tokenize(CALIBRATION_TEXT * 20, add_special=True, parse_special=False)
            print("context  drafter     ms for 1 / 4 / 8 nodes")
            for n in CONTEXTS:
                for name, drafter in ((spec.drafter.runtime, pair.drafter), ("llama_cpp", llama)):
                    ms = expand_ms(drafter, text[:n], sizes=(1, 4, 8), repeats=7)
                    print(f"{n:7d}  {name:10s}  " + " / ".join(f"{v:.1f}" for v in ms.values()))
        finally:
            llama.close()


if __name__ == "__main__":
    try:
        main()
    except edge.UserError as error:
        from edge.cli.render import worded

        sys.exit(f"error: {worded(error)}")
