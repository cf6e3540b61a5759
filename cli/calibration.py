"""`edge-spec prepare --vocab K`: count the target's own greedy completions of calibration prompts and keep
the K most frequent tokens (plus the special ones) as a frequency-ranked vocabulary for a trimmed draft head.
Tokens the run never saw are ranked by the tokenizer's own prior (quant.vocab.choose_prior)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from cli.benchmark import benchmark_file, read_prompts
from cli.loading import LoadedPair, model_path
from edge.errors import UserError
from edge.generate import Decoder
from edge.registry import ModelSpec
from edge.sources import sha256_file, vocab_path
from quant.vocab import Prior, RankedVocab, choose_prior, count_tokens, select


@dataclass(frozen=True)
class BuiltVocab:
    k: int
    path: Path
    coverage: float  # fraction of the counted tokens that are kept
    counted: int  # tokens generated over all prompts
    distinct: int  # distinct ids among them: past this, K is filled by the prior's likeliest unseen ids
    prior: str  # what ranked the unseen ids


def parse_vocab_sizes(values: list[str]) -> list[int]:
    """`--vocab 8192 --vocab 16384,32768` -> [8192, 16384, 32768]."""
    try:
        sizes = {int(part) for value in values for part in value.split(",") if part.strip()}
    except ValueError:
        raise UserError(f"--vocab takes token counts, like 16384 or 8192,16384 (got {' '.join(values)!r})") from None
    if not sizes or min(sizes) < 1:
        raise UserError(f"--vocab sizes must be positive (got {' '.join(values)!r})")
    return sorted(sizes)


def default_prompts(loaded: LoadedPair) -> Path:
    """Chat prompts in the template for chat models; openings of plain text for base models."""
    return benchmark_file("calibration-chat.txt" if loaded.template is not None else "calibration-text.txt")


def build_vocabs(loaded: LoadedPair, target: ModelSpec, sizes: list[int], prompts_path: Path | None,
                 n_tokens: int, console: Console) -> list[BuiltVocab]:
    """One calibration run, one file per size (written to vocab_path(target, k))."""
    model = loaded.target.model
    special = model.special_tokens()
    for k in sizes:
        if k > model.n_vocab:
            raise UserError(f"--vocab {k} is larger than {loaded.name}'s vocabulary of {model.n_vocab} tokens")
        if k < len(special):
            raise UserError(f"--vocab {k} cannot hold {loaded.name}'s {len(special)} special tokens, "
                            "which are always kept; ask for more")
    prompts_path = prompts_path or default_prompts(loaded)
    prompts = read_prompts(prompts_path)
    columns = (TextColumn("calibrating {task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(f"{loaded.name} ({n_tokens} tokens per prompt)", total=len(prompts))
        counts = count_tokens(completions(loaded, prompts, n_tokens, lambda: progress.advance(task)), model.n_vocab)
    prior = token_prior(target)
    source = (f"{n_tokens} greedy tokens per prompt of {prompts_path.name} (sha256 {sha256_file(prompts_path)}, "
              f"{len(prompts)} prompts, {'chat template' if loaded.template else 'raw text'}), "
              f"target {target.source.describe()}{f' as {target.quantize}' if target.quantize else ''}; "
              f"unseen tokens ranked by {prior.name}")
    built = []
    for k in sizes:
        vocab = RankedVocab(select(counts, k, special, prior.values), counts, model.n_vocab, source)
        path = vocab_path(target, k)
        vocab.save(path)
        built.append(BuiltVocab(k, path, vocab.coverage, int(counts.sum()), int(np.count_nonzero(counts)),
                                prior.name))
    return built


def token_prior(target: ModelSpec) -> Prior:
    """The prior of the target file's tokenizer: its scores, its merge order, or its ids."""
    from runtimes.gguf_file import read_tokenizer

    path = model_path(target)
    assert path is not None and path.is_file(), f"the target is loaded, so its file exists (got {path})"
    tokenizer = read_tokenizer(path)
    return choose_prior(tokenizer.tokens, tokenizer.scores, tokenizer.merges)


def completions(loaded: LoadedPair, prompts: list[str], n_tokens: int,
                done: Callable[[], None]) -> Iterator[list[int]]:
    """The target's own greedy continuation of each prompt, up to n_tokens (an end-of-generation token included)."""
    from cli.main import prompt_for

    decoder = Decoder(loaded.target)  # no drafter: plain decoding
    for prompt in prompts:
        tokens = prompt_for(loaded, prompt, raw=loaded.template is None)
        decoder.load(tokens)
        for _ in decoder.generate(n_tokens):
            pass
        yield decoder.context[len(tokens):]
        done()
