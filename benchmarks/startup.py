"""Start-up: how long `edge-spec generate hi -n 1` takes to its first token, by phase, against llama-cpp-python
loading the same target file and decoding one token of a reply to the same prompt (in the model's chat template, as
`generate` sends it; also without it, which prefills less). Every run is a fresh process, as a user starts one.

    python benchmarks/startup.py --repeat 3        # the default pair
    python benchmarks/startup.py --pair smollm2-135m --repeat 3
    python benchmarks/startup.py --pair gemma3-270m --repeat 3 --json

A first, untimed run prepares the pair (downloads, the drafter's graph, --budget auto's pass times) so that the
timed runs see a warm cache, as every run after a user's first does. Start to first token is the time from
starting the process to the first byte of the reply on its stdout; the ratio is edge-spec's best over
llama-cpp-python's best. The phases come from one more fresh process that loads the pair through the library
(`edge.load`, then `edge.stream_generate`) and reports Pair.load_seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# llama-cpp-python as a user calls it: its Llama class with its defaults, one token of a reply to "hi", in the model's
# chat template as `edge-spec generate` sends it (create_chat_completion renders the GGUF's template; a base model's
# prompt is sent raw on both sides). The weight buffers are edge-spec's (runtimes/llama_cpp/_native.py: no AMX
# buffers on CPUs where they crash), so both load the same way.
BASELINE = """
import sys
import llama_cpp.llama_cpp as native
from llama_cpp import Llama
from edge.runtimes.llama_cpp._native import USE_EXTRA_BUFFERS
defaults = native.llama_model_default_params
def model_params():
    params = defaults()
    params.use_extra_bufts = USE_EXTRA_BUFFERS
    return params
native.llama_model_default_params = model_params
llm = Llama(sys.argv[1], verbose=False)
if sys.argv[2] == "chat":
    chunks = llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=1, stream=True)
    texts = (chunk["choices"][0]["delta"].get("content") for chunk in chunks)
else:
    texts = (chunk["choices"][0]["text"] for chunk in llm("hi", max_tokens=1, stream=True))
for text in texts:
    if text is not None:  # the first chunk of a chat completion names the role alone
        sys.stdout.write(text or ".")
        sys.stdout.flush()
        break
"""


def first_byte_seconds(command: list[str]) -> tuple[float, float]:
    """(start to the first byte on stdout, start to exit) of a fresh process, in seconds."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert process.stdout is not None
    first = process.stdout.read(1)
    first_s = time.perf_counter() - start
    process.stdout.read()
    if process.wait() != 0 or not first:
        raise SystemExit(f"{' '.join(command)} failed (exit {process.returncode})")
    return first_s, time.perf_counter() - start


def edge_spec_command(pair: str, base_model: bool) -> list[str]:
    exe = shutil.which("edge-spec")
    launcher = [exe] if exe else [sys.executable, "-c", "from edge.cli.main import main; main()"]
    return [*launcher, "generate", "hi", "-n", "1", "--pair", pair, *(["--raw"] if base_model else [])]


def phases(pair: str, spawned: float) -> dict[str, float]:
    """In a fresh process: seconds of each start-up phase, up to the first token."""
    started = time.time()
    from edge.models.pair import NESTED

    import edge

    imported = time.time()
    with edge.load(pair, speculate="auto") as loaded:  # as the command line loads it
        loaded_at = time.time()
        steps = edge.stream_generate(loaded, "hi", max_tokens=1)
        next(steps)
        first_at = time.time()
        prefill = list(steps)[-1].stats.prefill_s
        load = dict(loaded.load_seconds)
    auto = load.pop("pass times (--budget auto)", 0.0)
    top_level = sum(seconds for name, seconds in load.items() if not name.startswith(NESTED))
    return {"python start": started - spawned, "import edge": imported - started, **load,
            "other loading": loaded_at - imported - top_level, "pass times (--budget auto)": auto,
            "prefill and first token": first_at - loaded_at - auto, "of which prefill": prefill,
            "start to first token": first_at - spawned}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=None, help="a pair of models.toml (default: the default pair)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each (the best counts)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--phases-child", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pair is None:
        from edge.models.registry import load_registry

        args.pair = load_registry().default
    if args.phases_child is not None:
        print(json.dumps(phases(args.pair, args.phases_child)))
        return

    from edge.models.loading import base_model, resolve_spec
    from edge.models.sources import model_path

    from edge.options import LoadOptions

    options = LoadOptions(pair=args.pair)
    command = edge_spec_command(args.pair, base_model(options) is not None)
    print(f"preparing: {' '.join(command)}", file=sys.stderr)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)  # downloads, graphs, pass times: the warm cache
    target = model_path(resolve_spec(options)[0].target)
    chat = base_model(options) is None
    baseline = [sys.executable, "-c", BASELINE, str(target), "chat" if chat else "raw"]
    bare = [sys.executable, "-c", BASELINE, str(target), "raw"]  # "hi" alone: a prompt of one or two tokens
    edge_runs, llama_runs, bare_runs = [], [], []
    for _ in range(args.repeat):  # alternated, so a slow spell of a shared machine falls on both alike
        edge_runs.append(first_byte_seconds(command))
        llama_runs.append(first_byte_seconds(baseline))
        if chat:
            bare_runs.append(first_byte_seconds(bare))
    child = [sys.executable, __file__, "--pair", args.pair, "--phases-child", repr(time.time())]
    by_phase = json.loads(subprocess.run(child, check=True, capture_output=True, text=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"}).stdout)
    edge_best, llama_best = min(r[0] for r in edge_runs), min(r[0] for r in llama_runs)
    result = {
        "pair": args.pair, "target": Path(target).name, "repeat": args.repeat,
        "edge_spec_command": " ".join(command[-7:]),
        "edge_spec_first_token_s": [round(r[0], 3) for r in edge_runs],
        "llama_cpp_python_first_token_s": [round(r[0], 3) for r in llama_runs],
        "edge_spec_best_s": round(edge_best, 3), "llama_cpp_python_best_s": round(llama_best, 3),
        "ratio": round(edge_best / llama_best, 2),
        # llama-cpp-python on "hi" without the chat template: less prefill than edge-spec's templated prompt
        "llama_cpp_python_raw_prompt_best_s": round(min(r[0] for r in bare_runs), 3) if bare_runs else None,
        "ratio_to_raw_prompt": round(edge_best / min(r[0] for r in bare_runs), 2) if bare_runs else None,
        "phases_s": {name: round(seconds, 3) for name, seconds in by_phase.items()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.pair} ({result['target']}), start to first token, best of {args.repeat} fresh processes:")
    print(f"  edge-spec generate hi -n 1: {edge_best:.3f} s  (runs: {result['edge_spec_first_token_s']})")
    print(f"  llama-cpp-python, same file: {llama_best:.3f} s  (runs: {result['llama_cpp_python_first_token_s']})")
    print(f"  ratio: {result['ratio']:.2f}x")
    if bare_runs:
        bare_best = result["llama_cpp_python_raw_prompt_best_s"]
        print(f"  llama-cpp-python, \"hi\" without the chat template: {bare_best:.3f} s (edge-spec's "
              f"{result['ratio_to_raw_prompt']:.2f}x that)")
    print("where edge-spec's start-up goes (one more fresh process, through edge.load):")
    for name, seconds in result["phases_s"].items():
        print(f"  {name:<36s} {seconds:8.3f} s")


if __name__ == "__main__":
    main()
