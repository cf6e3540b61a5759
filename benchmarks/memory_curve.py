"""Tokens/s against the memory limit: the real pair at each limit, edge-spec's plain decoding and its `auto` (as a
person gets it: the plan chooses the use of the memory) beside llama.cpp's plain decoding and its speculative
configurations, each side in its own memory cgroup (benchmarks/peer_llama_cpp.py, one run per limit).

    python benchmarks/memory_curve.py -m qwen2.5-coder-1.5b --limits none,2600,1700,1300,1175,1049,900 \\
        --out docs/memory-curve.json --png docs/memory-curve.png

Writes one JSON file (every row of every limit, the plan's choice, bytes read per pass) and a PNG: tokens/s against
the limit, a line per row kind ("edge-spec auto", "edge-spec plain", "llama.cpp plain", "llama.cpp best
speculative"). A limit where a side could not run gives no point for it (its error is in the JSON). At the limits
of --alternate (those where llama.cpp holds the target in RAM), edge-spec auto and llama.cpp plain run twice each, in
turn, and each point is both runs together.

    python benchmarks/memory_curve.py --from RUN1.json,RUN2.json --out docs/memory-curve.json \\
        --png docs/memory-curve.png

runs nothing: it joins the limits of earlier runs (a later file's limit replacing an earlier one's; each limit
keeps the commit it ran at) into one JSON file and picture.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINES = ("edge-spec auto", "edge-spec plain", "llama.cpp plain", "llama.cpp best speculative")
NAMES = {"edge-spec plain": "edge-spec, drafter kept (plain decoding)"}  # the row's name in the picture


def commit() -> str | None:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def joined(files: list[Path]) -> dict:
    """The limits of earlier runs' JSON files in one, largest limit first; a later file's limit replaces an earlier
    one's."""
    runs = [json.loads(path.read_text()) for path in files]
    limits = {result["limit_mib"]: result for run in runs for result in run["limits"]}
    first = runs[0]
    return {"pair": first["pair"], "n": first["n"], "prompts": first["prompts"], "from": [f.name for f in files],
            "limits": sorted(limits.values(), key=lambda r: -(r["limit_mib"] or 1 << 40))}


def run_limit(args: argparse.Namespace, limit: int | None) -> dict:
    command = [sys.executable, str(REPO / "benchmarks" / "peer_llama_cpp.py"), "-m", args.pair, "-n", str(args.n),
               "--prompts", str(args.prompts), "--draft-max", args.draft_max, "--json"]
    if limit is not None:
        command += ["--cap-mb", str(limit)]
    if ("none" if limit is None else str(limit)) in args.alternate.split(","):
        command.append("--alternate")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"limit_mib": limit, "commit": commit(),
                "error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return {"limit_mib": limit, "commit": commit(), **json.loads(done.stdout)}


def points(result: dict) -> dict[str, float]:
    """Each line's tokens/s at one limit: the best speculative configuration of llama.cpp's is its own line."""
    rows = {row["row"]: row for row in result.get("rows", [])}
    out = {label: rows[label]["decode_tokens_per_s"] for label in LINES[:3]
           if label in rows and rows[label].get("decode_tokens_per_s")}
    speculative = [row["decode_tokens_per_s"] for label, row in rows.items()
                   if label.startswith("llama.cpp speculative") and row.get("decode_tokens_per_s")]
    if speculative:
        out["llama.cpp best speculative"] = max(speculative)
    return out


def plot(results: list[dict], png: Path, machine_ram_mib: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    # the limits evenly spaced, smallest first (none: the machine's RAM, last): the interesting ones lie close together
    limits = sorted({r["limit_mib"] or machine_ram_mib for r in results})
    for label in LINES:
        xy = [(limits.index(r["limit_mib"] or machine_ram_mib), points(r)[label]) for r in results
              if label in points(r)]
        if xy:
            xs, ys = zip(*sorted(xy), strict=True)
            axes.plot(xs, ys, marker="o", label=NAMES.get(label, label))
    axes.set_xticks(range(len(limits)), [str(t) if t != machine_ram_mib else "none" for t in limits])
    axes.set_xlabel("memory limit (MiB; the target file is 1060 MiB)")
    axes.set_ylabel("decode tokens/s")
    axes.set_yscale("log")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    axes.set_title("Qwen2.5-Coder-1.5B drafted by 0.5B: tokens/s against the memory limit")
    figure.tight_layout()
    figure.savefig(png, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--pair", default="qwen2.5-coder-1.5b")
    parser.add_argument("--prompts", type=Path, default=REPO / "benchmarks" / "chat-prompts.txt")
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--limits", default="none,2600,1700,1300,1175,1049,900",
                        help="memory limits in MiB, largest first; none: no limit")
    parser.add_argument("--draft-max", default="4,8", help="llama.cpp's draft lengths besides its default")
    parser.add_argument("--alternate", default="none,2600,1700,1300",
                        help="limits where edge-spec auto and llama.cpp plain each run twice, in turn (auto, plain, "
                             "..., plain, auto; peer_llama_cpp.py --alternate): where both hold the target in RAM on "
                             "the same kernels, the machine's drift between two runs is the whole difference")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--png", type=Path, default=None, help="the PNG to draw")
    parser.add_argument("--from", dest="runs", default=None,
                        help="comma-separated JSON files of earlier runs to join (nothing runs)")
    args = parser.parse_args()
    if args.runs:
        import psutil

        out = joined([Path(name) for name in args.runs.split(",") if name])
        args.out.write_text(json.dumps(out, indent=2))
        if args.png is not None:
            plot(out["limits"], args.png, psutil.virtual_memory().total >> 20)
        return
    limits = [None if text == "none" else int(text) for text in args.limits.split(",") if text]
    results = []
    for limit in limits:
        print(f"limit {limit or 'none'}", file=sys.stderr, flush=True)
        results.append(run_limit(args, limit))
        args.out.write_text(json.dumps({"pair": args.pair, "n": args.n, "prompts": str(args.prompts),
                                        "limits": results}, indent=2))
        print(json.dumps({"limit_mib": limit, **points(results[-1])}), file=sys.stderr, flush=True)
    if args.png is not None:
        import psutil

        plot(results, args.png, psutil.virtual_memory().total >> 20)


if __name__ == "__main__":
    main()
