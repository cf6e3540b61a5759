"""What huge pages give a target's repacked weights: one process, one loaded target decoding plainly as `auto` loads
it in RAM (llama.cpp's repacked weights and kernels), the weights moved between small and huge pages in turn, the same
greedy tokens timed on each. Alternating in one process keeps the machine's drift out of the ratio.

    python benchmarks/huge_pages.py -m qwen2.5-coder-1.5b --rounds 6 -n 64

Back to small pages: each huge page's bytes are copied out, the page dropped (MADV_DONTNEED) and the bytes written
back, with the region marked MADV_NOHUGEPAGE (nothing else runs in the process meanwhile).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import numpy as np

MADV_NOHUGEPAGE = 15


def small_pages(regions: list[tuple[int, int]], size: int) -> None:
    from edge.offload import libc

    scratch = ctypes.create_string_buffer(size)
    for start, end in regions:
        first, last = -(-start // size) * size, end // size * size
        libc.madvise(first, last - first, MADV_NOHUGEPAGE)
        for page in range(first, last, size):
            ctypes.memmove(scratch, page, size)
            libc.madvise(page, size, libc.MADV_DONTNEED)
            ctypes.memmove(page, scratch, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--pair", default="qwen2.5-coder-1.5b")
    parser.add_argument("--rounds", type=int, default=6, help="alternations of the two page sizes")
    parser.add_argument("-n", type=int, default=64, help="greedy tokens timed each time")
    args = parser.parse_args()

    from edge.offload import libc
    from edge.runtimes.llama_cpp._native import large_regions_since

    import edge
    from edge.sampling import SamplingConfig

    before = libc.anonymous_regions()
    pair = edge.load(args.pair, speculate="auto")  # in RAM: the target alone, repacked, moved onto huge pages
    regions = large_regions_since(before)
    size = libc.huge_page_size()
    decoder = pair.decoder(SamplingConfig(), speculate=True)
    prompt = pair.prompt_tokens("Write a Python function that parses an ISO date and explain the edge cases.")
    first_ids: list[int] | None = None
    rates: dict[str, list[float]] = {"huge": [], "small": []}
    for _ in range(args.rounds):
        for kind in ("small", "huge"):
            if kind == "huge":
                libc.collapse_to_huge_pages(regions)
            else:
                small_pages(regions, size)
            decoder.reset()
            started = time.perf_counter()
            steps = list(decoder.reply(prompt, args.n))
            ids = [step.token for step in steps[:-1] if step.token is not None]
            rates[kind].append(len(ids) / (time.perf_counter() - started))
            first_ids = first_ids or ids
            if ids != first_ids:
                raise SystemExit("the tokens changed with the page size")
    print(json.dumps({"pair": args.pair, "repacked_mib": sum(e - s for s, e in regions) >> 20,
                      "huge_tok_s": [round(r, 2) for r in rates["huge"]],
                      "small_tok_s": [round(r, 2) for r in rates["small"]],
                      "huge_over_small": round(float(np.mean(rates["huge"]) / np.mean(rates["small"])), 4),
                      "huge_page_bytes_at_load": pair.target.model.huge_page_bytes}))


if __name__ == "__main__":
    main()
