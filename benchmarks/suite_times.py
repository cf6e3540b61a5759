"""The test suite's time at two commits, test by test: which tests both runs have and what they took at each, which
tests only one has, by module. Reads two pytest JUnit reports of the same machine.

    CI=true pytest --junitxml=/tmp/old.xml        # at the older commit, in its own worktree
    CI=true pytest --junitxml=/tmp/new.xml        # at the newer one
    python benchmarks/suite_times.py /tmp/old.xml /tmp/new.xml [--json]

"Does the suite's time grow" is answered for the tests both commits have (the same checks, timed on the same
machine), apart from the tests added since, whose time is what the added capabilities cost.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path


def test_times(report: Path) -> dict[str, float]:
    """Seconds per test id (module::name[params]) of one JUnit report."""
    times: dict[str, float] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        times[f"{module}::{case.get('name')}"] = times.get(f"{module}::{case.get('name')}", 0.0) + float(
            case.get("time", 0.0))
    return times


def wall_time(report: Path) -> float | None:
    """The run's own seconds, start to end (the report's testsuite time): with workers (pytest-xdist), less than the
    sum of its tests' times, which each worker's tests add to."""
    root = ElementTree.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return None if suite is None or suite.get("time") is None else round(float(suite.get("time", 0.0)), 1)


def compare(old: dict[str, float], new: dict[str, float]) -> dict:
    both = sorted(set(old) & set(new))
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for test in both:
        module = test.split("::", 1)[0]
        modules[module][0] += old[test]
        modules[module][1] += new[test]
    added = sorted(set(new) - set(old), key=lambda t: -new[t])
    removed = sorted(set(old) - set(new), key=lambda t: -old[t])
    moved = sorted(both, key=lambda t: new[t] - old[t])
    return {
        "old_total_s": round(sum(old.values()), 1), "new_total_s": round(sum(new.values()), 1),
        "both": {"tests": len(both), "old_s": round(sum(old[t] for t in both), 1),
                 "new_s": round(sum(new[t] for t in both), 1)},
        "added": {"tests": len(added), "s": round(sum(new[t] for t in added), 1),
                  "slowest": [[t, round(new[t], 1)] for t in added[:15]]},
        "removed": {"tests": len(removed), "s": round(sum(old[t] for t in removed), 1)},
        "modules": {m: [round(a, 1), round(b, 1)] for m, (a, b) in sorted(modules.items(), key=lambda kv: kv[1][0] -
                                                                          kv[1][1])},
        "grew_most": [[t, round(old[t], 1), round(new[t], 1)] for t in moved[::-1][:10]],
        "shrank_most": [[t, round(old[t], 1), round(new[t], 1)] for t in moved[:10]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="the older commit's JUnit report")
    parser.add_argument("new", type=Path, help="the newer commit's JUnit report")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = compare(test_times(args.old), test_times(args.new))
    result["old_wall_s"], result["new_wall_s"] = wall_time(args.old), wall_time(args.new)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    both = result["both"]
    print(f"the run, start to end: {result['old_wall_s']} s -> {result['new_wall_s']} s")
    print(f"whole suite, its tests' times added up: {result['old_total_s']} s -> {result['new_total_s']} s")
    print(f"the {both['tests']} tests both runs have: {both['old_s']} s -> {both['new_s']} s")
    print(f"added since: {result['added']['tests']} tests, {result['added']['s']} s; "
          f"removed: {result['removed']['tests']} tests, {result['removed']['s']} s")
    print("by module (tests both have), old -> new:")
    for module, (a, b) in result["modules"].items():
        print(f"  {module:28s} {a:8.1f} {b:8.1f} {b - a:+8.1f}")
    print("grew most:")
    for test, a, b in result["grew_most"]:
        print(f"  {a:7.1f} {b:7.1f}  {test}")
    print("slowest added:")
    for test, t in result["added"]["slowest"]:
        print(f"  {t:7.1f}  {test}")


if __name__ == "__main__":
    main()
