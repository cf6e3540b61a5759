"""The Drafter and Target protocols on an ONNX decoder graph with the QuantSpec KV cache.

A model's committed tokens live in a `QuantSpecKV` (4-bit codes plus an FP16 window); this round's tree nodes
live in FP16 "tree slots" of the model's own, in the order they ran. One graph run takes any tree-shaped batch:
the mask says which committed tokens, slots and new tokens each new token sees. Commit appends the accepted
path's slots to the committed cache; the rest of the round is forgotten by resetting the slot count.

In QuantSpec mode a target and a drafter share one hierarchical cache: the target writes it (its own K/V for
every committed token), the drafter reads its upper nibbles and keeps only its tree slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from edge.quant.kv import QuantSpecKV
from edge.runtimes.onnx.arch import Arch
from edge.runtimes.onnx.session import Session

from edge.grow import MAX_BUDGET
from edge.protocols import ModelDefaults
from edge.tree import TokenTree

CATCH_UP = 64  # more pending tokens than this run as a prefill before the root pass

PREFILL_CHUNK = 256
MAX_TREE = 256  # the target's nodes per verify pass, and the tree slots a model starts with
# A drafter runs up to this many nodes a round (trees past 255 nodes run more than 256); slots grow as they fill.
MAX_EXPAND = MAX_BUDGET
# A trimmed head also scores up to this many of the context's tokens outside its vocabulary (the newest ones):
# each costs one gathered row and one column of the head per pass.
MAX_EXTRA = 512


class _OnnxModel(ModelDefaults):
    runtime = "onnx"

    def __init__(self, session: Session, arch: Arch, kv: QuantSpecKV, path: Path, shared: bool):
        self.session, self.arch, self.kv, self.path, self.shared = session, arch, kv, path, shared
        self.vocab = arch.n_vocab  # the head's rows: fewer once trim_head keeps the frequent tokens only
        shape = (MAX_TREE, arch.n_layers, arch.n_kv_heads, arch.head_dim)
        self.tree_k = np.zeros(shape, np.float16)  # this round's nodes, in run order
        self.tree_v = np.zeros(shape, np.float16)
        self.tree_pos = np.zeros(shape[0], np.int64)
        self.tree_token = np.zeros(shape[0], np.int64)  # slot -> its token, and the slot of its parent (-1: root)
        self.tree_parent = np.full(shape[0], -1, np.int64)
        self.n_tree = 0
        self.history: list[int] = []  # the tokens in self.kv (the writer's view; unused by a shared reader)
        self.passes = 0
        self.in_head: np.ndarray | None = None  # bool [n_vocab]: a trimmed head's rows (None: the full head)
        self.extra: dict[int, None] = {}  # the context's tokens outside those rows, oldest first

    def trim_head(self, head_ids: np.ndarray, n_vocab: int) -> None:
        """The graph's head keeps only `head_ids`; the context's other tokens are scored beside them (extra_ids)."""
        self.in_head = np.zeros(n_vocab, bool)
        self.in_head[head_ids] = True
        self.vocab = len(head_ids)
        self._pad = np.asarray(head_ids[:1], np.int64)  # E >= 1: a padding column, masked out

    def _note(self, tokens: np.ndarray) -> None:
        """Remembers the tokens the trimmed head lacks, the newest MAX_EXTRA of them."""
        for token in tokens[~self.in_head[tokens]].tolist():
            self.extra.pop(token, None)
            self.extra[token] = None
        while len(self.extra) > MAX_EXTRA:
            del self.extra[next(iter(self.extra))]

    def _extra_feeds(self) -> dict[str, np.ndarray]:
        if not self.extra:
            return {"extra_ids": self._pad, "extra_mask": np.full(1, -np.inf, np.float32)}
        return {"extra_ids": np.fromiter(self.extra, np.int64, len(self.extra)),
                "extra_mask": np.zeros(len(self.extra), np.float32)}

    @property
    def n_past(self) -> int:
        return self.kv.n_tokens

    def kv_bytes_per_token(self) -> float:
        """Bytes one committed token takes in the KV cache (keys + values, all layers): QuantSpec codes plus one
        float16 scale and min per group."""
        kv = self.kv
        elements = kv.n_layers * kv.n_kv_heads * kv.head_dim
        return elements * (2 * kv.bits + 32 / kv.group + 32 / kv.value_group) / 8

    def close(self) -> None:
        """Frees the onnxruntime session and the tree slots (the KV cache goes with the last model holding it)."""
        self.session = None
        self.tree_k = self.tree_v = np.zeros(0, np.float16)

    def _run(self, tokens: np.ndarray, positions: np.ndarray, sees_slots: np.ndarray, sees_new: np.ndarray,
             rows: np.ndarray, top_k: int = 0, quantized: np.ndarray | None = None,
             slot_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """tokens, positions: [n]; sees_slots: [n, S] bool; sees_new: [n, n] bool; rows: [m] outputs.

        slot_ids [S]: the tree slots the run reads, in slot order (default: all n_tree of them).
        quantized [n]: per new token, how many committed tokens it reads quantized (default: as they are now);
        more than now means the window's oldest groups are quantized ahead for those tokens (views_through).
        """
        if len(tokens) == 1:
            # A lone query takes other matmul kernels (a GEMV path) whose sums round differently; a copy of it
            # as a second row keeps one token's results bit-identical to the same token inside a batch.
            out = self._run(np.repeat(tokens, 2), np.repeat(positions, 2), np.repeat(sees_slots, 2, axis=0),
                            np.eye(2, dtype=bool), rows, top_k, None if quantized is None else np.repeat(quantized, 2),
                            slot_ids)
            out["k_new"], out["v_new"] = out["k_new"][:1], out["v_new"][:1]
            return out
        n, kv = len(tokens), self.kv
        read = slice(0, self.n_tree) if slot_ids is None else slot_ids  # a slice passes views, ids gather copies
        tree_k, tree_v, tree_pos = self.tree_k[read], self.tree_v[read], self.tree_pos[read]
        slots = len(tree_pos)
        through = kv.n_quant if quantized is None else int(quantized.max())
        committed = through + kv.n_window  # columns: quantized part (maybe ahead), then the whole window
        committed_pos = np.concatenate([np.arange(through), kv.n_quant + np.arange(kv.n_window)])  # per column
        visible = np.ones((n, committed + slots + n), bool)
        if through > kv.n_quant:  # a token reads each group either quantized or from the window, never both
            visible[:, :through] = committed_pos[None, :through] < quantized[:, None]
            visible[:, through:committed] = committed_pos[None, through:] >= quantized[:, None]
        visible[:, committed : committed + slots] = sees_slots
        visible[:, committed + slots :] = sees_new
        mask = np.where(visible, np.float32(0), np.float32(-np.inf))
        feeds = {
            "input_ids": tokens.astype(np.int64, copy=False),
            "positions": positions.astype(np.int64, copy=False),
            "mask": mask,
            "output_rows": rows.astype(np.int64, copy=False),
            "top_k": np.array([top_k], np.int64),
            "k_tree": tree_k,
            "v_tree": tree_v,
            **(kv.views() if through == kv.n_quant else kv.views_through(through)),
        }
        if self.in_head is not None:
            self._note(feeds["input_ids"])
            feeds.update(self._extra_feeds())
        if self.arch.has_swa:
            key_pos = np.concatenate([committed_pos, tree_pos, positions])
            far = positions[:, None] - key_pos[None, :] >= self.arch.swa_window
            feeds["mask_swa"] = np.where(far, np.float32(-np.inf), mask)
        out = self.session.run(feeds)
        self.passes += 1
        return out

    def _add_slots(self, out: dict[str, np.ndarray], tokens: np.ndarray, positions: np.ndarray,
                   parent_slots: np.ndarray) -> np.ndarray:
        """Keeps the run's new K/V as tree slots; returns their slot numbers."""
        n = len(positions)
        if self.n_tree + n > len(self.tree_pos):
            self._more_slots(self.n_tree + n)
        slots = np.arange(self.n_tree, self.n_tree + n)
        self.tree_k[slots], self.tree_v[slots] = out["k_new"], out["v_new"]
        self.tree_pos[slots], self.tree_token[slots], self.tree_parent[slots] = positions, tokens, parent_slots
        self.n_tree += n
        return slots

    def _more_slots(self, needed: int) -> None:
        """At least `needed` tree slots, the ones in use kept (doubling: a large tree's round copies them log-few
        times)."""
        size = max(needed, 2 * len(self.tree_pos))
        for name, fill in (("tree_k", 0), ("tree_v", 0), ("tree_pos", 0), ("tree_token", 0), ("tree_parent", -1)):
            old = getattr(self, name)
            new = np.full((size, *old.shape[1:]), fill, old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def _write(self, tokens: Sequence[int]) -> None:
        """Runs committed tokens straight into the cache, a chunk per pass."""
        tokens = list(tokens)
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = np.asarray(tokens[start : start + PREFILL_CHUNK], np.int64)
            n = len(chunk)
            positions = self.kv.n_tokens + np.arange(n)
            out = self._run(chunk, positions, np.zeros((n, 0), bool), np.tri(n, dtype=bool), np.array([n - 1]),
                            top_k=1)
            self.kv.append(out["k_new"], out["v_new"])
            self.history += chunk.tolist()

    def _truncate_kv(self, n: int) -> None:
        """Keeps the first n committed tokens; a cut inside the quantized part re-runs from the group start."""
        kept = self.kv.truncate(min(n, self.kv.n_tokens))
        tail = self.history[kept:n]
        del self.history[kept:]
        self._write(tail)


class OnnxDrafter(_OnnxModel):
    """The Drafter protocol. `node_slot[node]` is the tree slot a node ran in (-1: not run); a root pass also runs
    pending tokens."""

    def __init__(self, session: Session, arch: Arch, kv: QuantSpecKV, path: Path, shared: bool = False):
        super().__init__(session, arch, kv, path, shared)
        self.expand_capacity = MAX_EXPAND
        self.node_slot = np.full(1024, -1, np.int64)  # grows with the grow-time node ids
        self.pending: list[int] = []  # committed tokens not yet run (a path's unexpanded tail)
        self.base = 0  # the root's position

    def fork(self) -> OnnxDrafter | None:
        """Another drafter over the same session (onnxruntime runs one session from several threads), with a KV
        cache and tree slots of its own: a lane's (runtimes/llama_cpp/tree_lanes.py). None for one that reads its
        QuantSpec target's cache."""
        if self.shared:
            return None
        kv = self.kv
        forked = OnnxDrafter(self.session, self.arch, QuantSpecKV(kv.n_layers, kv.n_kv_heads, kv.head_dim, kv.capacity,
                                                                  bits=kv.bits, group=kv.group,
                                                                  value_group=kv.value_group), self.path)
        if self.in_head is not None:
            forked.in_head, forked.vocab, forked._pad = self.in_head, self.vocab, self._pad
        return forked

    def prefill(self, tokens: Sequence[int]) -> None:
        if not self.shared:  # a shared cache is the target's to fill
            self._write([*self.pending, *tokens])
            self.pending = []

    def truncate(self, n: int) -> None:
        self._reset_tree()
        if self.shared:
            return
        held = self.kv.n_tokens
        if n >= held:
            del self.pending[n - held :]
        else:
            self.pending = []
            self._truncate_kv(n)
        if self.in_head is not None:  # the context's rare tokens are those of what is left
            self.extra = {}
            self._note(np.asarray([*self.history, *self.pending], np.int64))

    def resize(self, size: int) -> bool:
        """Its tree slots grow as they fill: any size up to MAX_EXPAND expansions a round fits already."""
        return size <= self.expand_capacity

    def expand(self, tree: TokenTree, nodes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.expand_logits(tree, nodes, k)[:2]

    def expand_logits(self, tree: TokenTree, nodes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.n_tree + len(nodes) > self.expand_capacity + 1:  # +1: the root's slot
            raise ValueError("drafter asked to expand more nodes in one round than it has tree slots")
        out = self._run_root(int(tree.tokens[0]), k) if nodes[0] == 0 else self._run_nodes(tree, nodes, k)
        return out["top_ids"].astype(np.int32), out["top_log_probs"], out["top_logits"]

    def _run_root(self, root: int, k: int) -> dict[str, np.ndarray]:
        """Pending tokens and the root in one pass; the pending ones join the committed cache."""
        if self.shared and self.pending:
            raise RuntimeError("a shared-cache drafter cannot hold pending tokens")
        if len(self.pending) > CATCH_UP:  # after a long plain stretch (--budget auto): in chunks first
            self.prefill([])
        tokens = np.asarray([*self.pending, root], np.int64)
        n = len(tokens)
        positions = self.kv.n_tokens + np.arange(n)
        out = self._run(tokens, positions, np.zeros((n, 0), bool), np.tri(n, dtype=bool), np.array([n - 1]), k)
        if n > 1:
            self.kv.append(out["k_new"][:-1], out["v_new"][:-1])
            self.history += self.pending
            self.pending = []
        self.base = int(positions[-1])
        self._reset_tree()
        slot = self._add_slots({"k_new": out["k_new"][-1:], "v_new": out["v_new"][-1:]}, tokens[-1:],
                               positions[-1:], np.array([-1]))
        self.node_slot[0] = slot[0]
        return out

    def _run_nodes(self, tree: TokenTree, nodes: np.ndarray, k: int) -> dict[str, np.ndarray]:
        """Runs `nodes` against their ancestors' slots alone. Other slots would be masked out, but fused
        attention's sums round differently with more keys (by ~1e-7, which int8 activations amplify to ~0.1 nats):
        a node would draft otherwise than the same token in a chain, so a one-node pass here reads exactly the keys a
        chain's pass at that node reads, and a tree's top path is the chain's token for token (docs/performance.md)."""
        n = len(nodes)
        if len(tree) > len(self.node_slot):
            self.node_slot = np.concatenate([self.node_slot, np.full(len(tree), -1, np.int64)])
        sees_slots = np.zeros((n, self.n_tree), bool)
        ancestors = tree.parents[nodes]
        while (ancestors >= 0).any():  # up to the root: every ancestor of a node being run has a slot already
            rows = np.flatnonzero(ancestors >= 0)
            sees_slots[rows, self.node_slot[ancestors[rows]]] = True
            ancestors[rows] = tree.parents[ancestors[rows]]
        read = np.flatnonzero(sees_slots.any(axis=0))
        positions = self.base + tree.depth[nodes].astype(np.int64)
        out = self._run(tree.tokens[nodes], positions, sees_slots[:, read], np.eye(n, dtype=bool), np.arange(n), k,
                        slot_ids=None if len(read) == self.n_tree else read)  # a chain reads every slot: no copy
        parent_slots = self.node_slot[tree.parents[nodes]]
        self.node_slot[nodes] = self._add_slots(out, tree.tokens[nodes], positions, parent_slots)
        return out

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        tokens = tree.path_tokens(path)
        if self.n_tree == 0:  # this round ran without the drafter: catch up at the next root
            if not self.shared:
                self.pending += tokens
            self._reset_tree()
            return
        if not self.shared:
            slots = self._path_slots(tokens)  # grow renumbers the tree it returns: follow tokens, not node ids
            self.kv.append(self.tree_k[slots], self.tree_v[slots])
            self.history += tokens[: len(slots)]
            self.pending = tokens[len(slots) :]
        self._reset_tree()

    def _path_slots(self, tokens: list[int]) -> list[int]:
        """The slots along `tokens` from the root slot, as far as the drafter ran them."""
        slots = [0]
        parents, carried = self.tree_parent[: self.n_tree], self.tree_token[: self.n_tree]
        for token in tokens[1:]:
            hits = np.flatnonzero((parents == slots[-1]) & (carried == token))
            if len(hits) == 0:
                break
            slots.append(int(hits[0]))
        return slots

    def _reset_tree(self) -> None:
        self.node_slot[:] = -1
        self.n_tree = 0


class OnnxTarget(_OnnxModel):
    """The Target protocol on the QuantSpec target graph (int8 weights, full head, full KV reader).

    verify runs the whole tree in one pass and keeps every node's K/V as a tree slot; commit moves the
    accepted path's slots into the shared cache, so a committed token's K/V is the target's own.
    """

    def __init__(self, session: Session, arch: Arch, kv: QuantSpecKV, tokenizer, n_ctx: int, path: Path):
        super().__init__(session, arch, kv, path, shared=False)
        self.tokenizer = tokenizer  # the file's vocabulary (runtimes.llama_cpp.tokenizer)
        self.special = tokenizer.special()
        self.n_vocab = arch.n_vocab
        self.n_ctx = n_ctx
        self.max_tree = MAX_TREE

    def prefill(self, tokens: Sequence[int]) -> None:
        self._write(tokens)

    def truncate(self, n: int) -> None:
        self.n_tree = 0
        self._truncate_kv(n)

    def verify(self, tree: TokenTree) -> np.ndarray:
        n = len(tree)
        if n > self.max_tree:
            raise ValueError(f"tree of {n} nodes exceeds the target's {self.max_tree}")
        self.n_tree = 0
        positions = self.kv.n_tokens + tree.depth.astype(np.int64)
        # A node reads the cache as plain decoding would at its position: groups that one-token-at-a-time
        # commits would have quantized by then are read quantized, even though this pass commits nothing.
        quantized = self.kv.quantized_after(positions)
        if quantized.max() > self.kv.n_quant + self.kv.n_window - self.kv.n_window % self.kv.group:
            raise ValueError(f"tree of depth {tree.depth.max()} reaches past the cache's quantization window; "
                             f"keep trees shallower than {self.kv.group} tokens")
        out = self._run(tree.tokens, positions, np.zeros((n, 0), bool), tree.ancestor_mask(), np.arange(n),
                        quantized=quantized)
        self._add_slots(out, tree.tokens, positions, tree.parents)
        return out["logits"]

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        self.kv.append(self.tree_k[path], self.tree_v[path])
        self.history += tree.path_tokens(path)
        self.n_tree = 0
