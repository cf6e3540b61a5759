"""`edge-spec bench`: plain decoding and tree speculation over the same prompts, one run, one JSON."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from edge.errors import UserError
from edge.generate import Decoder, Stats
from edge.grow import GrowConfig
from edge.sampling import SamplingConfig
from offload.tuning import expand_ms, json_table, pass_ms


def benchmark_file(name: str) -> Path:
    """A file of benchmarks/: inside the package in an installed wheel, at the repo root otherwise."""
    package_dir = Path(__file__).resolve().parent
    packaged = package_dir / "benchmarks" / name
    return packaged if packaged.exists() else package_dir.parent / "benchmarks" / name


DEFAULT_PROMPTS = benchmark_file("chat-prompts.txt")


def parse_budgets(text: str) -> list[int | str]:
    """'auto,1,16,64' -> ["auto", 1, 16, 64]."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    try:
        budgets = [part if part == "auto" else int(part) for part in parts]
    except ValueError:
        raise UserError(f"--budgets takes comma-separated integers or auto, like auto,1,16,64,255 (got {text!r})"
                        ) from None
    if not budgets or any(b != "auto" and not 1 <= b <= 255 for b in budgets):
        raise UserError(f"--budgets must be auto or between 1 and 255 (got {text!r})")
    return budgets


METHODS = ("plain", "chain", "tree")


def parse_methods(text: str) -> list[str]:
    methods = [part.strip() for part in text.split(",") if part.strip()]
    if not methods or any(m not in METHODS for m in methods):
        raise UserError(f"--methods takes {', '.join(METHODS)}, comma-separated (got {text!r})")
    return methods


def read_prompts(path: Path | None) -> list[str]:
    path = path or DEFAULT_PROMPTS
    try:
        prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as error:
        raise UserError(f"cannot read prompts file {path}: {error.strerror}") from None
    if not prompts:
        raise UserError(f"prompts file {path} has no prompts (one per line)")
    return prompts


@dataclass(frozen=True)
class DrafterChoice:
    runtime: str  # "llama_cpp" or "onnx"
    vocab: int | None = None  # a trimmed head's size (onnx), None: the full head
    quantize: str | None = None  # prepare it from the target's source requantized (llama.cpp ftype), None: the pair's

    @property
    def label(self) -> str:
        return self.runtime + (f":{self.vocab}" if self.vocab else "") + (f"@{self.quantize}" if self.quantize else "")


def parse_drafters(text: str | None) -> list[DrafterChoice] | None:
    """'llama_cpp,onnx:32768,llama_cpp@q4_0' -> drafters to compare: a runtime, a trimmed head (onnx:K) and a
    requantization of the pair's drafter file (@QUANT)."""
    from edge.registry import FTYPES

    if text is None:
        return None
    choices = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        head, _, quantize = part.partition("@")
        runtime, _, vocab = head.partition(":")
        if (runtime not in ("llama_cpp", "onnx") or (vocab and (runtime != "onnx" or not vocab.isdigit()))
                or ("@" in part and quantize not in FTYPES)):
            raise UserError(f"--drafters takes llama_cpp, onnx or onnx:K (a vocabulary size), each optionally with "
                            f"@QUANT (the drafter requantized: {', '.join(FTYPES)}), comma-separated (got {part!r})")
        choices.append(DrafterChoice(runtime, int(vocab) if vocab else None, quantize or None))
    if not choices:
        raise UserError("--drafters is empty")
    return choices


