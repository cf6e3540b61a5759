"""The seams between the engine and whatever runs a model.

Both models keep a KV cache. Between rounds each holds exactly the committed tokens except the newest one,
which is the next tree's root. `commit` keeps the root plus the accepted path and drops every other branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from edge.tree import TokenTree


class Tokenizer(Protocol):
    n_vocab: int

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...


class Target(Protocol):
    n_vocab: int
    n_ctx: int
    n_past: int  # tokens in the KV cache
    passes: int  # forward passes run so far (one llama_decode each)
    max_tree: int  # the most nodes one verify pass accepts
    tokenizer: Tokenizer
    stop_tokens: frozenset[int]

    def prefill(self, tokens: Sequence[int]) -> None: ...
    def verify(self, tree: TokenTree) -> np.ndarray: ...  # [n_nodes, n_vocab] float32 view, ONE pass
    def commit(self, tree: TokenTree, path: list[int]) -> None: ...
    def truncate(self, n: int) -> None: ...  # keep the first n tokens of the KV cache
    def close(self) -> None: ...  # free native memory; the model is unusable afterwards
    # Optional: `prefetch()`, called as a round starts growing its tree (a streamed target reads ahead).


class Drafter(Protocol):
    runtime: str  # the runtime it runs on ("llama_cpp", "onnx")
    vocab: int  # the tokens its head scores (fewer than the target's when trimmed to the frequent ones)
    n_past: int  # tokens in the KV cache
    expand_capacity: int  # the most nodes `expand` may be asked about in one round

    def prefill(self, tokens: Sequence[int]) -> None: ...

    def expand(self, tree: TokenTree, nodes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (token ids [len(nodes), k], log-probs [len(nodes), k]) after each node, each row best first, in ONE
        pass."""
        ...

    def expand_logits(self, tree: TokenTree, nodes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As expand, with the raw logits of those top-k tokens [len(nodes), k] too (the residual rule applies the
        target's penalties to them)."""
        ...

    def commit(self, tree: TokenTree, path: list[int]) -> None: ...
    def truncate(self, n: int) -> None: ...
    def kv_bytes_per_token(self) -> float: ...
    def close(self) -> None: ...

