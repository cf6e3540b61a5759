"""`edge-spec bench` as a library call: plain decoding, chains and trees over the same prompts in one run, each row
checked against plain decoding token for token; the result is one JSON-ready dict."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.models.sources import model_path
from edge.offload.tuning import expand_ms, pass_ms

from edge.budget import json_table
from edge.chat import Prompt
from edge.errors import UserError
from edge.generate import Decoder, Stats
from edge.grow import GrowConfig
from edge.lookup import Corpus, Lookup
from edge.options import check_max_tokens
from edge.protocols import Drafter
from edge.rules import AUTO_RULES
from edge.sampling import SamplingConfig

if TYPE_CHECKING:
    from edge.models.pair import Pair

Report = Callable[[str], None]


def _quiet(_message: str) -> None:
    pass


def benchmark_file(name: str) -> Path:
    """A file of benchmarks/: inside the package in an installed wheel, at the repo root otherwise."""
    package_dir = Path(__file__).resolve().parent
    packaged = package_dir / "benchmarks" / name
    return packaged if packaged.exists() else package_dir.parent / "benchmarks" / name


DEFAULT_PROMPTS = benchmark_file("chat-prompts.txt")
METHODS = ("plain", "chain", "tree")
MAX_PROMPTS_BYTES = 16 << 20  # a prompts file: what a benchmark reads and tokenizes before its first pass


def read_text_file(path: Path, what: str) -> str:
    """A small UTF-8 file the user names (prompts, API keys): a regular file (a FIFO waits forever, /dev/zero never
    ends) of at most MAX_PROMPTS_BYTES; each problem one UserError naming `what`."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise UserError(f"{what} {path} is not a regular file; give a text file")
        with path.open("rb") as file:
            data = file.read(MAX_PROMPTS_BYTES + 1)
        if len(data) > MAX_PROMPTS_BYTES:
            raise UserError(f"{what} {path} is larger than {MAX_PROMPTS_BYTES >> 20} MiB")
        return data.decode("utf-8")
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror}") from None
    except UnicodeDecodeError as problem:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {problem.start})") from None


def read_prompts(path: Path | None) -> list[Prompt]:
    """One prompt per line: plain text, or a JSON line (a prompt spanning lines): one JSON string, or one list of
    chat messages ({"role": ..., "content": ...}, a multi-turn conversation)."""
    path = path or DEFAULT_PROMPTS
    lines = [line.strip() for line in read_text_file(path, "prompts file").splitlines() if line.strip()]
    if not lines:
        raise UserError(f"prompts file {path} has no prompts (one per line)")
    return [_prompt(line, path, number) for number, line in enumerate(lines, 1)]


def _prompt(line: str, path: Path, number: int) -> Prompt:
    """A line as a prompt: text, or (starting with a quote or a bracket) JSON: a string or a list of messages."""
    if not line.startswith(('"', "[")):
        return line
    try:
        value = json.loads(line)
    except json.JSONDecodeError as problem:
        raise UserError(f"{path}, prompt {number}: not valid JSON ({problem.msg} at column {problem.colno}); a "
                        "line starting with \" or [ is one JSON string or one list of chat messages") from None
    except (ValueError, RecursionError) as problem:  # a number past Python's 4300 digits, nesting past its depth
        raise UserError(f"{path}, prompt {number}: not a prompt ({problem.__class__.__name__}: nested too deep or a "
                        "number too long); a line starting with \" or [ is one JSON string or one list of chat "
                        "messages") from None
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise UserError(f"{path}, prompt {number}: a JSON line is one non-empty string or one list of "
                    "{\"role\": ..., \"content\": ...} messages")


LOOKUP = "lookup"  # the drafter choice of lookup drafting (alone, or NAME+lookup)


