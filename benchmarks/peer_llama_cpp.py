"""llama.cpp's own speculative decoding against edge-spec, in one run, on the same pair, prompts, token count and
sampling: llama.cpp's `llama-server` with the target alone (plain) and with `--model-draft` (its default draft
settings, then each `--draft-max`), beside edge-spec's plain decoding and `--budget auto`.

    python benchmarks/peer_llama_cpp.py -m qwen2.5-coder-1.5b -n 64 --json                    # in RAM
    python benchmarks/peer_llama_cpp.py -m qwen2.5-coder-1.5b -n 64 --cap-mb 1000 --json      # under a memory cap
    python benchmarks/peer_llama_cpp.py -m qwen2.5-coder-1.5b -n 64 --cap-mb 1000 --temperature 0.8 --edge-only --json
    ... --temperature 0.8 --accept auto,residual    # sampled: an auto row per acceptance rule (default: auto alone)

Greedy by default; --temperature T samples at T alone (no top-k, top-p or min-p) on both sides, prompt i with seed
1 + i (each side draws its own: only greedy rows are compared with edge-spec's plain tokens).

The peer is built once, with cmake, from the llama.cpp source that the installed llama-cpp-python vendors (its
sdist, fetched with pip into the cache: ~/.cache/edge-spec/peer/llama.cpp-VERSION/build/bin): llama-server,
llama-speculative and llama-cli. Both sides get the prompts as the same token ids (edge-spec's rendering of the chat
template), start each prompt from an empty cache, and stop at the target's end-of-generation tokens. With
--cap-mb, each side runs in its own memory cgroup of that size (benchmarks/memcap.py: cgroup v1, as root), so that a
target larger than the cap is read from the drive by the kernel on every pass, on both sides alike.

Per row: decode tokens/s (llama-server's own `predicted_per_second`; edge-spec's decode time, the prompt's pass
excluded), the drafts llama.cpp made and accepted, edge-spec's tokens per pass, mean budget and plain and residual
rounds, and whether the tokens are edge-spec's plain decoding's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGETS = ("llama-server", "llama-speculative", "llama-cli")
SEED = 1  # prompt i samples with seed SEED + i, on both sides


def peer_dir() -> Path:
    from importlib.metadata import version

    from edge.models.cache import cache_dir

    return cache_dir() / "peer" / f"llama.cpp-{version('llama-cpp-python')}"


def build(say=print) -> Path:
    """The peer's binaries folder, built first if it is not there (minutes: llama.cpp's server is large)."""
    from importlib.metadata import version

    root = peer_dir()
    bin_dir = root / "build" / "bin"
    if all((bin_dir / name).is_file() for name in TARGETS):
        return bin_dir
    release = version("llama-cpp-python")
    source = root / f"llama_cpp_python-{release}"
    if not (source / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        root.mkdir(parents=True, exist_ok=True)
        say(f"fetching llama-cpp-python {release}'s source (its vendored llama.cpp) with pip")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d",
                        str(root), "--", f"llama-cpp-python=={release}"], check=True, stdout=subprocess.DEVNULL)
        archive = next(root.glob(f"llama_cpp_python-{release}.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    llama = source / "vendor" / "llama.cpp"
    build_dir = root / "build"
    say(f"building {', '.join(TARGETS)} from {llama} (once)")
    subprocess.run(["cmake", "-S", str(llama), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF",
                    "-DGGML_NATIVE=ON"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(os.cpu_count() or 1),
                    "--target", *TARGETS], check=True, stdout=subprocess.DEVNULL)
    return bin_dir


def amx_crashes() -> bool:
    """Whether llama.cpp's repacked (AMX) weight buffers crash here: on CPUs with AMX, ggml_backend_amx_mul_mat
    segfaults on the first batch of more than one token (ggml-org/llama.cpp#20824; llama-server exits with -11 on
    the first prompt). The peer then runs with --no-repack, the fastest of its settings that runs, as edge-spec does
    (runtimes/llama_cpp/_native.py, USE_EXTRA_BUFFERS)."""
    from edge.runtimes.llama_cpp._native import USE_EXTRA_BUFFERS

    return not USE_EXTRA_BUFFERS


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PeerFailed(SystemExit):
    """llama-server did not come up (it stopped, or did not answer in 10 minutes): a row of its own says so."""


@contextlib.contextmanager
def llama_server(bin_dir: Path, args: list[str], cap_bytes: int | None, drop: list[Path],
                 slots: int = 1) -> Iterator[str]:
    """llama-server with `args` and `slots` parallel slots (-np) on a free loopback port (in a memory cgroup of
    cap_bytes, if given); its URL."""
    port = _free_port()
    command = [str(bin_dir / "llama-server"), *args, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
               "--no-webui"]
    with contextlib.ExitStack() as stack:
        if cap_bytes is not None:
            from memcap import drop_from_cache, memory_cgroup  # benchmarks/, the script's folder

            cgroup = stack.enter_context(memory_cgroup(cap_bytes))
            drop_from_cache(drop)
            command = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup.procs), *command]
        log = stack.enter_context(open(peer_dir() / "server.log", "a"))
        # llama.cpp as it runs by default: not on the kernel switches edge-spec's runtime sets in this process when
        # imported (runtimes/llama_cpp/kernels.py), which a child would inherit
        env = {key: value for key, value in os.environ.items() if not key.startswith("GGML_CPU_TILED_MM")}
        server = subprocess.Popen(command, stdout=log, stderr=log, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            while True:
                if server.poll() is not None:
                    raise PeerFailed(f"llama-server stopped (exit {server.returncode}); see {log.name}")
                with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
                if time.monotonic() > deadline:
                    raise PeerFailed(f"llama-server did not start in 10 minutes; see {log.name}")
                time.sleep(0.5)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def peer_rows(url: str, prompts: list[list[int]], n: int, stops: list[int], temperature: float = 0.0) -> list[dict]:
    rows = []
    for i, ids in enumerate(prompts):
        # greedy: the argmax; sampled: the temperature alone (no top-k, top-p or min-p), as on edge-spec's side
        sampling = {"temperature": 0.0, "top_k": 1} if temperature == 0 else {
            "temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": SEED + i}
        body = {"prompt": ids, "n_predict": n, "cache_prompt": False, "return_tokens": True, "seed": SEED + i,
                **sampling}
        request = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as response:
            data = json.load(response)
        timings = data.get("timings", {})
        tokens = list(data.get("tokens", []))
        cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
        rows.append({"tokens": tokens[:cut], "decode_s": timings.get("predicted_ms", 0) / 1000,
                     "predicted_n": timings.get("predicted_n", len(tokens)),
                     "draft_n": timings.get("draft_n", 0), "draft_accepted": timings.get("draft_n_accepted", 0)})
    return rows


def sampling(temperature: float, seed: int | None = None):
    """Greedy, or the temperature alone (no top-k, top-p, min-p or repetition penalty), as the peer is asked to."""
    from edge.sampling import SamplingConfig

    if temperature == 0:
        return SamplingConfig()
    return SamplingConfig(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=seed)


def edge_job(job: dict) -> dict:
    """edge-spec's side, in this process or a capped child: the prompts' token ids, then its rows. job["speculate"]
    "on": the pair as named, its plain decoding (the reference every greedy row is compared with); "auto": loaded as
    chat, generate and serve load it by default (the plan may drop the drafter: offload/choice.py), an auto row per
    acceptance rule. Each row counts the bytes read from the drive while decoding."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from edge.offload.ssd import read_bytes

    import edge

    plan: list[str] = []

    def report(message: str) -> None:
        print(message, file=sys.stderr)
        if message.startswith("plan:"):
            plan.append(message)

    out: dict = {"rows": {}}
    with edge.load(job["pair"], threads=job["threads"], speculate=job["speculate"], report=report,
                   gpu_layers=job.get("gpu_layers") or None) as pair:
        from edge.models.bench import read_prompts

        prompts = [pair.prompt_tokens(text) for text in read_prompts(Path(job["prompts"]))]
        out |= {"prompts": prompts, "target": str(pair.target.path), "placement": pair.placement,
                "drafter": None if pair.drafter is None else str(pair.drafter.path),
                "stops": sorted(pair.target.special.stop), "ctx": pair.target.n_ctx, "overlap": pair.overlaps,
                "plan": plan}
        if job["speculate"] == "on":
            runs = [("edge-spec plain", False, None)]
        else:
            runs = [("edge-spec auto" if rule == "auto" else f"edge-spec auto, accept {rule}", True, rule)
                    for rule in (job["accept"] if job["temperature"] else ["auto"])]
        decoders = {}
        for label, speculate, rule in runs:
            if rule is not None:
                pair.options = dataclasses.replace(pair.options, accept=rule)
            decoders[label] = pair.decoder(sampling(job["temperature"]), speculate=speculate,
                                           budget="auto" if speculate else None)
        out["rows"] = {label: [] for label in decoders}
        # Each prompt through every row in turn (as `edge-spec bench` does): a machine that slows down or speeds up
        # during the run then weighs on every row alike, not on whichever row ran in that stretch.
        for i, ids in enumerate(prompts):
            for label, decoder in decoders.items():
                decoder.set_sampling(sampling(job["temperature"], SEED + i))
                decoder.reset()
                before = read_bytes()
                steps = list(decoder.reply(ids, job["n"]))
                after = read_bytes()
                stats = steps[-1].stats
                out["rows"][label].append({
                    "tokens": [s.token for s in steps[:-1] if s.token is not None], "decode_s": stats.decode_s,
                    "passes": stats.target_passes, "prefill_passes": stats.prefill_passes, "hidden_s": stats.hidden_s,
                    "pregrown_rounds": stats.pregrown_rounds, "rounds": stats.rounds, "draft_s": stats.draft_s,
                    "verify_s": stats.verify_s, "plain_rounds": stats.plain_rounds,
                    "residual_rounds": stats.residual_rounds, "budget_sum": stats.budget_sum,
                    "bytes_read": None if before is None or after is None else after - before})
    return out


