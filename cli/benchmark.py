"""`edge-spec bench`: plain decoding and tree speculation over the same prompts, one run, one JSON."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from edge.errors import UserError
from edge.generate import Decoder, Stats
from edge.grow import GrowConfig
from edge.sampling import SamplingConfig


def benchmark_file(name: str) -> Path:
    """A file of benchmarks/: inside the package in an installed wheel, at the repo root otherwise."""
    package_dir = Path(__file__).resolve().parent
    packaged = package_dir / "benchmarks" / name
    return packaged if packaged.exists() else package_dir.parent / "benchmarks" / name


DEFAULT_PROMPTS = benchmark_file("chat-prompts.txt")


def parse_budgets(text: str) -> list[int]:
    try:
        budgets = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--budgets takes comma-separated integers, like 1,16,64,255 (got {text!r})") from None
    if not budgets or any(not 1 <= b <= 255 for b in budgets):
        raise UserError(f"--budgets must be between 1 and 255 (got {text!r})")
    return budgets


def read_prompts(path: Path | None) -> list[str]:
    path = path or DEFAULT_PROMPTS
    try:
        prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as error:
        raise UserError(f"cannot read prompts file {path}: {error.strerror}") from None
    if not prompts:
        raise UserError(f"prompts file {path} has no prompts (one per line)")
    return prompts


def parse_drafters(text: str | None) -> list[tuple[str, int | None]] | None:
    """'llama_cpp,onnx,onnx:32768' -> [("llama_cpp", None), ("onnx", None), ("onnx", 32768)]."""
    if text is None:
        return None
    choices = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        runtime, _, vocab = part.partition(":")
        if runtime not in ("llama_cpp", "onnx") or (vocab and (runtime != "onnx" or not vocab.isdigit())):
            raise UserError(f"--drafters takes llama_cpp, onnx or onnx:K (a vocabulary size), comma-separated "
                            f"(got {part!r})")
        choices.append((runtime, int(vocab) if vocab else None))
    if not choices:
        raise UserError("--drafters is empty")
    return choices


def run_bench(loaded, prompts: list[str], budgets: list[int], max_tokens: int, sampling: SamplingConfig,
              raw: bool, report, drafters: list[tuple[str, int | None]] | None = None,
              threads: int | None = None) -> dict[str, Any]:
    from cli.main import prompt_for
    from offload.probe import probe_machine

    raw = raw or loaded.template is None
    prompt_tokens = [prompt_for(loaded, prompt, raw) for prompt in prompts]
    report(f"plain: {len(prompts)} prompts")
    reference, stats = _decode_all(loaded.target, None, None, prompt_tokens, max_tokens, sampling)
    rows = [_row("plain", None, stats, True)]
    pass_ms = target_pass_times(loaded, prompt_tokens[0], threads, report)
    drafter_info = []
    for drafter, label, vocab in _drafters(loaded, drafters, threads, report):
        drafter_info.append({"drafter": label, "vocab": vocab, "expand_ms": expand_ms(drafter, prompt_tokens[0]),
                             "kv_bytes_per_token": kv_bytes_per_token(drafter)})
        for budget in budgets:
            report(f"{label} budget {budget}: {len(prompts)} prompts")
            outputs, stats = _decode_all(loaded.target, drafter, GrowConfig.for_budget(budget), prompt_tokens,
                                         max_tokens, sampling)
            rows.append({"drafter": label, "vocab": vocab, **_row("tree", budget, stats, outputs == reference)})
        if drafter is not loaded.drafter:
            _close(drafter)
    return {"pair": loaded.name, "machine": probe_machine(), "prompts": len(prompts), "max_tokens": max_tokens,
            "temperature": sampling.temperature, "lossless_warning": loaded.lossless_warning,
            "target_pass_ms": pass_ms, "drafters": drafter_info, "rows": rows}


def _decode_all(target, drafter, grow, prompt_tokens, max_tokens, sampling) -> tuple[list[list[int]], Stats]:
    decoder = Decoder(target, drafter, grow, sampling)
    total, outputs = Stats(), []
    for tokens in prompt_tokens:
        decoder.set_sampling(sampling)  # the same seed for every method: sampled runs are comparable
        decoder.load(tokens)
        steps = list(decoder.generate(max_tokens))
        outputs.append([s.token for s in steps if s.token is not None and s.finish_reason is None])
        total.add(steps[-1].stats)
    decoder.reset()
    return outputs, total


def _drafters(loaded, choices, threads, report):
    """(drafter, label, vocab size) for each choice; the pair's own drafter when none are given."""
    if choices is None:
        yield loaded.drafter, _label(loaded.drafter), getattr(loaded.drafter, "vocab", loaded.target.n_vocab)
        return
    from dataclasses import replace

    from cli.loading import open_drafter

    if loaded.spec is None or loaded.spec.target.runtime == "onnx":
        raise UserError("--drafters needs a pair with a llama.cpp target (QuantSpec pairs have one drafter)")
    if loaded.drafter is not None:
        _close(loaded.drafter)  # one drafter at a time: idle llama.cpp thread pools slow the others down
        loaded.drafter = None
    for runtime, vocab in choices:
        model = replace(loaded.spec.drafter, runtime=runtime, vocab=vocab)
        drafter = open_drafter(loaded.spec, model, loaded.target, threads, 0, report)
        label = runtime if vocab is None else f"{runtime}:{vocab}"
        yield drafter, label, vocab or loaded.target.n_vocab


