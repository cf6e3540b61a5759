"""Frequency-ranked vocabularies (VocabTrim / FR-Spec): the K tokens a trimmed draft head keeps.

Count the tokens the target itself generates on calibration prompts, keep the K most frequent plus the
special and control tokens no calibration text shows (the many tokens never generated are ranked in turn by
the target's expected counts at the same positions and by the tokenizer's own order), and save the ids with the
counts and what was counted.
A drafter whose head has only those K rows costs K/n_vocab of the full head; the output stays the
target's (acceptance is lossless for any drafter), only tokens outside the set are never drafted unless the
context holds them (the ONNX drafter scores those too: runtimes/onnx/graph.py, context_rows).
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge.errors import Remedy, UserError

VOCAB_REMEDY = Remedy("prepare", "PAIR", (("vocab", "K"),))  # builds a K-token vocabulary for a pair

_KEYS = {"ids", "counts", "n_vocab", "source"}


@dataclass(frozen=True, eq=False)
class RankedVocab:
    ids: np.ndarray  # int32 [K] kept token ids, sorted ascending
    counts: np.ndarray  # int64 [n_vocab] counts over the calibration completions
    n_vocab: int
    source: str  # what was counted: prompt file and its sha256, tokens generated per prompt, model

    @property
    def coverage(self) -> float:
        """The fraction of counted tokens whose id is kept: how often the target's next token is draftable."""
        return coverage(self.counts, self.ids)

    def save(self, path: Path) -> None:
        # Compressed: most of a large vocabulary's counts are 0. A file object, or numpy would append ".npz".
        # The caller makes the write atomic (models/vocabulary.py writes to a temporary name, then renames it).
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with Path(path).open("wb") as f:
            np.savez_compressed(f, ids=self.ids, counts=self.counts, n_vocab=np.int64(self.n_vocab),
                                source=np.str_(self.source))

    @classmethod
    def load(cls, path: Path) -> RankedVocab:
        if not path.is_file():
            raise UserError(f"vocabulary file {path} not found; prepare the pair's vocabulary", remedy=VOCAB_REMEDY)
        try:
            with np.load(path, allow_pickle=False) as npz:
                if set(npz.files) != _KEYS:
                    raise ValueError(f"keys {sorted(npz.files)}, expected {sorted(_KEYS)}")
                vocab = cls(npz["ids"], npz["counts"], int(npz["n_vocab"]), str(npz["source"]))
            _check(vocab)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
            raise UserError(f"{path} is not a valid vocabulary file ({error}); delete it and prepare the pair's "
                            "vocabulary again", remedy=VOCAB_REMEDY) from None
        return vocab


def count_tokens(sequences: Iterable[Sequence[int]], n_vocab: int) -> np.ndarray:
    """How often each token id occurs in `sequences`: int64 [n_vocab]."""
    counts = np.zeros(n_vocab, np.int64)
    for sequence in sequences:
        tokens = np.asarray(sequence, np.int64)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= n_vocab):
            raise ValueError(f"token ids must lie in [0, {n_vocab}) (got {tokens.min()}..{tokens.max()})")
        counts += np.bincount(tokens, minlength=n_vocab)
    return counts


def select(counts: np.ndarray, k: int, always: Iterable[int], prior: np.ndarray | None = None,
           broad: np.ndarray | None = None) -> np.ndarray:
    """Exactly `k` token ids, ascending: every id in `always`, then the others by count, then by `prior`
    (higher first; expected_counts over the same positions), then by lower id.

    K counts the specials too, so it is the trimmed head's row count. The prior ranks the tokens a short
    calibration run never says, which fill most of a large K. It only knows the calibration text's topics,
    so with `broad` (token ids, most frequent first, from a much larger corpus: tokenizer_order) the unseen
    tokens take turns: the prior's best, broad's best, the prior's next, ..., each token at the better of
    its two places. Counted tokens still come before all unseen ones.
    """
    n_vocab = len(counts)
    keep = np.zeros(n_vocab, bool)  # [n_vocab]
    keep[np.fromiter(always, np.int64)] = True
    n_always = int(keep.sum())
    if not n_always <= k <= n_vocab:
        raise ValueError(f"k must lie between the {n_always} always-kept tokens and the vocabulary's {n_vocab}"
                         f" (got {k})")
    if prior is not None and (prior.shape != counts.shape or not np.all(np.isfinite(prior))):
        raise ValueError(f"prior must hold one finite value per token (got {prior.dtype} {prior.shape})")
    ids = np.arange(n_vocab)
    # lexsort's last key is the primary one: count, then prior, then id.
    keys = (ids, -counts) if prior is None else (ids, -prior.astype(np.float64), -counts)
    ranked = np.lexsort(keys)
    if broad is not None:
        ranked = _take_turns(ranked, counts, np.asarray(broad, np.int64))
    keep[ranked[~keep[ranked]][: k - n_always]] = True
    return np.flatnonzero(keep).astype(np.int32)


def _take_turns(ranked: np.ndarray, counts: np.ndarray, broad: np.ndarray) -> np.ndarray:
    """`ranked` (every id, best first) with its unseen tail interleaved with `broad`'s order of those ids."""
    if len(np.unique(broad)) != len(broad) or (len(broad) and (broad.min() < 0 or broad.max() >= len(counts))):
        raise ValueError(f"broad must list distinct token ids below {len(counts)}")
    seen = ranked[counts[ranked] > 0]
    unseen = ranked[counts[ranked] == 0]
    place = np.full(len(counts), np.iinfo(np.int64).max, np.int64)  # [n_vocab] turn at which each id comes up
    place[unseen] = 2 * np.arange(len(unseen))
    listed = broad[counts[broad] == 0]
    place[listed] = np.minimum(place[listed], 2 * np.arange(len(listed)) + 1)
    return np.concatenate([seen, unseen[np.argsort(place[unseen], kind="stable")]])


def expected_counts(logits: np.ndarray) -> np.ndarray:
    """float64 [n_vocab]: the softmax of each row of `logits` [n_rows, n_vocab], summed over the rows.

    At the positions a calibration run counts, this is how often the target would have said each token if
    it sampled: every token gets a share, so it ranks the many tokens one greedy run never says.
    """
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)  # [n_rows, n_vocab]
    probs = np.exp(shifted)
    probs /= probs.sum(axis=1, keepdims=True)
    return probs.sum(axis=0)


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """The fraction of all counted tokens whose id is in `ids` (0 when nothing was counted)."""
    total = int(counts.sum())
    return float(counts[ids].sum() / total) if total else 0.0


def _check(vocab: RankedVocab) -> None:
    ids, counts = vocab.ids, vocab.counts
    if counts.dtype != np.int64 or counts.shape != (vocab.n_vocab,):
        raise ValueError(f"counts are {counts.dtype} {counts.shape}, expected int64 ({vocab.n_vocab},)")
    if ids.dtype != np.int32 or ids.ndim != 1 or not len(ids):
        raise ValueError(f"ids are {ids.dtype} {ids.shape}, expected a non-empty int32 [K]")
    if ids[0] < 0 or ids[-1] >= vocab.n_vocab or np.any(np.diff(ids) <= 0):
        raise ValueError(f"ids must be distinct, ascending and below {vocab.n_vocab}")
