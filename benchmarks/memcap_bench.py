"""The SSD emulation checked against the real thing: `edge-spec bench` twice in one command, on the same prompts.

    python benchmarks/memcap_bench.py --pair gemma3-270m --prompts benchmarks/text-prompts.txt --drafters onnx:32768
    python benchmarks/memcap_bench.py --pair smollm2-135m -n 32 [--cap 200M | --room 0.25] [--json]

1. emulated: `--placement ssd`, edge-spec evicts the target's pages after every pass (and reads them ahead while the
   drafter grows a tree), in a memory cgroup without a limit that only counts;
2. capped: `--placement ram` (edge-spec evicts nothing and reads nothing ahead) in a memory cgroup whose limit leaves
   the process its anonymous memory (the emulated run's peak) and `--room` of the target file's size for the page
   cache, so the kernel itself must stream the mmap'd target from the disk on every pass (benchmarks/memcap.py).

A one-prompt, one-token warm-up runs first, so that what a first run prepares (a requantized target, an ONNX graph)
is made before the measured runs and its memory does not raise the cap. Both decode plainly and with
`--budget auto` (and any other --budgets); it prints both runs' rows, and for each tree budget the ratio of the two
speedups. Other options (--threads, --temperature...) go to both runs. With `--placement ssd` the drafter runs on
one thread fewer (a core is left to the readahead), with `ram` on all of them: `--capped-placement ssd` runs the
capped row with the same threads and readahead, on top of the kernel's streaming.
Needs root and a cgroup v1 memory controller; where there is none it says so in one line and stops (exit 0).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import memcap  # benchmarks/, the script's folder
from edge.models.bench import read_prompts

import edge

EDGE_SPEC = [sys.executable, "-c", "from edge.cli.main import main; main()"]  # `edge-spec`, on this interpreter
MB = 1e6
_SIZE_RE = re.compile(r"^(\d+(?:\.\d*)?)\s*([kmg]?)(?:i?b)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """200M, 1.5G, 700MiB (binary units, as memory is sold) or a number of bytes."""
    match = _SIZE_RE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 700M or 1.5G")
    return round(float(match[1]) * 1024 ** " kmg".index((match[2] or " ").lower()))


def target_file(pair: str | None, target_dtype: str | None) -> Path:
    """The target file both runs load (prepared now if --target-dtype asks for a rewrite not made yet)."""
    from edge.models.loading import resolve_spec
    from edge.models.opening import materialize

    spec, _ = resolve_spec(edge.LoadOptions(pair=pair, target_dtype=target_dtype))
    return materialize(spec.target, lambda message: print(message, file=sys.stderr, flush=True))


def bench(command: list[str], limit: int | None, target: Path, label: str) -> tuple[dict, memcap.CappedRun]:
    """One `edge-spec bench --json` run in its own memory cgroup: its result and its memory figures."""
    cap = "no cap" if limit is None else f"a {limit / MB:.0f} MB cap"
    print(f"{label}: {' '.join(command[3:])} under {cap}", file=sys.stderr, flush=True)
    run = memcap.run_capped(command, limit, drop_cache=[target], capture=False, stdout=subprocess.PIPE, text=True)
    if run.returncode != 0:
        why = f"killed for memory under {cap}: raise --cap or --room" if run.oom_kills else (
            f"exit code {run.returncode} (its error is above)")
        raise edge.UserError(f"the {label} bench run failed: {why}")
    return json.loads(run.stdout), run


def rows_of(result: dict) -> list[dict]:
    return [row for row in result["rows"] if row["method"] in ("plain", "tree")]


def render(report: dict) -> None:
    runs = report["runs"]
    print(f"{report['pair']}: target {Path(report['target_file']).name} ({report['target_bytes'] / MB:.0f} MB), "
          f"{runs['emulated']['prompts']} prompts x {runs['emulated']['max_tokens']} tokens, "
          f"{runs['emulated']['sampling']}")
    print(f"cap {report['cap_bytes'] / MB:.0f} MB ({report['cap_from']})")
    print(f"{'run':<9} {'placement':<9} {'row':<10} {'tok/s':>7} {'speedup':>8} {'tok/pass':>8} {'MB read/pass':>12} "
          f"{'same':>5}  peak anon / all MB  t(1/16/64) ms")
    for label, result in runs.items():
        memory = result["memory"]
        times = "/".join(f"{ms:.0f}" for ms in next(iter(result["target_pass_ms"].values())).values())
        for row in rows_of(result):
            name = "plain" if row["method"] == "plain" else f"tree {row['budget']}"
            read = "-" if row["bytes_read_per_pass"] is None else f"{row['bytes_read_per_pass'] / MB:.0f}"
            print(f"{label:<9} {result['placement']:<9} {name:<10} {row['tokens_per_s']:>7.1f} "
                  f"{row['speedup']:>7.2f}x {row['tokens_per_pass']:>8.2f} {read:>12} "
                  f"{'yes' if row['matches_plain'] else 'no':>5}  {memory['peak_anon_bytes'] / MB:>6.0f} / "
                  f"{memory['peak_bytes'] / MB:<6.0f}       {times}")
    for budget, ratio in report["speedup_ratio"].items():
        emulated, capped = ratio["emulated"], ratio["capped"]
        print(f"tree {budget}: speedup {emulated:.2f}x emulated, {capped:.2f}x capped: the emulation's is "
              f"{ratio['ratio']:.2f}x the capped one's ({(ratio['ratio'] - 1) * 100:+.0f}%)")


def speedup_ratios(emulated: dict, capped: dict) -> dict[str, dict[str, float]]:
    """For each tree budget in both runs: both speedups over their own plain decoding, and emulated / capped."""
    capped_rows = {row["budget"]: row for row in rows_of(capped) if row["method"] == "tree"}
    ratios = {}
    for row in rows_of(emulated):
        other = capped_rows.get(row["budget"])
        if row["method"] == "tree" and other is not None and other["speedup"]:
            ratios[str(row["budget"])] = {"emulated": row["speedup"], "capped": other["speedup"],
                                          "ratio": round(row["speedup"] / other["speedup"], 3)}
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="other options go to both `edge-spec bench` runs")
    parser.add_argument("--pair", help="a pair of models.toml or a GGUF file (default: the default pair)")
    parser.add_argument("--prompts", type=Path, help="one prompt per line (default: the repo's chat prompts)")
    parser.add_argument("--target-dtype", default="f16", help="f16 (default): a file llama.cpp maps, not repacks")
    parser.add_argument("--budgets", default="auto", help="tree budgets for both runs (default: auto)")
    parser.add_argument("-n", "--max-tokens", type=int, default=64)
    parser.add_argument("--cap", type=parse_size, help="the capped run's limit, e.g. 700M (default: see --room)")
    parser.add_argument("--room", type=float, default=0.25,
                        help="without --cap: the cap is the emulated run's peak anonymous memory plus this share of "
                             "the target file (default 0.25)")
    parser.add_argument("--capped-placement", choices=("ram", "ssd"), default="ram")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args, passed_on = parser.parse_known_args()
    reason = memcap.unavailable()
    if reason is not None:
        print(f"skipped: no memory cap can be set here ({reason})")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still removes the cgroups (their finally blocks)

    target = target_file(args.pair, args.target_dtype)

    def command(prompts: Path | None, max_tokens: int, placement: str) -> list[str]:
        return [*EDGE_SPEC, "bench", *(["--pair", args.pair] if args.pair else []),
                *(["--prompts", str(prompts)] if prompts else []), "--target-dtype", args.target_dtype,
                "--methods", "plain,tree", "--budgets", args.budgets, "-n", str(max_tokens), "--json", *passed_on,
                "--placement", placement]

    with tempfile.TemporaryDirectory() as folder:
        first = Path(folder) / "first-prompt.txt"
        first.write_text(read_prompts(args.prompts)[0] + "\n")
        bench(command(first, 1, "ssd"), None, target, "warm-up")
    emulated, emulated_run = bench(command(args.prompts, args.max_tokens, "ssd"), None, target, "emulated")
    size = target.stat().st_size
    if args.cap is not None:
        cap, cap_from = args.cap, "--cap"
    else:
        cap = emulated_run.peak_anon_bytes + round(args.room * size)
        cap_from = (f"the emulated run's peak anonymous memory {emulated_run.peak_anon_bytes / MB:.0f} MB + "
                    f"{args.room:g} x the target's {size / MB:.0f} MB")
    capped, capped_run = bench(command(args.prompts, args.max_tokens, args.capped_placement), cap, target, "capped")
    for result, run in ((emulated, emulated_run), (capped, capped_run)):
        result["memory"] = {"limit_bytes": run.limit_bytes, "peak_bytes": run.peak_bytes,
                            "peak_anon_bytes": run.peak_anon_bytes, "seconds": round(run.seconds, 1)}
    report = {"pair": emulated["pair"], "target_file": str(target), "target_bytes": size, "cap_bytes": cap,
              "cap_from": cap_from, "runs": {"emulated": emulated, "capped": capped},
              "speedup_ratio": speedup_ratios(emulated, capped)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
    streamed = [row["bytes_read_per_pass"] for row in rows_of(capped) if row["method"] == "plain"]
    if not args.json and streamed and streamed[0] is not None and streamed[0] < 0.5 * size:
        print(f"warning: the capped run's plain passes read {streamed[0] / MB:.0f} MB each, less than half the "
              "target: it was not streamed (cached by another cgroup, or the cap leaves room for it)")


if __name__ == "__main__":
    try:
        main()
    except edge.UserError as error:
        from edge.cli.render import worded

        sys.exit(f"error: {worded(error)}")