def _label(drafter) -> str:
    vocab = getattr(drafter, "vocab", None)
    if not hasattr(drafter, "kv"):
        return "llama_cpp"
    return "onnx" if vocab in (None, getattr(drafter.arch, "n_vocab", None)) else f"onnx:{vocab}"


def _close(drafter) -> None:
    close = getattr(drafter, "close", None)
    if close is not None:
        close()


def expand_ms(drafter, prefix: list[int], sizes: tuple[int, ...] = (1, 8, 32), repeats: int = 5) -> dict[str, float]:
    """Median milliseconds of one drafter pass over n sibling nodes, after a root pass on `prefix`."""
    from edge.tree import TokenTree

    drafter.truncate(0)
    drafter.prefill(prefix[:-1])
    result = {}
    for n in sizes:
        tree = TokenTree(np.array([prefix[-1], *range(100, 100 + n)], np.int32),
                         np.array([-1, *[0] * n], np.int32), np.array([0, *[1] * n], np.int32),
                         np.zeros(n + 1, np.float32))
        times = []
        for _ in range(repeats):
            drafter.expand(tree, np.array([0]), 8)
            start = time.perf_counter()
            drafter.expand(tree, np.arange(1, n + 1), 8)
            times.append(time.perf_counter() - start)
            drafter.commit(tree, [0])
            drafter.truncate(len(prefix) - 1)
        result[str(n)] = round(1000 * float(np.median(times)), 3)
    drafter.truncate(0)
    return result


def target_pass_times(loaded, prefix: list[int], threads: int | None, report) -> dict[str, dict[str, float]]:
    """Pass times of the pair's target; a QuantSpec (onnx) target is timed beside llama.cpp on the same file."""
    times = {_runtime(loaded.target): pass_ms(loaded.target, prefix)}
    if loaded.spec is not None and loaded.spec.target.runtime == "onnx":
        from cli.loading import materialize
        from runtimes.llama_cpp import RunOptions, load_target

        report("llama.cpp target on the same file, for its pass times")
        options = RunOptions(n_ctx=loaded.spec.ctx, kv_type=loaded.spec.target.kv_type, n_threads=threads)
        other = load_target(materialize(loaded.spec.target, report), options)
        try:
            times["llama_cpp"] = pass_ms(other, prefix)
        finally:
            other.close()
    return times


def _runtime(target) -> str:
    return "onnx" if hasattr(target, "kv") else "llama_cpp"