@dataclass(frozen=True)
class DrafterChoice:
    runtime: str | None  # a runtime's name (runtimes.names()); None: no drafter model (lookup alone)
    vocab: int | None = None  # a trimmed head's size (onnx), None: the full head
    quantize: str | None = None  # prepare it from the target's source requantized (llama.cpp ftype), None: the pair's
    lookup: bool = False  # lookup's branches join the trees

    @property
    def label(self) -> str:
        if self.runtime is None:
            return LOOKUP
        return (self.runtime + (f":{self.vocab}" if self.vocab else "") + (f"@{self.quantize}" if self.quantize else "")
                + (f"+{LOOKUP}" if self.lookup else ""))


def run_bench(pair: Pair, prompts: list[Prompt], budgets: list[int | str], max_tokens: int, sampling: SamplingConfig,
              raw: bool = False, report: Report = _quiet, drafters: list[DrafterChoice] | None = None,
              methods: tuple[str, ...] = ("plain", "tree"),
              progress: Callable[[int, int], None] | None = None, accepts: tuple[str, ...] = ("match",),
              ) -> dict[str, Any]:
    """Plain decoding (the reference every row is checked against) and each method x budget x acceptance rule,
    prompt by prompt: each prompt runs through every row in turn, so a slow spell of a shared machine falls on all
    rows alike. With `drafters`, the rows run once per drafter (the pair's drafter file on another runtime, head or
    quantization; lookup drafting alone, or beside a drafter: each row with its own index of its earlier replies).
    `progress(done, total)` hears of each prompt decoded by each row. A sampled row whose rule is not
    sample-and-match is not checked against plain decoding's text (it keeps the distribution, not the seed's text):
    its matches_plain is None. Each row learns its rules' acceptance rates (and `--accept auto` its yields) from its
    own rounds alone (and from what an earlier run kept: models/kept.py), as a pair that runs only that row's settings
    would: rows run side by side do not teach each other. What they measured joins the pair's, kept for the next run."""
    from edge.offload.probe import probe_machine
    from edge.offload.tuning import measure_costs

    from edge.budget import AutoBudget

    check_max_tokens(max_tokens)
    prompt_tokens = [pair.prompt_tokens(prompt, raw=raw or None) for prompt in prompts]
    pass_ms = target_pass_times(pair, prompt_tokens[0], report)
    rows, drafter_info, reference, costs = [], [], None, None
    accepts = ("match",) if sampling.greedy else accepts  # greedy: the rules are the same
    shapes = [(m, b, a) for m in methods if m != "plain" for b in budgets if not (b == "auto" and m == "chain")
              for a in accepts]
    total, done = len(prompts) * (1 + max(1, len(drafters or [])) * len(shapes)), 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    for drafter, label, looks in _drafters(pair, drafters, report):
        if drafter is not None:
            expand = json_table(expand_ms(drafter, prompt_tokens[0]))
            drafter_info.append({"drafter": label, "vocab": drafter.vocab, "expand_ms": expand,
                                 "kv_bytes_per_token": round(drafter.kv_bytes_per_token(), 1)})
        runs = [] if reference is not None else [("plain", None, "match", Decoder(pair.target, None, None, sampling))]
        costs = None
        for method, budget, accept in shapes:
            if drafter is None and method == "chain":
                continue  # lookup alone proposes its own tree
            policy, grow = None, None
            if budget == "auto":
                costs = costs or measure_costs(pair.target, drafter, prompt_tokens[0], pair.target.max_tree)
                policy = AutoBudget(costs)
            else:
                grow = GrowConfig.chain(budget) if method == "chain" else GrowConfig.for_budget(budget)
            lookup = Lookup(Corpus()) if looks else None
            runs.append((method, budget, accept, Decoder(pair.target, drafter, policy or grow, sampling, accept,
                                                         lookup=lookup, overlap=pair.overlaps,
                                                         choices=pair.rule_choices.afresh())))
        report(f"{label}: {', '.join(_label(m, b, a, accepts) for m, b, a, _ in runs)}; "
               f"{len(prompts)} prompts, each through every row in turn")
        results = _decode_interleaved([decoder for *_, decoder in runs], prompt_tokens, max_tokens, sampling, tick)
        for (method, budget, accept, _), (outputs, stats, read) in zip(runs, results, strict=True):
            if method == "plain":
                reference = outputs
                rows.insert(0, _row("plain", None, stats, True, read))
            else:
                checked = accept == "match" or sampling.greedy
                row = _row(method, budget, stats, outputs == reference if checked else None, read)
                rows.append({"drafter": label, "vocab": None if drafter is None else drafter.vocab, "lookup": looks,
                             "accept": accept, **row})
        if drafter is not None and drafter is pair.drafter:  # what each row measured, for the runs after this one
            _keep_row_yields(pair, runs)
    plain = rows[0]
    for row in rows:
        row["speedup"] = round(row["tokens_per_s"] / plain["tokens_per_s"], 3) if plain["tokens_per_s"] else 0
    target_file = model_path(pair.spec.target)
    return {"pair": pair.name, "machine": probe_machine(), "placement": pair.placement, "overlap": pair.overlaps,
            "evicted_by": "kernel" if pair.streamed else "edge-spec" if pair.placement == "ssd" else None,
            "plan": pair.plan_note, **_residency(pair),
            "target": target_file.name if target_file is not None else None, "prompts": len(prompts),
            "max_tokens": max_tokens, "temperature": sampling.temperature, "sampling": sampling.described(),
            "lossless_warning": pair.lossless_warning,
            "target_pass_ms": pass_ms, "auto_costs": None if costs is None else costs.to_json(),
            "drafters": drafter_info, "rows": rows}