def run_bench(loaded, prompts: list[str], budgets: list[int | str], max_tokens: int, sampling: SamplingConfig,
              raw: bool, report, drafters: list[DrafterChoice] | None = None,
              threads: int | None = None, methods: tuple[str, ...] = ("plain", "tree")) -> dict[str, Any]:
    """Plain decoding (the reference every row is checked against) and each method x budget, prompt by prompt: each
    prompt runs through every row in turn, so a slow spell of a shared machine falls on all rows alike."""
    from cli.main import prompt_for
    from offload.probe import probe_machine

    raw = raw or loaded.template is None
    prompt_tokens = [prompt_for(loaded, prompt, raw) for prompt in prompts]
    pass_ms = target_pass_times(loaded, prompt_tokens[0], threads, report)
    rows, drafter_info, reference, costs = [], [], None, None
    for drafter, label, vocab in _drafters(loaded, drafters, threads, report):
        expand = json_table(expand_ms(drafter, prompt_tokens[0]))
        drafter_info.append({"drafter": label, "vocab": vocab, "expand_ms": expand,
                             "kv_bytes_per_token": kv_bytes_per_token(drafter)})
        runs = [] if reference is not None else [("plain", None, Decoder(loaded.target, None, None, sampling))]
        costs = None
        for method in (m for m in methods if m != "plain"):
            for budget in budgets:
                if budget == "auto" and method == "chain":
                    continue  # auto chooses tree shapes
                policy = None
                if budget == "auto":
                    costs = costs or _costs(loaded, drafter, prompt_tokens[0])
                    from offload.tuning import AutoBudget

                    policy = AutoBudget(costs)
                    grow = None
                else:
                    grow = GrowConfig.chain(budget) if method == "chain" else GrowConfig.for_budget(budget)
                runs.append((method, budget, Decoder(loaded.target, drafter, grow, sampling, policy=policy)))
        report(f"{label}: {', '.join(f'{m} {b}' if b is not None else m for m, b, _ in runs)}; "
               f"{len(prompts)} prompts, each through every row in turn")
        results = _decode_interleaved([decoder for _, _, decoder in runs], prompt_tokens, max_tokens, sampling)
        for (method, budget, _), (outputs, stats, read) in zip(runs, results, strict=True):
            if method == "plain":
                reference = outputs
                rows.insert(0, _row("plain", None, stats, True, read))
            else:
                row = _row(method, budget, stats, outputs == reference, read)
                rows.append({"drafter": label, "vocab": vocab, **row})
        if drafter is not loaded.drafter:
            _close(drafter)
    plain = rows[0]
    for row in rows:
        row["speedup"] = round(row["tokens_per_s"] / plain["tokens_per_s"], 3) if plain["tokens_per_s"] else 0
    return {"pair": loaded.name, "machine": probe_machine(), "placement": loaded.placement,
            "target": _target_file(loaded), "prompts": len(prompts), "max_tokens": max_tokens,
            "temperature": sampling.temperature, "lossless_warning": loaded.lossless_warning,
            "target_pass_ms": pass_ms, "auto_costs": None if costs is None else costs.to_json(),
            "drafters": drafter_info, "rows": rows}


def _costs(loaded, drafter, prefix: list[int]):
    from offload.tuning import measure_costs

    return measure_costs(loaded.target, drafter, prefix, loaded.target.max_tree)


def _target_file(loaded) -> str | None:
    from cli.loading import model_path

    path = model_path(loaded.spec.target) if loaded.spec is not None else None
    return path.name if path is not None else None


def _decode_interleaved(decoders: list[Decoder], prompt_tokens, max_tokens, sampling
                        ) -> list[tuple[list[list[int]], Stats, int | None]]:
    """Every prompt through every decoder in turn; per decoder its outputs, its stats and the bytes the process
    read from storage while it ran (prefill included)."""
    from offload.ssd import read_bytes

    outputs: list[list[list[int]]] = [[] for _ in decoders]
    totals = [Stats() for _ in decoders]
    reads: list[int | None] = [0 for _ in decoders]
    for tokens in prompt_tokens:
        for i, decoder in enumerate(decoders):
            decoder.set_sampling(sampling)  # the same seed for every method: sampled runs are comparable
            before = read_bytes()
            decoder.load(tokens)
            steps = list(decoder.generate(max_tokens))
            after = read_bytes()
            decoder.reset()  # the next row starts from an empty cache (they share the target and drafter)
            outputs[i].append([s.token for s in steps if s.token is not None and s.finish_reason is None])
            totals[i].add(steps[-1].stats)
            reads[i] = None if reads[i] is None or before is None or after is None else reads[i] + after - before
    return list(zip(outputs, totals, reads, strict=True))


