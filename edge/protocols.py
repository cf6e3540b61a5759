"""The seams between the engine and whatever runs a model: everything the library calls on a model is here.

Both models keep a KV cache. Between rounds each holds exactly the committed tokens except the newest one, which is
the next tree's root. `commit` makes the accepted path committed and forgets every other branch; how is the runtime's
own business (llama.cpp keeps only the root's cell and runs the path again at the front of the next pass, so that
cells stay in position order).

A runtime's models subclass ModelDefaults for what most need not do themselves (no read-ahead, a fixed size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from edge.tree import TokenTree


@dataclass(frozen=True)
class SpecialTokens:
    """A vocabulary's special tokens, read from the model file (-1: the file has none)."""

    bos: int = -1
    eos: int = -1
    eot: int = -1  # end of turn
    stop: frozenset[int] = frozenset()  # end-of-generation tokens: a reply ends at one
    ids: frozenset[int] = frozenset()  # every control token (kept in a trimmed drafter head, never split by text)
    bos_text: str = ""  # how a chat template writes BOS and EOS
    eos_text: str = ""


class Tokenizer(Protocol):
    n_vocab: int

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...
    def ranked_tokens(self) -> np.ndarray: ...  # int64 ids of the ordinary tokens, most frequent first


class Streamer(Protocol):
    """Reads a target's weights from its file ahead of a pass (offload/ssd.py), for a target streamed from a drive."""

    readahead: bool
    window: int | None  # bytes the read-ahead may hold past the pass's last layer (None: the whole file)

    def prefetch(self) -> None: ...  # start reading the next pass's weights in the background
    def read_ahead_now(self) -> None: ...  # drop them from RAM, then read all of them before returning
    def time_read_ahead(self) -> float: ...  # seconds to read them all from the drive, measured now


class ModelDefaults:
    """What a model that does not stream its weights and cannot change its size answers."""

    streamer: Streamer | None = None
    deferred: int = 0  # prompt tokens its next pass runs before the tree (a plain target runs a prompt with it)

    def prefetch(self) -> None:
        """Start reading the next pass's weights (a target streamed from a drive); nothing to do otherwise."""

    def resize(self, size: int) -> bool:
        """Room for trees of `size` nodes (a target) or `size` expansions a round (a drafter), its caches emptied;
        False where the size is fixed."""
        return False

    def follow_layers(self, listener: Callable[[int], None], active: Callable[[], bool] | None = None) -> bool:
        """Have listener(i) called as each layer of a pass is computed, in the passes where active() says so (None:
        every pass); False where the runtime cannot say."""
        return False

    def fork(self) -> Drafter | None:
        """(A drafter) another drafter over the same weights with a KV cache of its own, for one of several requests
        drafting at once (runtimes/llama_cpp/tree_lanes.py); None where the runtime cannot."""
        return None


class Target(Protocol):
    runtime: str  # the runtime it runs on (runtimes/)
    path: Path  # its model file
    n_vocab: int
    n_ctx: int
    n_past: int  # tokens in the KV cache
    passes: int  # forward passes run so far
    max_tree: int  # the most nodes one verify pass accepts
    tokenizer: Tokenizer
    special: SpecialTokens
    streamer: Streamer | None  # set where the weights stream from a drive

    def prefill(self, tokens: Sequence[int]) -> None: ...
    def verify(self, tree: TokenTree) -> np.ndarray: ...  # [n_nodes, n_vocab] float32, ONE pass; valid until the next
    def commit(self, tree: TokenTree, path: list[int]) -> None: ...
    def truncate(self, n: int) -> None: ...  # keep the first n tokens of the KV cache
    def prefetch(self) -> None: ...  # a round starts growing its tree: a streamed target reads ahead
    def resize(self, size: int) -> bool: ...  # verify trees of `size` nodes from now on (caches emptied)
    # listener(i) as a pass computes layer i, in passes where active() (None: all); False: the runtime cannot say
    def follow_layers(self, listener: Callable[[int], None], active: Callable[[], bool] | None = None) -> bool: ...
    def close(self) -> None: ...  # free native memory; the model is unusable afterwards


class Drafter(Protocol):
    runtime: str
    path: Path
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
    def resize(self, size: int) -> bool: ...  # room for `size` expansions a round (caches emptied)
    def kv_bytes_per_token(self) -> float: ...
    def fork(self) -> Drafter | None: ...  # the same weights, a KV cache of its own (a server lane's); None: cannot
    def close(self) -> None: ...


def verifies_chains_only(target: Target) -> bool:
    """Whether `target` verifies only a tree's likeliest path (TokenTree.spine): a GPU backend whose attention rounds
    a node by the cells it lies in (runtimes/llama_cpp/kernels.py CHAIN_BACKENDS). Optional in the protocol: False."""
    return bool(getattr(target, "chains_only", False))


class TargetWrapper:
    """A Target around another, forwarding every member of the protocol: a subclass overrides what it changes (a
    streamed target's passes, a scoring target's logits)."""

    def __init__(self, inner: Target):
        self.inner = inner
        self.runtime, self.path, self.n_vocab = inner.runtime, inner.path, inner.n_vocab
        self.tokenizer, self.special = inner.tokenizer, inner.special

    @property
    def streamer(self) -> Streamer | None:
        return self.inner.streamer

    @property
    def n_ctx(self) -> int:
        return self.inner.n_ctx

    @property
    def n_past(self) -> int:
        return self.inner.n_past

    @property
    def passes(self) -> int:
        return self.inner.passes

    @property
    def max_tree(self) -> int:
        return self.inner.max_tree

    @property
    def deferred(self) -> int:
        return getattr(self.inner, "deferred", 0)

    @property
    def chains_only(self) -> bool:
        return verifies_chains_only(self.inner)

    def prefill(self, tokens: Sequence[int]) -> None:
        self.inner.prefill(tokens)

    def verify(self, tree: TokenTree) -> np.ndarray:
        return self.inner.verify(tree)

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        self.inner.commit(tree, path)

    def truncate(self, n: int) -> None:
        self.inner.truncate(n)

    def prefetch(self) -> None:
        self.inner.prefetch()

    def resize(self, size: int) -> bool:
        return self.inner.resize(size)

    def follow_layers(self, listener: Callable[[int], None], active: Callable[[], bool] | None = None) -> bool:
        return self.inner.follow_layers(listener, active)

    def close(self) -> None:
        self.inner.close()