def drafter_file(pair: str) -> str | None:
    """The drafter file the pair names, where it is here (None otherwise)."""
    files = pair_files(pair)
    return str(files["drafter"]) if "drafter" in files else None


def pair_files(pair: str) -> dict[str, Path]:
    """The target and drafter files the pair names, those that are here."""
    from edge.models.loading import resolve_spec
    from edge.models.sources import model_path

    from edge.options import LoadOptions

    spec = resolve_spec(LoadOptions(pair=pair))[0]
    paths = {"target": model_path(spec.target), "drafter": None if spec.drafter is None else model_path(spec.drafter)}
    return {role: path for role, path in paths.items() if path is not None and path.is_file()}


def summary(label: str, rows: list[dict], reference: list[list[int]] | None) -> dict:
    """A row's figures; `reference`: edge-spec's plain tokens, None when sampling (each side's own draws)."""
    tokens = sum(len(r["tokens"]) for r in rows)
    decode = sum(r["decode_s"] for r in rows)
    row = {"row": label, "new_tokens": tokens, "decode_tokens_per_s": round(tokens / decode, 3) if decode else None,
           "matches_plain": None if reference is None else [r["tokens"] for r in rows] == reference}
    if "passes" in rows[0]:
        rounds = max(sum(r["rounds"] for r in rows), 1)
        row |= {"tokens_per_pass": round(tokens / sum(r["passes"] for r in rows), 3),
                "draft_s_per_round": round(sum(r["draft_s"] for r in rows) / rounds, 4),
                "verify_s_per_round": round(sum(r["verify_s"] for r in rows) / rounds, 4),
                "hidden_s_per_round": round(sum(r["hidden_s"] for r in rows) / rounds, 4),
                "pregrown_rounds": sum(r["pregrown_rounds"] for r in rows), "rounds": rounds,
                "plain_rounds": sum(r["plain_rounds"] for r in rows),
                "residual_rounds": sum(r["residual_rounds"] for r in rows),
                "mean_budget": round(sum(r["budget_sum"] for r in rows) / rounds, 2)}
    if rows[0].get("bytes_read") is not None:
        passes = sum(r["passes"] + r["prefill_passes"] for r in rows)  # every pass, the prompts' too
        row["bytes_read_per_pass"] = round(sum(r["bytes_read"] for r in rows) / max(passes, 1))
    if "draft_n" in rows[0]:
        drafted, accepted = sum(r["draft_n"] for r in rows), sum(r["draft_accepted"] for r in rows)
        row |= {"drafted": drafted, "accepted": accepted,
                "acceptance": round(accepted / drafted, 3) if drafted else None}
    return row