def _residency(pair: Pair) -> dict[str, int | None]:
    """A target streamed in a window: the bytes of it that stay in RAM, and those a pass reads from the drive (what a
    row's bytes_read_per_pass is to be compared with); None for the rest."""
    resident, streamed = pair.residency() or (None, None)
    return {"resident_bytes": resident, "streamed_bytes": streamed}


def _decode_interleaved(decoders: list[Decoder], prompt_tokens: list[list[int]], max_tokens: int,
                        sampling: SamplingConfig, tick: Callable[[], None] = lambda: None,
                        ) -> list[tuple[list[list[int]], Stats, int | None]]:
    """Every prompt through every decoder in turn; per decoder its outputs, its stats and the bytes the process
    read from storage while it ran (prefill included)."""
    from edge.offload.ssd import read_bytes

    outputs: list[list[list[int]]] = [[] for _ in decoders]
    totals = [Stats() for _ in decoders]
    reads: list[int | None] = [0 for _ in decoders]
    for tokens in prompt_tokens:
        for i, decoder in enumerate(decoders):
            decoder.set_sampling(sampling)  # the same seed for every method: sampled runs are comparable
            before = read_bytes()
            steps = list(decoder.reply(tokens, max_tokens))  # a reply: lookup keeps it for the prompts after
            after = read_bytes()
            decoder.reset()  # the next row starts from an empty cache (they share the target and drafter)
            outputs[i].append([s.token for s in steps if s.token is not None and s.finish_reason is None])
            totals[i].add(steps[-1].stats)
            tick()
            reads[i] = None if reads[i] is None or before is None or after is None else reads[i] + after - before
    return list(zip(outputs, totals, reads, strict=True))


def _drafters(pair: Pair, choices: list[DrafterChoice] | None,
              report: Report) -> Iterator[tuple[Drafter | None, str, bool]]:
    """(drafter or None, label, lookup on) for each choice, one drafter open at a time; the pair's own drafter and
    lookup setting when none are given."""
    if choices is None:
        looks = pair.corpus is not None
        if pair.drafter is None:
            if not looks:
                raise UserError(f"{pair.name} has no drafter to compare, and lookup is off")
            yield None, LOOKUP, True
            return
        label = pair.drafter.runtime + (f":{pair.drafter.vocab}" if pair.spec.drafter.vocab else "")
        yield pair.drafter, label + (f"+{LOOKUP}" if looks else ""), looks
        return
    from edge.models.opening import head_ids

    for choice in choices:  # a missing vocabulary fails now, not after the drafters before it have run
        if choice.runtime is not None:
            head_ids(pair.spec, replace(pair.spec.drafter, runtime=choice.runtime, vocab=choice.vocab))
    for choice in choices:
        if choice.runtime is None:
            pair.drop_drafter()
            yield None, choice.label, True
        else:
            yield pair.swap_drafter(choice.runtime, choice.vocab or 0, choice.quantize, report), choice.label, \
                choice.lookup