def _drafters(loaded, choices, threads, report):
    """(drafter, label, vocab size) for each choice; the pair's own drafter when none are given."""
    if choices is None:
        yield loaded.drafter, _label(loaded.drafter), getattr(loaded.drafter, "vocab", loaded.target.n_vocab)
        return
    from dataclasses import replace

    from cli.loading import head_ids, open_drafter

    if loaded.spec is None or loaded.spec.target.runtime == "onnx":
        raise UserError("--drafters needs a pair with a llama.cpp target (QuantSpec pairs have one drafter)")
    if loaded.drafter is not None:
        _close(loaded.drafter)  # one drafter at a time: idle llama.cpp thread pools slow the others down
        loaded.drafter = None
    models = [replace(loaded.spec.drafter, runtime=choice.runtime, vocab=choice.vocab,
                      quantize=choice.quantize or loaded.spec.drafter.quantize) for choice in choices]
    for model in models:  # a missing vocabulary fails now, not after the drafters before it have run
        head_ids(loaded.spec, model)
    for choice, model in zip(choices, models, strict=True):
        drafter = open_drafter(loaded.spec, model, loaded.target, loaded.drafter_threads, 0, report)
        yield drafter, choice.label, choice.vocab or loaded.target.n_vocab


def _label(drafter) -> str:
    vocab = getattr(drafter, "vocab", None)
    if not hasattr(drafter, "kv"):
        return "llama_cpp"
    return "onnx" if vocab in (None, getattr(drafter.arch, "n_vocab", None)) else f"onnx:{vocab}"


def _close(drafter) -> None:
    close = getattr(drafter, "close", None)
    if close is not None:
        close()


def target_pass_times(loaded, prefix: list[int], threads: int | None, report) -> dict[str, dict[str, float]]:
    """Pass times of the pair's target; a QuantSpec (onnx) target is timed beside llama.cpp on the same file."""
    times = {_runtime(loaded.target): json_table(pass_ms(loaded.target, prefix))}
    if loaded.spec is not None and loaded.spec.target.runtime == "onnx":
        from cli.loading import materialize
        from runtimes.llama_cpp import RunOptions, load_target

        report("llama.cpp target on the same file, for its pass times")
        options = RunOptions(n_ctx=loaded.spec.ctx, kv_type=loaded.spec.target.kv_type, n_threads=threads)
        other = load_target(materialize(loaded.spec.target, report), options)
        try:
            times["llama_cpp"] = json_table(pass_ms(other, prefix))
        finally:
            other.close()
    return times


def _runtime(target) -> str:
    return "onnx" if hasattr(target, "kv") else "llama_cpp"


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


def _row(method: str, budget: int | str | None, stats: Stats, matches_plain: bool, read: int | None) -> dict[str, Any]:
    rounds = max(stats.rounds, 1)
    passes = max(stats.target_passes, 1)
    return {
        "method": method,
        "budget": budget or 0,
        "tokens_per_pass": round(stats.tokens_per_pass, 3),
        "grow_s_per_round": round(stats.grow_s / rounds, 5),
        "draft_s_per_round": round(stats.draft_s / rounds, 5),
        "verify_s_per_round": round(stats.verify_s / rounds, 5),
        "tokens_per_s": round(stats.tokens_per_s, 2),
        "bytes_read_per_pass": None if read is None else round(read / passes),
        "target_passes": stats.target_passes,
        "rounds": stats.rounds,
        "new_tokens": stats.new_tokens,
        "drafter_passes_per_round": round(stats.drafter_passes / rounds, 3),
        "tree_nodes_per_round": round(stats.tree_nodes / rounds, 1),
        "mean_budget": round(stats.budget_sum / rounds, 1),
        "plain_rounds": stats.plain_rounds if budget == "auto" else 0,
        "matches_plain": matches_plain,
    }


