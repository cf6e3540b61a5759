"""How long a pair's chat replies run under a sampling set: each chat prompt, a fresh conversation, up to N tokens,
for a few seeds. A reply that reaches N has not ended its turn (it loops or rambles). Chat's default sampling
(edge.sampling.chat_defaults: llama.cpp's set and CHAT_REPEAT_PENALTY) was chosen with it:

    python benchmarks/chat_lengths.py --seeds 1,2,3,4
    python benchmarks/chat_lengths.py --seeds 1,2,3,4 --set repeat_penalty=1.0      # llama.cpp's set alone
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(prog="chat_lengths.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default=None, help="default: the default pair")
    parser.add_argument("--prompts", type=Path, default=REPO / "benchmarks" / "chat-prompts.txt")
    parser.add_argument("--seeds", default="1", help="comma-separated")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="change one field of the pair's chat sampling (repeat: --set temperature=0.6)")
    args = parser.parse_args()

    import edge
    from edge.sampling import chat_defaults

    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    with edge.load(args.pair) as pair:
        sampling = chat_defaults(pair.sampling, pair.recommended)
        for change in args.set:
            name, _, value = change.partition("=")
            kind = type(getattr(sampling, name))
            sampling = dataclasses.replace(sampling, **{name: kind(value)})
        runs = {}
        for seed in [int(s) for s in args.seeds.split(",")]:
            lengths = []
            for prompt in prompts:
                reply = edge.generate(pair, [{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                                      sampling=dataclasses.replace(sampling, seed=seed), speculate=False)
                lengths.append(len(reply.tokens) if reply.finish_reason == "stop" else args.max_tokens)
            runs[str(seed)] = lengths
        at_limit = sum(length >= args.max_tokens for lengths in runs.values() for length in lengths)
        print(json.dumps({"pair": pair.name, "sampling": sampling.described(), "max_tokens": args.max_tokens,
                          "lengths_by_seed": runs, "replies": len(prompts) * len(runs),
                          "replies_at_the_limit": at_limit}, indent=2))


if __name__ == "__main__":
    main()
