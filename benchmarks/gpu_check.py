"""Everything a GPU machine can tell us, in one command and one JSON file: llama-cpp-python and llama.cpp's own
binaries built for the backend, then, with the target's layers partly and wholly on the GPU, `edge-spec check`
(bit-exact alone and inside trees?), a greedy tree-16 `bench` row against plain, and benchmarks/peer_llama_cpp.py's
rows (edge-spec plain and auto, llama.cpp `-ngl` plain and speculative) on the real pair.

    python benchmarks/gpu_check.py --backend cuda --sdist llama_cpp_python-0.3.36.tar.gz   # a CUDA machine
    python benchmarks/gpu_check.py --backend vulkan                                         # here: Mesa's lavapipe

It fetches nothing but what a build needs and the machine lacks (the sdist, Vulkan headers newer than Debian 12's):
the model files come from edge-spec's cache (EDGE_SPEC_CACHE), carried along; HF_HUB_OFFLINE is set. On a CUDA
machine with 16 cores the builds take minutes (one GPU architecture), the runs a few more. On a software Vulkan device
speed means nothing: the figures that count are bit_exact and matches_plain.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "benchmarks" / "build_llama_backend.sh"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def built(backend: str, sdist: Path | None, peer: bool) -> Path:
    """The folder build_llama_backend.sh prints last: the Python package's, or the peer binaries' with `peer`."""
    command = ["bash", str(BUILD), backend, *(["--sdist", str(sdist)] if sdist else []), *(["--peer"] if peer else [])]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True, env=os.environ | {
        "PYTHON": sys.executable})
    return Path(done.stdout.strip().splitlines()[-1])


def environment(package: Path, backend: str) -> dict[str, str]:
    """The environment each run gets: that build's llama_cpp first on the path, nothing fetched. Mesa's software
    device is a CPU-type Vulkan device, which llama.cpp skips unless named: GGML_VK_VISIBLE_DEVICES names it."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(package), str(REPO)]), "HF_HUB_OFFLINE": "1"}
    if backend == "vulkan" and "GGML_VK_VISIBLE_DEVICES" not in os.environ:
        env["GGML_VK_VISIBLE_DEVICES"] = "0"
    return env


def run_json(command: list[str], env: dict[str, str], timeout: float) -> dict:
    say("$ " + " ".join(command))
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env, timeout=timeout)
    seconds = round(time.perf_counter() - started, 1)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}", "seconds": seconds}
    return json.loads(done.stdout) | {"seconds": seconds}


def probe(env: dict[str, str]) -> dict:
    """What the built llama.cpp reports: its devices, and the target's layer count."""
    code = ("import json; from edge.runtimes.llama_cpp.devices import devices, backend_line; "
            "print(json.dumps({'backend': backend_line(), 'devices': [d.__dict__ for d in devices()]}))")
    return json.loads(subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                                     check=True).stdout)