def render_table(result: dict[str, Any], console: Console) -> None:
    table = Table("method", "drafter", "budget", "tokens/pass", "draft s/round", "verify s/round", "tokens/s",
                  "speedup", "MB read/pass", "passes", "same as plain",
                  title=f"{result['pair']} ({result.get('target')}, placement {result.get('placement')}) on "
                  f"{result['machine']['cpu']} ({result['prompts']} prompts x {result['max_tokens']} tokens, "
                  f"T={result['temperature']})")
    for row in result["rows"]:
        budget = str(row["budget"] or "-")
        if row["budget"] == "auto":
            budget += f" (mean {row['mean_budget']:g}, {row['plain_rounds']} plain rounds)"
        read = row.get("bytes_read_per_pass")
        table.add_row(row["method"], row.get("drafter", "-"), budget, f"{row['tokens_per_pass']:.2f}",
                      f"{row['draft_s_per_round']:.4f}", f"{row['verify_s_per_round']:.4f}",
                      f"{row['tokens_per_s']:.1f}", f"{row.get('speedup', 1.0):.2f}x",
                      "-" if read is None else f"{read / 1e6:.1f}", str(row["target_passes"]),
                      "yes" if row["matches_plain"] else "NO")
    console.print(table)
    for runtime, times in result.get("target_pass_ms", {}).items():
        console.print(f"target pass, {runtime}: " + " · ".join(f"{n} tokens {ms:.1f} ms" for n, ms in times.items()))
    for info in result.get("drafters", []):
        expand = " · ".join(f"{n} nodes {ms:.1f} ms" for n, ms in info["expand_ms"].items())
        console.print(f"drafter {info['drafter']}: expand {expand} · KV {info['kv_bytes_per_token']:.0f} B/token")


def plot(result: dict[str, Any], path: Path) -> None:
    """tokens/s and tokens per pass against the budget, one line per method (and drafter); auto as a marker."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'edge-spec[plot]' (or pip install matplotlib)") from None
    figure, (speed, per_pass) = plt.subplots(1, 2, figsize=(11, 4.2))
    plain = next(r for r in result["rows"] if r["method"] == "plain")
    lines: dict[str, list[dict]] = {}
    for row in result["rows"]:
        if row["method"] != "plain":
            label = row["method"] if len(result.get("drafters", [])) < 2 else f"{row['method']} ({row['drafter']})"
            lines.setdefault(label, []).append(row)
    for label, rows in lines.items():
        fixed = sorted((r for r in rows if r["budget"] != "auto"), key=lambda r: r["budget"])
        if fixed:
            budgets = [r["budget"] for r in fixed]
            speed.plot(budgets, [r["tokens_per_s"] for r in fixed], marker="o", label=label)
            per_pass.plot(budgets, [r["tokens_per_pass"] for r in fixed], marker="o", label=label)
        for row in rows:
            if row["budget"] == "auto":
                at = max(row["mean_budget"], 1)
                speed.scatter([at], [row["tokens_per_s"]], marker="*", s=160, zorder=3,
                              label=f"{label}, auto (mean budget {row['mean_budget']:g})")
                per_pass.scatter([at], [row["tokens_per_pass"]], marker="*", s=160, zorder=3)
    speed.axhline(plain["tokens_per_s"], color="gray", linestyle="--", label="plain")
    per_pass.axhline(plain["tokens_per_pass"], color="gray", linestyle="--")
    for axis, name in ((speed, "tokens/s"), (per_pass, "tokens per target pass")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tree budget (draft nodes)")
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
    speed.legend(fontsize=8)
    figure.suptitle(f"{result['pair']} · {result.get('target')} · placement {result.get('placement')} · "
                    f"{result['machine']['cpu']}, {result['machine']['cores']} cores", fontsize=10)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=110)
    except OSError as error:
        raise UserError(f"cannot write the plot to {path}: {error.strerror}") from None
    finally:
        plt.close(figure)