def pass_ms(target, prefix: list[int], sizes: tuple[int, ...] = (1, 16, 64), repeats: int = 5) -> dict[str, float]:
    """Median milliseconds of one target pass over a chain of n new tokens after `prefix`."""
    from edge.tree import TokenTree

    target.truncate(0)
    target.prefill(prefix[:-1])
    result = {}
    for n in sizes:
        chain = TokenTree(np.array([prefix[-1], *range(100, 99 + n)], np.int32), np.arange(-1, n - 1, dtype=np.int32),
                          np.arange(n, dtype=np.int32), np.zeros(n, np.float32))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            target.verify(chain)
            times.append(time.perf_counter() - start)
            target.truncate(len(prefix) - 1)
        result[str(n)] = round(1000 * float(np.median(times)), 3)
    target.truncate(0)
    return result


def kv_bytes_per_token(drafter) -> float:
    """Bytes one committed token takes in the drafter's KV cache (keys + values, all layers)."""
    kv = getattr(drafter, "kv", None)
    if kv is not None:  # QuantSpec codes plus one float16 scale and min per group
        elements = kv.n_layers * kv.n_kv_heads * kv.head_dim
        bits = elements * (2 * kv.bits + 32 / kv.group + 32 / kv.value_group)
        return round(bits / 8, 1)
    from runtimes.onnx.arch import GGUFWeights

    arch = GGUFWeights(drafter.model.path).arch
    bits = {"q4_0": 4.5, "q8_0": 8.5, "f16": 16, "bf16": 16, "f32": 32}[drafter.kv_type]
    return round(arch.n_layers * arch.n_kv_heads * arch.head_dim * 2 * bits / 8, 1)


def _row(method: str, budget: int | None, stats: Stats, matches_plain: bool) -> dict[str, Any]:
    rounds = max(stats.rounds, 1)
    return {
        "method": method,
        "budget": budget or 0,
        "tokens_per_pass": round(stats.tokens_per_pass, 3),
        "grow_s_per_round": round(stats.grow_s / rounds, 5),
        "draft_s_per_round": round(stats.draft_s / rounds, 5),
        "verify_s_per_round": round(stats.verify_s / rounds, 5),
        "tokens_per_s": round(stats.tokens_per_s, 2),
        "target_passes": stats.target_passes,
        "rounds": stats.rounds,
        "new_tokens": stats.new_tokens,
        "drafter_passes_per_round": round(stats.drafter_passes / rounds, 3),
        "tree_nodes_per_round": round(stats.tree_nodes / rounds, 1),
        "matches_plain": matches_plain,
    }


def render_table(result: dict[str, Any], console: Console) -> None:
    table = Table("method", "drafter", "budget", "tokens/pass", "draft s/round", "verify s/round", "tokens/s", "passes",
                  "same as plain", title=f"{result['pair']} on {result['machine']['cpu']} "
                  f"({result['prompts']} prompts x {result['max_tokens']} tokens, T={result['temperature']})")
    for row in result["rows"]:
        table.add_row(row["method"], row.get("drafter", "-"), str(row["budget"] or "-"),
                      f"{row['tokens_per_pass']:.2f}",
                      f"{row['draft_s_per_round']:.4f}", f"{row['verify_s_per_round']:.4f}",
                      f"{row['tokens_per_s']:.1f}", str(row["target_passes"]),
                      "yes" if row["matches_plain"] else "NO")
    console.print(table)
    for runtime, times in result.get("target_pass_ms", {}).items():
        console.print(f"target pass, {runtime}: " + " · ".join(f"{n} tokens {ms:.1f} ms" for n, ms in times.items()))
    for info in result.get("drafters", []):
        expand = " · ".join(f"{n} nodes {ms:.1f} ms" for n, ms in info["expand_ms"].items())
        console.print(f"drafter {info['drafter']}: expand {expand} · KV {info['kv_bytes_per_token']:.0f} B/token")
