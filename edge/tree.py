"""The token tree a drafter grows and a target verifies in one pass.

Node 0 is the root: the newest committed token, which neither model has run yet. Its row of the target's
logits gives the first new token, so the first round and every later round are the same code. A node's
position in the sequence is (tokens already in the KV cache) + depth. Parents always come before their
children, so a single pass in index order visits ancestors first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DRAFTED = 1  # a node's source bits: the drafter proposed it
LOOKED_UP = 2  # lookup proposed it


@dataclass
class TokenTree:
    tokens: np.ndarray  # [n] int32
    parents: np.ndarray  # [n] int32, -1 for the root
    depth: np.ndarray  # [n] int32, 0 for the root
    score: np.ndarray  # [n] float32, growth's ranking: cumulative log chance of acceptance, 0 for the root
    draft: np.ndarray | None = None  # [n] float32, the drafter's own log-prob of each node given its parent
    rank: np.ndarray | None = None  # [n] int32, each node's place in its parent's top-k (0: the drafter's top token)
    source: np.ndarray | None = None  # [n] uint8: who proposed each node, DRAFTED | LOOKED_UP (edge/lookup.py)

    @classmethod
    def root(cls, token: int) -> TokenTree:
        return cls(np.array([token], np.int32), np.array([-1], np.int32), np.zeros(1, np.int32),
                   np.zeros(1, np.float32))

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestor_mask(self) -> np.ndarray:
        """[n, n] bool: mask[i, j] is True when j is i or an ancestor of i (the tree attention mask)."""
        n = len(self)
        mask = np.eye(n, dtype=bool)
        for d in range(1, int(self.depth.max(initial=0)) + 1):
            level = np.flatnonzero(self.depth == d)
            mask[level] |= mask[self.parents[level]]
        return mask

    def leaves(self) -> np.ndarray:
        has_child = np.zeros(len(self), dtype=bool)
        has_child[self.parents[self.parents >= 0]] = True
        return np.flatnonzero(~has_child)

    def child(self, node: int, token: int) -> int | None:
        """The child of `node` carrying `token`, if the tree has one (children have distinct tokens)."""
        hits = np.flatnonzero((self.parents == node) & (self.tokens == token))
        return int(hits[0]) if len(hits) else None

    def path_tokens(self, path: list[int]) -> list[int]:
        return [int(t) for t in self.tokens[path]]

    def is_chain(self) -> bool:
        return int(self.depth.max(initial=0)) == len(self) - 1

    def spine(self) -> TokenTree:
        """The root and the likeliest path from it: at each node its best-scored child (the lowest id among equals),
        down to a leaf. The nodes a target verifying trees in one pass puts first, in the cells plain decoding gives
        them (runtimes/llama_cpp/models.py spine_first)."""
        kids = np.arange(1, len(self))
        kids = kids[np.lexsort((kids, -self.score[1:], self.parents[1:]))]  # grouped by parent, best first
        best = np.full(len(self), -1, np.int64)
        parents, first = np.unique(self.parents[kids], return_index=True)
        best[parents] = kids[first]  # each parent's best child
        keep = np.zeros(len(self), bool)
        node = 0
        while node >= 0:
            keep[node] = True
            node = int(best[node])
        return self.subset(keep)

    def subset(self, keep: np.ndarray) -> TokenTree:
        """The nodes where `keep` is True (a connected set containing the root), renumbered in order."""
        new_index = np.cumsum(keep) - 1
        parents = self.parents[keep]
        parents = np.where(parents >= 0, new_index[np.maximum(parents, 0)], -1).astype(np.int32)
        draft = None if self.draft is None else self.draft[keep]
        rank = None if self.rank is None else self.rank[keep]
        source = None if self.source is None else self.source[keep]
        return TokenTree(self.tokens[keep], parents, self.depth[keep], self.score[keep], draft, rank, source)