def target_pass_times(pair: Pair, prefix: list[int], report: Report = _quiet) -> dict[str, dict[str, float]]:
    """Pass times of the pair's target; one sharing its KV cache with its drafter (QuantSpec) is timed beside the
    default runtime's target on the same file."""
    from edge.runtimes import DEFAULT, ModelOptions, runtime, traits

    times = {pair.target.runtime: json_table(pass_ms(pair.target, prefix))}
    if traits(pair.spec.target.runtime).shared_cache:
        from edge.models.opening import materialize

        report(f"{DEFAULT} target on the same file, for its pass times")
        options = ModelOptions(n_ctx=pair.spec.ctx, kv_type=pair.spec.target.kv_type, threads=pair.options.threads)
        other = runtime(DEFAULT).open_target(materialize(pair.spec.target, report), options, pair.target.max_tree)
        try:
            times[DEFAULT] = json_table(pass_ms(other, prefix))
        finally:
            other.close()
    return times


def _keep_row_yields(pair: Pair, runs: list[tuple[str, int | str | None, str, Decoder]]) -> None:
    """Each rule's rounds for the pair to keep: a row that ran the rule alone measured it on every prompt, so an auto
    row's rounds of it, run on the texts where auto happened to choose it, join only where no such row ran."""
    alone = {accept for _, _, accept, _ in runs}
    for _, _, accept, decoder in runs:
        rules = [rule for rule in AUTO_RULES if accept == rule or (accept == "auto" and rule not in alone)]
        pair.rule_choices.take(decoder.rounds.choices, rules)


def _label(method: str, budget: int | str | None, accept: str, accepts: tuple[str, ...]) -> str:
    if budget is None:
        return method
    return f"{method} {budget}" + (f" {accept}" if len(accepts) > 1 else "")


def _row(method: str, budget: int | str | None, stats: Stats, matches_plain: bool | None,
         read: int | None) -> dict[str, Any]:
    figures = stats.as_dict()
    passes = max(stats.target_passes + stats.prefill_passes, 1)  # the bytes read: over every pass, the prompts' too
    return {
        "method": method,
        "budget": budget or 0,
        **{key: figures[key] for key in ROW_FIGURES},
        "bytes_read_per_pass": None if read is None else round(read / passes),
        "target_passes": stats.target_passes,
        "prefill_passes": stats.prefill_passes,
        "rounds": stats.rounds,
        "new_tokens": stats.new_tokens,
        "drafter_passes_per_round": figures["drafter_passes_per_round"],
        "tree_nodes_per_round": figures["tree_nodes_per_round"],
        "mean_budget": figures["mean_budget"],
        "plain_rounds": stats.plain_rounds if budget == "auto" else 0,
        "lookup_rounds": stats.lookup_rounds,
        "residual_rounds": stats.residual_rounds,
        "rule_rounds": dict(sorted(stats.rule_rounds.items())),
        "rule_tokens_per_pass": stats.rule_tokens_per_pass(),
        "hidden_s_per_round": figures["hidden_s_per_round"],  # drafting during the target's passes (--overlap)
        "pregrown_rounds": stats.pregrown_rounds,
        "matches_plain": matches_plain,
    }


ROW_FIGURES = ("tokens_per_pass", "grow_s_per_round", "draft_s_per_round", "verify_s_per_round", "tokens_per_s")
