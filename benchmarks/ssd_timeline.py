"""Where a round's time goes with the target streamed from the SSD (docs/performance.md).

    python benchmarks/ssd_timeline.py --pair gemma3-270m --prompts benchmarks/text-prompts.txt --drafter-vocab 32768
    python benchmarks/ssd_timeline.py --pair smollm2-135m --prompts benchmarks/chat-prompts.txt

Decodes each prompt with a fixed tree budget (0: plain decoding) from a 16-bit target under `--placement ssd`, and
prints per round, in ms from the round's start: the eviction after the previous pass (it overlaps the round's
start), the readahead, the growth, the target pass, and how long the pass ran on after the last byte was read;
then the medians, and the tokens per pass and tokens per second of all the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from edge.models.bench import read_prompts
from edge.offload.ssd import embedding_table, pass_order

import edge
from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.sampling import SamplingConfig

COLUMNS = ("evict", "read_from", "read_to", "grow", "pass_to", "pass_after_read", "round")


class _Recorder:
    """A fixed-budget BudgetPolicy that keeps each round's timings."""

    def __init__(self, config: GrowConfig | None, streamer):
        self.config, self.streamer, self.rows = config, streamer, []
        self._start = None

    def choose(self, max_nodes: int, rule: str = "match") -> GrowConfig | None:
        self._start = time.perf_counter()
        return self.config

    def observe(self, config, result, rule: str = "match") -> None:
        end = time.perf_counter()
        # this round's stamps: the eviction after the previous pass (the entry before the one this pass started)
        stamps = self.streamer.timeline[-2] if len(self.streamer.timeline) > 1 else {}
        start = stamps.get("prefetch", self._start)
        pass_end = start + result.grow_s + result.verify_s

        def rel(key):
            return 1000 * (stamps[key] - start) if key in stamps else float("nan")

        self.rows.append({
            "evict": 1000 * (stamps["evicted_end"] - stamps["evicted"]) if "evicted_end" in stamps else float("nan"),
            "read_from": rel("read"), "read_to": rel("read_end"),
            "grow": 1000 * result.grow_s, "pass_to": 1000 * (pass_end - start),
            "pass_after_read": 1000 * (pass_end - stamps["read_end"]) if "read_end" in stamps else float("nan"),
            "round": 1000 * (end - self._start), "tokens": len(result.tokens),
        })

    def hold_timing(self, held: bool) -> None:
        pass  # a fixed tree, as FixedBudget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--budget", type=int, default=16, help="tree budget; 0 decodes plainly")
    parser.add_argument("--drafter-vocab", type=int, default=None, help="an onnx drafter with this trimmed head")
    parser.add_argument("--target-dtype", default="f16")
    parser.add_argument("-n", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--beams", type=int, default=None, help="nodes per drafter pass (default: the budget's)")
    parser.add_argument("--steps", type=int, default=None, help="drafter passes per round (default: the budget's)")
    parser.add_argument("--grow-after-eviction", action="store_true",
                        help="the drafter starts growing only once the eviction is done (docs/performance.md)")
    parser.add_argument("--show", type=int, default=6, help="rounds printed one by one")
    parser.add_argument("--table", choices=("auto", "first", "last"), default="auto",
                        help="where the readahead reads a tied embedding table (auto: offload.ssd.readahead_order)")
    args = parser.parse_args()

    config = GrowConfig.for_budget(args.budget) if args.budget else None
    if config is not None and args.beams:
        config = replace(config, beams=args.beams)
    if config is not None and args.steps:
        config = replace(config, max_steps=args.steps, max_depth=max(config.max_depth, 2 * args.steps))
    texts = read_prompts(args.prompts)
    with edge.load(args.pair, report=lambda message: print(message, file=sys.stderr), placement="ssd",
                   target_dtype=args.target_dtype, drafter_runtime="onnx" if args.drafter_vocab else None,
                   drafter_vocab=args.drafter_vocab) as pair:
        if args.table != "auto":
            _place_table(pair.target.streamer, first=args.table == "first")
        if args.grow_after_eviction:
            _grow_after_eviction(pair.target)
        recorder = _Recorder(config, pair.target.streamer)
        decoder = Decoder(pair.target, pair.drafter, recorder, SamplingConfig())
        for text in texts:
            decoder.reset()
            decoder.load(pair.prompt_tokens(text))
            for _ in decoder.generate(args.n):
                pass
            recorder.rows.pop(0)  # a prompt's first round follows the prefill, not a round
    rows = recorder.rows
    shape = f" ({config.beams} beams x {config.width} children, {config.max_steps} passes)" if config else ""
    print(f"{args.pair}, budget {args.budget or 'plain'}{shape}, {len(texts)} prompts x {args.n} tokens, "
          f"{len(rows)} rounds (ms from the round's start)")
    print(" ".join(f"{c:>15s}" for c in COLUMNS))
    for row in rows[: args.show]:
        print(" ".join(f"{row[c]:15.1f}" for c in COLUMNS))
    print(" ".join(f"{_median([row[c] for row in rows]):15.1f}" for c in COLUMNS), " <- medians")
    tokens, seconds = sum(row["tokens"] for row in rows), sum(row["round"] for row in rows) / 1000
    print(f"tokens per pass {tokens / len(rows):.2f}, mean round {1000 * seconds / len(rows):.1f} ms, "
          f"{tokens / seconds:.1f} tokens/s")


def _place_table(streamer, first: bool) -> None:
    """Reads a tied embedding table first or last, instead of where readahead_order puts it."""
    order = pass_order(streamer.path)
    table = embedding_table(order)
    if table is None or any(t.name == "output.weight" for t in order):
        raise SystemExit("--table: the target has no tied embedding table")
    rest = [t for t in order if t is not table]
    streamer._ranges = streamer._address_ranges([table, *rest] if first else [*rest, table])


def _grow_after_eviction(target) -> None:
    """The round's prefetch (as growth starts) first waits for the previous pass's eviction to end."""
    prefetch = target.prefetch

    def wait_then_prefetch() -> None:
        target.streamer.wait_evicted()
        prefetch()

    target.prefetch = wait_then_prefetch


def _median(values: list[float]) -> float:
    known = [v for v in values if v == v]  # nan: not measured in that round
    return statistics.median(known) if known else float("nan")


if __name__ == "__main__":
    try:
        main()
    except edge.UserError as error:
        from edge.cli.render import worded

        sys.exit(f"error: {worded(error)}")