def target_layers(pair: str, env: dict[str, str]) -> int:
    code = ("import sys; from edge.models.loading import resolve_spec; from edge.models.sources import model_path; "
            "from edge.options import LoadOptions; from edge.runtimes.gguf_file import gguf_shape; "
            f"spec = resolve_spec(LoadOptions(pair={pair!r}))[0]; path = model_path(spec.target); "
            "sys.exit(f'{path}: not in the cache; run edge-spec prepare first') if not path.is_file() else None; "
            "print(gguf_shape(path).n_layers)")
    return int(subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                              check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("cuda", "vulkan"), required=True)
    parser.add_argument("--sdist", type=Path, default=None, help="llama_cpp_python-VERSION.tar.gz, brought along")
    parser.add_argument("-m", "--pair", default="qwen2.5-coder-1.5b")
    parser.add_argument("--prompts", type=int, default=4, help="prompts of benchmarks/chat-prompts.txt")
    parser.add_argument("-n", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--splits", default="half,all", help="the target's layers on the GPU: half, all, or counts")
    parser.add_argument("--no-peer", action="store_true", help="leave out llama.cpp's own binaries")
    parser.add_argument("--lanes", action="store_true", help="check serve --parallel's lanes on a software device too")
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"))
    args = parser.parse_args()

    started = time.perf_counter()
    out: dict = {"backend": args.backend, "pair": args.pair, "n": args.n, "prompts": args.prompts, "runs": []}
    say(f"building llama-cpp-python with {args.backend}")
    package = built(args.backend, args.sdist, peer=False)
    out["build_s"] = round(time.perf_counter() - started, 1)
    peer_bin = None
    if not args.no_peer:
        say(f"building llama.cpp's llama-server and llama-speculative with {args.backend}")
        peer_bin = built(args.backend, args.sdist, peer=True)
        out["peer_build_s"] = round(time.perf_counter() - started - out["build_s"], 1)
    env = environment(package, args.backend)
    out |= probe(env)
    if any("llvmpipe" in device["description"] for device in out["devices"]):
        # Mesa 22.3's lavapipe (Debian 12) crashes in llama.cpp's fused shaders from 3-token batches (a segfault in
        # libvulkan_lvp.so); unfused, every batch runs
        env["GGML_VK_DISABLE_FUSION"] = "1"
        out["env"] = {"GGML_VK_DISABLE_FUSION": "1"}
    # a software device runs the three tree shapes in minutes, serve --parallel's lanes (a reference pass per path)
    # in far more: left out there unless asked for
    lanes = args.lanes or not any("llvmpipe" in device["description"] for device in out["devices"])
    out["lanes_checked"] = lanes
    say(f"llama.cpp runs layers on: {out['backend']}")
    layers = target_layers(args.pair, env)
    prompts = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-check-prompts-{os.getpid()}.txt"
    lines = (REPO / "benchmarks" / "chat-prompts.txt").read_text().splitlines()
    prompts.write_text("\n".join([line for line in lines if line.strip()][: args.prompts]) + "\n")
    edge = str(Path(sys.executable).parent / "edge-spec")
    for split in args.splits.split(","):
        gpu_layers = {"half": layers // 2, "all": layers + 1}.get(split) or int(split)
        say(f"--- {gpu_layers} of {layers + 1} target layers (the output head counts one) on the GPU")
        run: dict = {"gpu_layers": gpu_layers}
        run["check"] = run_json([edge, "check", args.pair, "--gpu-layers", str(gpu_layers), "--json",
                                 *([] if lanes else ["--no-lanes"])], env, 3600)
        run["bench"] = run_json([edge, "bench", "--pair", args.pair, "--methods", "plain,tree", "--budgets", "16",
                                 "--gpu-layers", str(gpu_layers), "-n", str(args.n), "--temperature", "0",
                                 "--lookup", "off", "--prompts", str(prompts), "--json"], env, 3600)
        peer = [sys.executable, str(REPO / "benchmarks" / "peer_llama_cpp.py"), "-m", args.pair, "--prompts",
                str(prompts), "-n", str(args.n), "--gpu-layers", str(gpu_layers), "--draft-max", "16", "--json"]
        run["peer"] = run_json(peer + (["--bin-dir", str(peer_bin)] if peer_bin else ["--edge-only"]), env, 3600)
        out["runs"].append(run)
        args.out.write_text(json.dumps(out, indent=2) + "\n")  # each split's figures kept as it ends
    out["summary"] = [summary(run) for run in out["runs"]]
    out["seconds"] = round(time.perf_counter() - started, 1)
    prompts.unlink(missing_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for line in out["summary"]:
        say(json.dumps(line))
    say(f"wrote {args.out} ({out['seconds']} s)")


def summary(run: dict) -> dict:
    """A split's figures that decide: bit-exact, rows equal to plain, and each row's speed."""
    check, bench, peer = run["check"], run["bench"], run["peer"]
    line = {"gpu_layers": run["gpu_layers"], "bit_exact": check.get("bit_exact"),
            "check_max_abs_diff": max((s["max_abs_diff"] for s in check.get("shapes", [])), default=None)}
    for row in bench.get("rows", []):
        label = "plain" if row["method"] == "plain" else f"tree {row['budget']}"
        line[f"bench {label}"] = {"tokens_per_s": row["tokens_per_s"], "tokens_per_pass": row["tokens_per_pass"],
                                  "matches_plain": row["matches_plain"]}
    for row in peer.get("rows", []):
        line[row["row"]] = {key: row.get(key) for key in ("decode_tokens_per_s", "tokens_per_pass", "matches_plain",
                                                           "acceptance", "error") if row.get(key) is not None}
    errors = {part: run[part]["error"] for part in ("check", "bench", "peer") if "error" in run[part]}
    return line | ({"errors": errors} if errors else {})


if __name__ == "__main__":
    main()
