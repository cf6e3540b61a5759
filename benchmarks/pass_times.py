"""A target's pass time t(n) as edge-spec loads it, beside what `edge-spec plan` predicts (docs/performance.md,
"Bigger than RAM").

    python benchmarks/pass_times.py /data/llama3.1-70b-random.q4_0.gguf --drafter SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/pass_times.py smollm2-135m --sizes 1x5,16x5,64x5,256x3

Loads the pair the way generate does (the plan decides the placement: a target larger than RAM is used from its
file's mapping and the kernel streams it; nothing is evicted by hand), then times one target pass over a chain of
n new tokens for each size (NxR: R passes, the median kept), after a one-token prefix. For each pass it records
the bytes the process read from the drive (/proc/self/io), and over the whole run the peak resident memory, split
into anonymous memory (what the process allocated: KV cache, buffers) and file pages (the mapping's pages the
kernel holds for it at the moment, which it evicts under pressure). Sizes whose predicted pass exceeds
--max-pass-s are skipped.

`fit` gives the constants the measured passes imply under the plan's model (offload.plan.fit_constants: from the
drive, t(n) = read + n x per-token compute), and each row's `fitted_s` the plan's prediction with them.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from edge.models.loading import resolve_spec
from edge.models.planning import make_plan
from edge.offload.plan import fit_constants, pass_cost
from edge.offload.probe import probe_machine
from edge.offload.ssd import read_bytes
from edge.offload.tuning import timing_chain

import edge
from edge.options import LoadOptions


class MemoryPeaks:
    """The largest anonymous and file-backed resident sets seen, sampled every `every` seconds on a thread."""

    def __init__(self, every: float = 0.2):
        self.anon = self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.sample()

    def sample(self) -> None:
        status = _status()
        self.anon = max(self.anon, status.get("RssAnon", 0))
        self.file = max(self.file, status.get("RssFile", 0))

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return {"peak_rss_gib": _gib(_status().get("VmHWM", 0)), "peak_anon_gib": _gib(self.anon),
                "peak_file_pages_gib": _gib(self.file)}


def _status() -> dict[str, int]:
    values = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def _gib(n: float) -> float:
    return round(n / 2**30, 3)


def kernel_switches() -> dict[str, str]:
    """llama.cpp's K-quant kernel switches as this run had them (runtimes/llama_cpp/kernels.py)."""
    import os

    return {name: value for name, value in os.environ.items() if name.startswith("GGML_CPU_TILED")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a pair of models.toml or a GGUF file")
    parser.add_argument("--drafter", help="the drafter, for a GGUF file (loaded as generate loads it)")
    parser.add_argument("--sizes", default="1x3,4x2,16x2,64x2,128,256",
                        help="tokens per pass, comma-separated, each with xR to time R passes (default 1 pass)")
    parser.add_argument("--max-pass-s", type=float, default=240.0, help="skip sizes predicted to take longer")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--placement", choices=("ram", "ssd"), default="ram",
                        help="ssd: the target's pages evicted after every pass, as generate --placement ssd runs it")
    args = parser.parse_args()
    try:
        sizes = [(int(n), int(r or 1)) for n, _, r in (p.strip().partition("x") for p in args.sizes.split(",") if p)]
    except ValueError:
        sys.exit(f"error: --sizes takes N or NxR, comma-separated, like 1x3,16x2,64 (got {args.sizes!r})")
    largest = max(n for n, _ in sizes)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731

    options = LoadOptions(pair=args.model, drafter=args.drafter, threads=args.threads, placement=args.placement,
                          budget=largest - 1 if largest > 256 else None)
    spec, models_file = resolve_spec(options)
    plan = make_plan(spec, None, models_file or Path("models.toml"))  # before loading: RAM free as the load sees it
    peaks = MemoryPeaks()
    started = time.perf_counter()
    with edge.load(options, report=say) as pair:
        load_s = time.perf_counter() - started
        target, placement = pair.target, pair.placement
        prefix = [max(target.special.bos, 0)]
        rows = []
        for n, repeats in sizes:
            predicted = pass_cost(plan.target, plan.machine, n)
            if predicted.seconds > args.max_pass_s:
                say(f"t({n}): skipped, predicted {predicted.seconds:.0f} s > --max-pass-s {args.max_pass_s:g}")
                continue
            times, reads = [], []
            for _ in range(repeats):
                target.truncate(0)
                before, start = read_bytes() or 0, time.perf_counter()
                target.verify(timing_chain(prefix[-1], n))
                times.append(time.perf_counter() - start)
                reads.append((read_bytes() or 0) - before)
                if pair.placement == "ssd":
                    target.streamer.wait_evicted()  # the eviction after the pass runs in a thread: not timed
            measured = float(np.median(times))
            rows.append({"n": n, "measured_s": round(measured, 3), "passes_s": [round(t, 3) for t in times],
                         "read_gib_per_pass": _gib(float(np.median(reads))), "predicted_s": round(predicted.seconds, 3),
                         "predicted_bound": predicted.bound, "error": round(predicted.seconds / measured - 1, 3)})
            say(f"t({n}) = {measured:.2f} s (plan: {predicted.seconds:.2f} s, {predicted.bound}), "
                f"read {rows[-1]['read_gib_per_pass']:.2f} GiB a pass")
        target.truncate(0)
    memory = peaks.stop()
    fit = fit_constants(plan.target, plan.machine, {row["n"]: row["passes_s"] for row in rows})
    if fit is not None:
        fitted_machine = replace(plan.machine, **{key: fit[key] for key in ("disk_gbps", "ram_gbps") if key in fit})
        for row in rows:
            cost = pass_cost(plan.target, fitted_machine, row["n"], cpu_gflops_per_core=fit["cpu_gflops_per_core"])
            row["fitted_s"] = round(cost.seconds, 3)
            row["fitted_error"] = round(cost.seconds / row["measured_s"] - 1, 3)
    here = probe_machine()
    print(json.dumps({
        "model": args.model, "target": plan.target.shape.source, "kernels": kernel_switches(),
        "file_gib": _gib(plan.target.shape.file_bytes),
        "placement": placement, "repack": plan.target.repack and placement == "ram", "machine": plan.machine.describe(),
        "ram_total_gib": here["ram_total_gb"], "cpu": here["cpu"],
        "load_s": round(load_s, 2), **memory, "rows": rows, "fit": fit,
    }, indent=2))


if __name__ == "__main__":
    try:
        main()
    except edge.UserError as error:
        from edge.cli.render import worded

        sys.exit(f"error: {worded(error)}")
