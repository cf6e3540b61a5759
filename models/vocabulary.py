"""`edge-spec prepare --vocab K`: count the target's own greedy completions of calibration prompts and keep
the K most frequent tokens (plus the special ones) as a frequency-ranked vocabulary for a trimmed draft head.
Tokens the run never says are ranked in turn by how likely the target found them at the same positions and by
the tokenizer's own frequency order."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from edge.models.bench import benchmark_file, read_prompts
from edge.models.cache import atomic_path, sha256_file
from edge.models.pair import Pair
from edge.models.registry import ModelSpec
from edge.models.sources import vocab_path
from edge.quant.vocab import RankedVocab, count_tokens, expected_counts, select

from edge.errors import UserError
from edge.generate import Decoder
from edge.protocols import Target, TargetWrapper
from edge.tree import TokenTree


@dataclass(frozen=True)
class BuiltVocab:
    k: int
    path: Path
    coverage: float  # fraction of the counted tokens that are kept
    counted: int  # tokens generated over all prompts
    distinct: int  # distinct ids among them: past this, K is filled by the unseen ids the target found likeliest


def parse_vocab_sizes(values: list[str]) -> list[int]:
    """`--vocab 8192 --vocab 16384,32768` -> [8192, 16384, 32768]."""
    try:
        sizes = {int(part) for value in values for part in value.split(",") if part.strip()}
    except ValueError:
        raise UserError(f"vocab takes token counts, like 16384 or 8192,16384 (got {' '.join(values)!r})",
                        "vocab") from None
    if not sizes or min(sizes) < 1:
        raise UserError(f"vocab sizes must be positive (got {' '.join(values)!r})", "vocab")
    return sorted(sizes)


def default_prompts(pair: Pair) -> Path:
    """Chat prompts in the template for chat models; openings of plain text for base models."""
    return benchmark_file("calibration-chat.txt" if pair.template is not None else "calibration-text.txt")


def build_vocabs(pair: Pair, target: ModelSpec, sizes: list[int], prompts_path: Path | None, n_tokens: int,
                 progress: Callable[[int, int], None] = lambda done, total: None) -> list[BuiltVocab]:
    """One calibration run, one file per size (written to vocab_path(target, k)); `progress(done, total)` after
    each calibration prompt."""
    tokenizer, n_vocab = pair.target.tokenizer, pair.target.n_vocab
    special = pair.target.special.ids
    for k in sizes:
        if k > n_vocab:
            raise UserError(f"vocab {k} is larger than {pair.name}'s vocabulary of {n_vocab} tokens", "vocab")
        if k < len(special):
            raise UserError(f"vocab {k} cannot hold {pair.name}'s {len(special)} special tokens, "
                            "which are always kept; ask for more", "vocab")
    prompts_path = prompts_path or default_prompts(pair)
    prompts = read_prompts(prompts_path)
    scoring = ScoringTarget(pair.target)
    done = iter(range(1, len(prompts) + 1))
    sequences = completions(pair, prompts, n_tokens, lambda: progress(next(done), len(prompts)), scoring)
    counts = count_tokens(sequences, n_vocab)
    if scoring.positions != counts.sum():
        raise RuntimeError(f"the target scored {scoring.positions} positions for {counts.sum()} generated tokens: "
                           "plain decoding no longer verifies one token per pass")
    source = (f"{n_tokens} greedy tokens per prompt of {prompts_path.name} (sha256 {sha256_file(prompts_path)}, "
              f"{len(prompts)} prompts, {'chat template' if pair.template else 'raw text'}), "
              f"target {target.source.describe()}{f' as {target.quantize}' if target.quantize else ''}; "
              "unseen tokens ranked by the target's expected counts and the tokenizer's order in turn")
    built, broad = [], tokenizer.ranked_tokens()
    for k in sizes:
        vocab = RankedVocab(select(counts, k, special, scoring.expected, broad), counts, n_vocab, source)
        path = vocab_path(target, k)
        with atomic_path(path) as tmp:
            vocab.save(tmp)
        built.append(BuiltVocab(k, path, vocab.coverage, int(counts.sum()), int(np.count_nonzero(counts))))
    return built


class ScoringTarget(TargetWrapper):
    """A target that also sums its next-token distributions (quant.vocab.expected_counts) over every pass.

    Plain decoding verifies a one-node tree per generated token, so the sum covers exactly the counted
    positions, at no extra cost: the logits were computed anyway.
    """

    def __init__(self, target: Target):
        super().__init__(target)
        self.expected = np.zeros(target.n_vocab)  # float64 [n_vocab]
        self.positions = 0

    def verify(self, tree: TokenTree) -> np.ndarray:
        logits = self.inner.verify(tree)  # [n_nodes, n_vocab]
        self.expected += expected_counts(logits)
        self.positions += len(logits)
        return logits


def completions(pair: Pair, prompts: list[str], n_tokens: int, done: Callable[[], None],
                target: Target | None = None) -> Iterator[list[int]]:
    """The target's own greedy continuation of each prompt, up to n_tokens (an end-of-generation token included).

    `target`, when given, decodes in place of pair.target: build_vocabs passes a ScoringTarget around it.
    """
    decoder = Decoder(target or pair.target)  # no drafter: plain decoding
    for prompt in prompts:
        tokens = pair.prompt_tokens(prompt)
        decoder.load(tokens)
        for _ in decoder.generate(n_tokens):
            pass
        yield decoder.context[len(tokens):]
        done()
