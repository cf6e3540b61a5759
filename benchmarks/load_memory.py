"""What loading and decoding allocate past the plan: the anonymous memory of a fresh process at each step, for each
use of the memory (offload/choice.py), under a memory limit as a person runs it.

    python benchmarks/load_memory.py -m qwen2.5-coder-1.5b --cap-mb 1300 --uses plain,drafter

For each use: a process in its own memory cgroup (benchmarks/memcap.py) imports edge-spec, plans (the room the plan
sees), loads the pair as that use loads it, and generates --tokens greedy tokens; its anonymous memory (RssAnon) is
sampled every 10 ms. Printed, one JSON object: per step the anonymous MiB, the peak while decoding, and what the plan
set aside for the same things (the target's KV cache and the headroom), so that offload/plan.py's constants
(PLAIN_HEADROOM, CAPPED_HEADROOM) and offload/window.py's PASS_MARGIN can be checked against what a pass takes.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.memcap import call_capped  # noqa: E402

PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring and tests."


def _anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(pair: str, use: str, tokens: int) -> dict:
    steps: dict[str, int] = {"start": _anon()}
    from edge.models.loading import resolve_spec
    from edge.models.planning import make_choice
    from edge.offload.plan import _headroom

    import edge
    from edge.options import LoadOptions

    steps["imported"] = _anon()
    options = LoadOptions(pair=pair, speculate="auto")
    spec, models_file = resolve_spec(options)
    chosen, uses = make_choice(spec, None, models_file)
    planned = next((u for u in uses if u.name == use), None)
    steps["planned"] = _anon()
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anon())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # the use forced: "plain" and "lookup" as auto loads them when it chooses them, "drafter" as the pair is named
    load = LoadOptions(pair=pair, speculate="on") if use == "drafter" else LoadOptions(pair=pair, speculate="auto")
    with edge.load(load, report=lambda line: None) as loaded:
        steps["loaded"] = _anon()
        text = edge.generate(loaded, PROMPT, max_tokens=tokens).text
        steps["generated"] = _anon()
    done.set()
    sampler.join()
    mib = {name: round(value / 2**20, 1) for name, value in steps.items()}
    out = {"use": use, "chosen_here": chosen.name, "anon_mib": mib, "peak_anon_mib": round(peak[0] / 2**20, 1),
           "text_chars": len(text)}
    if planned is not None:
        plan = planned.plan
        target, drafter = plan.target, plan.drafter
        out["plan_mib"] = {
            "ram_free_seen": round(plan.machine.ram_free / 2**20, 1),
            "target_kv": round(target.kv_bytes / 2**20, 1),
            "target_resident": round(target.resident_bytes / 2**20, 1),
            "drafter_ram": round(drafter.ram_bytes / 2**20, 1),
            "headroom": round(_headroom(plan.machine, target.shape, None if drafter.placement == "none"
                                        else drafter.shape, plan.tree.n_tokens, spec.drafter.runtime,
                                        use == "plain") / 2**20, 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--pair", default="qwen2.5-coder-1.5b")
    parser.add_argument("--cap-mb", type=int, default=None, help="the memory limit (default: none; the cgroup counts)")
    parser.add_argument("--uses", default="plain,drafter")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    rows = []
    for use in args.uses.split(","):
        run = call_capped(measure, args.pair, use, args.tokens,
                          limit_bytes=None if args.cap_mb is None else args.cap_mb << 20)
        rows.append({**run.value, "cgroup_peak_anon_mib": run.peak_anon_bytes >> 20, "seconds": round(run.seconds, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"pair": args.pair, "cap_mib": args.cap_mb, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
