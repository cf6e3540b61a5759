"""A tiny numpy language model for logic tests: next-token logits depend on the last two tokens.

It implements both protocols with a real (list) KV cache and checks the commit contract as it goes, so
tests can compute its exact distributions and see every cache operation.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edge.generate import Decoder
from edge.grow import GrowConfig
from edge.protocols import ModelDefaults, SpecialTokens
from edge.sampling import SamplingConfig
from edge.tree import TokenTree


class TinyTokenizer:
    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return [ord(c) % self.n_vocab for c in text]

    def token_bytes(self, token: int) -> bytes:
        return f"<{token}>".encode()


class TinyModel(ModelDefaults):
    """logits(context) = table[context[-2], context[-1]]: [n_vocab] float32."""

    runtime = "tiny"
    path = Path("tiny")

    def __init__(self, n_vocab: int = 5, seed: int = 0, scale: float = 2.0, table: np.ndarray | None = None):
        rng = np.random.default_rng(seed)
        self.table = table if table is not None else (rng.standard_normal((n_vocab, n_vocab, n_vocab)) * scale
                                                      ).astype(np.float32)
        self.n_vocab = n_vocab
        self.n_ctx = 10_000
        self.cache: list[int] = []  # the tokens whose "KV" is held
        self.pending: list[int] = []
        self.passes = 0
        self.max_tree = 1024
        self.expand_capacity = 255
        self.tokenizer = TinyTokenizer(n_vocab)
        self.special = SpecialTokens()
        self.vocab = n_vocab
        self._round: dict[int, list[int]] = {}  # node -> its full context (drafter side)

    @property
    def stop_tokens(self) -> frozenset[int]:
        return self.special.stop

    @stop_tokens.setter
    def stop_tokens(self, tokens: frozenset[int]) -> None:
        self.special = SpecialTokens(stop=frozenset(tokens))

    @property
    def n_past(self) -> int:
        return len(self.cache)

    def logits(self, context: Sequence[int]) -> np.ndarray:
        a, b = (context[-2] if len(context) > 1 else 0), context[-1]
        return self.table[a, b]

    def noisy(self, noise: float, seed: int = 1) -> TinyModel:
        """A drafter that mostly agrees with this model."""
        rng = np.random.default_rng(seed)
        return TinyModel(self.n_vocab, table=self.table + rng.standard_normal(self.table.shape).astype(np.float32)
                         * noise)

    # both protocols
    def prefill(self, tokens: Sequence[int]) -> None:
        self.cache += [*self.pending, *tokens]
        self.pending = []

    def truncate(self, n: int) -> None:
        full = self.cache + self.pending
        self.cache, self.pending = full[:n], []
        self._round = {}

    # Target
    def verify(self, tree: TokenTree) -> np.ndarray:
        self.passes += 1
        base = self.cache + self.pending
        rows = []
        for node in range(len(tree)):
            rows.append(self.logits(base + _path_tokens(tree, node)))
        return np.array(rows)

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        assert path[0] == 0 and all(tree.parents[b] == a for a, b in itertools.pairwise(path)), path
        self.cache += self.pending + tree.path_tokens(path)
        self.pending = []
        self._round = {}

    # Drafter
    def expand(self, tree: TokenTree, nodes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.expand_logits(tree, nodes, k)[:2]

    def expand_logits(self, tree: TokenTree, nodes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.passes += 1
        base = self.cache + self.pending
        logits = np.array([self.logits(base + _path_tokens(tree, int(v))) for v in nodes])
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        ids = np.argsort(-logp, axis=1, kind="stable")[:, :k]
        return (ids.astype(np.int32), np.take_along_axis(logp, ids, axis=1).astype(np.float32),
                np.take_along_axis(logits, ids, axis=1).astype(np.float32))


def _path_tokens(tree: TokenTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return path[::-1]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def generate_tokens(target: TinyModel, drafter: TinyModel | None, budget: int | None, prompt: list[int],
                    n: int, sampling: SamplingConfig) -> list[int]:
    decoder = Decoder(target, drafter, GrowConfig.for_budget(budget) if budget else None, sampling)
    decoder.load(prompt)
    return [s.token for s in decoder.generate(n) if s.token is not None and s.finish_reason is None]