def again(args, bin_dir: Path, common: list[str], cap: int | None, files: list[Path], job: dict, ours: dict,
          edge_rows: list[dict], peer_rows_of: dict[str, list[dict]], results: list[dict], reference, say) -> None:
    """--alternate: llama.cpp plain, then edge-spec auto, a second time (the first runs were auto, then plain), each
    of the two rows then being both runs together (tokens/s over both; each run's own in runs_tokens_per_s). A drift
    linear in time weighs on both rows alike: each row's two runs sit as far from the middle of the whole."""
    say("llama.cpp plain, again")
    with llama_server(bin_dir, common, cap, files) as url:
        peer_again = peer_rows(url, ours["prompts"], args.n, ours["stops"], args.temperature)
    say("edge-spec auto, again")
    from memcap import call_capped

    done = call_capped(edge_job, {**job, "speculate": "auto", "accept": ["auto"]}, limit_bytes=cap,
                       drop_cache=list(pair_files(args.pair).values()))
    edge_again = done.value["rows"]["edge-spec auto"]
    both = {"edge-spec auto": (edge_rows, edge_again), "llama.cpp plain": (peer_rows_of["llama.cpp plain"], peer_again)}
    for row in results:
        if row["row"] in both:
            first, second = both[row["row"]]
            row |= summary(row["row"], first + second, None if reference is None else reference * 2)
            row["runs_tokens_per_s"] = [summary(row["row"], rows, None)["decode_tokens_per_s"]
                                        for rows in (first, second)]
    ours["rows"]["edge-spec auto"] = edge_rows + edge_again
    peer_rows_of["llama.cpp plain"] = peer_rows_of["llama.cpp plain"] + peer_again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--pair", default="qwen2.5-coder-1.5b")
    parser.add_argument("--prompts", type=Path, default=REPO / "benchmarks" / "chat-prompts.txt")
    parser.add_argument("-n", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--draft-max", default="4,8,16", help="llama.cpp's draft lengths to run besides its default")
    parser.add_argument("--cap-mb", type=int, default=None, help="run each side under a memory cap of this size")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled at this temperature")
    parser.add_argument("--accept", default="auto",
                        help="edge-spec's acceptance rules when sampling, an auto row each (match,residual,auto)")
    parser.add_argument("--gpu-layers", type=int, default=0,
                        help="the target's layers on the GPU, both sides (llama.cpp: -ngl; its drafter wholly there)")
    parser.add_argument("--bin-dir", type=Path, default=None,
                        help="the peer's binaries (default: built here for the CPU; a GPU build: "
                             "benchmarks/build_llama_backend.sh BACKEND --peer)")
    parser.add_argument("--edge-only", action="store_true", help="edge-spec's rows alone (no llama.cpp)")
    parser.add_argument("--auto-only", action="store_true", help="edge-spec's auto rows alone, not the pair as named "
                        "(whose plain decoding under a tight limit reads the whole file a token)")
    parser.add_argument("--build-only", action="store_true", help="build the peer's binaries and stop")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tokens", action="store_true", help="each row's token ids in the JSON")
    parser.add_argument("--alternate", action="store_true",
                        help="run llama.cpp plain and edge-spec auto a second time, in the other order (auto, plain, "
                             "..., plain, auto): each of the two rows is both runs together, so that a machine "
                             "drifting during the run weighs on both alike (where the two run the same kernels)")
    args = parser.parse_args()
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    if args.bin_dir is None and shutil.which("cmake") is None:
        raise SystemExit("cmake is needed to build llama.cpp's binaries (pip install cmake)")
    bin_dir = args.bin_dir or build(say)
    if args.build_only:
        print(bin_dir)
        return
    from edge.offload.probe import probe_machine
    from edge.runtimes import default_threads

    threads = args.threads or default_threads()
    cap = None if args.cap_mb is None else args.cap_mb << 20
    job = {"pair": args.pair, "prompts": str(args.prompts), "n": args.n, "threads": threads,
           "gpu_layers": args.gpu_layers, "temperature": args.temperature,
           "accept": [r for r in args.accept.split(",") if r]}
    sys.path.insert(0, str(REPO / "benchmarks"))
    from memcap import call_capped

    runs, failed = {}, {}
    # the pair as named (its plain decoding, the reference), then as a person gets it by default
    for speculate in ("auto",) if args.auto_only else ("on", "auto"):
        say(f"edge-spec, speculate {speculate}{'' if cap is None else f', under a {args.cap_mb} MB cap'}")
        try:
            # the pair's files leave the page cache first, as before each of llama.cpp's runs: a page stays charged to
            # the cgroup that read it, so a file an earlier run left cached would be free memory to this one
            done = call_capped(edge_job, {**job, "speculate": speculate}, limit_bytes=cap,
                               drop_cache=list(pair_files(args.pair).values()))
        except (RuntimeError, MemoryError) as problem:  # the pair as named may not fit where auto's choice does
            failed[speculate] = str(problem).strip().splitlines()[-1]
            say(f"  it cannot run: {failed[speculate]}")
            continue
        runs[speculate] = done.value | {"peak_mib": done.peak_bytes >> 20, "peak_anon_mib": done.peak_anon_bytes >> 20}
    if not runs:
        raise SystemExit(f"edge-spec ran under neither setting: {failed}")
    ours = runs.get("on") or runs["auto"]
    rows = {**runs.get("on", {}).get("rows", {}), **runs.get("auto", {}).get("rows", {})}
    reference = [r["tokens"] for r in rows["edge-spec plain"]] if args.temperature == 0 and "on" in runs else None
    results = []
    for label, row_list in rows.items():
        run = runs["on" if label == "edge-spec plain" else "auto"]
        extra = {"peak_mib": run["peak_mib"], "peak_anon_mib": run["peak_anon_mib"]}
        results.append(summary(label, row_list, reference) | extra | ({} if label == "edge-spec plain"
                                                                       else {"plan": run["plan"]}))
    results = ([{"row": "edge-spec plain", "error": failed["on"]}] if "on" in failed else []) + results
    if "auto" in failed:
        results.append({"row": "edge-spec auto", "error": failed["auto"]})
    ours["rows"] = rows
    files = [Path(ours["target"])] + ([Path(ours["drafter"])] if ours["drafter"] else [])
    common = ["-m", ours["target"], "-c", str(ours["ctx"]), "-t", str(threads), "-tb", str(threads)]
    if args.gpu_layers or args.bin_dir:  # a GPU build offloads "auto" layers by default: as many as asked here
        common += ["-ngl", str(args.gpu_layers)]
    if amx_crashes():
        common.append("--no-repack")  # its AMX buffers crash on a prompt's batch on this CPU (see amx_crashes)
    configs = [] if args.edge_only else [("llama.cpp plain", [])]
    if ours["drafter"] is None:  # the pair as named did not run here (auto loaded the target alone): its drafter file
        ours["drafter"] = drafter_file(args.pair)
        files += [] if ours["drafter"] is None else [Path(ours["drafter"])]
    if configs and ours["drafter"] and ours["drafter"].endswith(".gguf"):
        # --spec-type draft-simple: llama.cpp infers the kind of drafting from the draft file's metadata, and a plain
        # model file names none (it would load the drafter and never draft)
        draft = ["-md", ours["drafter"], "--spec-type", "draft-simple", *(["-ngld", "all"] if args.gpu_layers else [])]
        configs.append(("llama.cpp speculative (defaults)", draft))
        configs += [(f"llama.cpp speculative draft-max {n}", [*draft, "--spec-draft-n-max", n])
                    for n in args.draft_max.split(",") if n]
    peer_rows_of: dict[str, list[dict]] = {}
    for label, extra in configs:
        say(label)
        try:
            with llama_server(bin_dir, common + extra, cap, files) as url:
                rows = peer_rows(url, ours["prompts"], args.n, ours["stops"], args.temperature)
        except PeerFailed as problem:  # (under a tight limit its drafter may not even load): the other rows stand
            say(f"  it cannot run: {problem}")
            results.append({"row": label, "error": str(problem)})
            continue
        except (ConnectionError, http.client.HTTPException) as problem:  # killed mid-reply (the limit's OOM kill)
            say(f"  it died mid-run: {problem!r}")
            results.append({"row": label, "error": f"llama-server died mid-run ({problem!r}); see "
                                                    f"{peer_dir() / 'server.log'}"})
            continue
        peer_rows_of[label] = rows
        results.append(summary(label, rows, reference))
    if args.alternate and "llama.cpp plain" in peer_rows_of and "auto" in runs:
        again(args, bin_dir, common, cap, files, job, ours, runs["auto"]["rows"]["edge-spec auto"], peer_rows_of,
              results, reference, say)
    peer_tokens = {label: [r["tokens"] for r in rows] for label, rows in peer_rows_of.items()}
    if "llama.cpp plain" in peer_tokens and args.temperature == 0:
        for row in results:
            if row["row"].startswith("edge-spec") and row["row"] in ours["rows"]:
                # a prompt matches when every run of this row and of llama.cpp plain (two each with --alternate)
                # gave the same tokens for it
                n_prompts = len(ours["prompts"])
                mine, theirs = [r["tokens"] for r in ours["rows"][row["row"]]], peer_tokens["llama.cpp plain"]
                same = [all(tokens == mine[i] for tokens in mine[i::n_prompts] + theirs[i::n_prompts])
                        for i in range(n_prompts)]
                row["matches_llama_plain"] = all(same)
                row["prompts_matching_llama_plain"] = sum(same)
    if args.tokens:  # every row's token ids, prompt by prompt (to compare texts across runs)
        for row in results:
            row["tokens"] = peer_tokens.get(row["row"]) or [r["tokens"] for r in ours["rows"].get(row["row"], [])]
    base = results[0].get("decode_tokens_per_s") if results[0]["row"] == "edge-spec plain" else None
    peer_plain = next((row for row in results if row["row"] == "llama.cpp plain"), None)
    for row in results:
        row["vs_edge_plain"] = round(row["decode_tokens_per_s"] / base, 3) if row.get("decode_tokens_per_s") and base \
            else None
        if peer_plain is not None and row.get("decode_tokens_per_s") and peer_plain.get("decode_tokens_per_s"):
            row["vs_llama_plain"] = round(row["decode_tokens_per_s"] / peer_plain["decode_tokens_per_s"], 3)
    out = {"pair": args.pair, "prompts": str(args.prompts), "n": args.n, "threads": threads, "cap_mb": args.cap_mb,
           "gpu_layers": args.gpu_layers,
           "temperature": args.temperature, "overlap": ours["overlap"],
           "placement": ours["placement"], "machine": probe_machine()["cpu"], "peer": str(bin_dir),
           "peer_no_repack": amx_crashes(), "rows": results}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for row in results:
        if "error" in row:
            print(f"{row['row']:40s} cannot run: {row['error']}")
            continue
        print(f"{row['row']:40s} {row['decode_tokens_per_s']} tok/s ({row['vs_edge_plain']}x) · same as edge-spec "
              f"plain: {row['matches_plain']}" + (f" · {row['tokens_per_pass']} tokens/pass" if "tokens_per_pass" in
                                                   row else "")
              + (f" · accepted {row['accepted']}/{row['drafted']}" if "drafted" in row else ""))


if __name__ == "__main__":
    main()
