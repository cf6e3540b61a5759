"""Several requests' trees verified in one pass: lanes (runtimes/llama_cpp/lanes.py) whose rounds grow trees.

Every lane shares one unified KV cache and owns a block of its seq ids ((MAX_SEQ - 1) // n of them: one per leaf of its
tree, the first holding its committed tokens; the last seq id holds the cells lanes let go of, TreeLanes.remove). Lanes
that decode plainly own one seq id each, and the context has only n + 2: llama.cpp keeps a row of logits for every
sequence a context may have (256 rows of Qwen's 151936-token vocabulary: 155 MB). A
lane's cells are masked from every other lane's tokens, and on the CPU's flash attention a masked cell adds nothing, so
a lane sums over its own cells only, in cell order. That order is position order as long as no lane's new cells land
before its older ones, which the layout of a pass keeps:

    [lane a: pending + root] [lane b: pending + root] ... [lane a: the rest of its tree] [lane b: ...] ...

Only the first part stays after the pass: every tree body lies at the cache's tail and is dropped as a whole, so the
next pass fills from there again (llama.cpp puts a pass's tokens in the lowest free cells, in batch order). The
accepted nodes below a root run again at the front of the lane's next pass (as LlamaTarget's accepted nodes off its
spine do): one streamed read of the weights carries them with the new trees. With the batch-invariant kernels, each
lane's logits are then bit for bit those of its tree verified alone (tests/test_tree_lanes.py, `edge-spec check`'s
"trees of 3 lanes in one pass").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from edge.runtimes.llama_cpp._native import MAX_SEQ, Context
from edge.runtimes.llama_cpp.lanes import GATHER_S, LANE_BATCH, Lanes, LaneTarget, _Ask
from edge.runtimes.llama_cpp.models import PENDING_ROOM

from edge.tree import TokenTree

if TYPE_CHECKING:
    from edge.runtimes.llama_cpp.models import LlamaTarget

TREE_GATHER_S = 0.25  # a tree pass waits this long for the lanes still drafting: their trees then ride the same read


@dataclass(eq=False)
class _TreeAsk(_Ask):
    """A lane's tree: `tokens` (its pending tokens and the root) stay in the cache; `body` (the tree's other nodes,
    parents first, at `body_pos`) is dropped after the pass. `membership[i, j]`: row i (tokens, then body) lies on
    the path to the lane's leaf j."""

    body: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    body_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    membership: np.ndarray = field(default_factory=lambda: np.ones((0, 1), bool))


class TreeLanes(Lanes):
    """`n` lanes that verify trees of up to `max_tree` nodes each, all lanes' trees in one pass; without `trees`, one
    node each (plain decoding: the pass's logits one row a lane)."""

    def __init__(self, target: LlamaTarget, n: int, n_ctx: int, *args, trees: bool = True, **kwargs):
        # seq ids a lane owns: the leaves its tree may have (the last seq id holds the dead cells, and one more a
        # padded pass's rows); plainly, one each, then the padding's and the dead cells'
        if trees and target.split_rows > 1:
            raise ValueError("lanes whose passes split by rows decode plainly: a tree's rows would take both kernels")
        padded = target.min_rows > 1 or target.row_multiple > 1
        self.seqs = (MAX_SEQ - 1 - padded) // n if trees else 1
        self.sequences = MAX_SEQ if trees else n + 2
        self.dead_seq = self.sequences - 1  # the seq holding cells no lane uses any more (remove)
        self.max_tree = self.seqs if trees else 1  # nodes a lane's tree may have (so fewer leaves than its seqs)
        self.lane_rows = self.max_tree + PENDING_ROOM  # a lane's share of a pass: its tree and its pending tokens
        self.dead = 0  # cells lanes let go of, kept in the dead seq (remove) until the next reset
        self.dead_room = n * n_ctx  # cells set aside for them
        super().__init__(target, n, n_ctx, *args, **kwargs)
        self.gather_s = TREE_GATHER_S if trees else GATHER_S

    @property
    def _keeps_threads(self) -> bool:
        """Whether the passes keep their worker threads between them (a ggml threadpool, as llama-server's): plain
        lanes over weights in RAM, where nothing else computes beside the passes (a drafter would lose its cores to
        the threads polling for the next pass, a read-ahead its core)."""
        return self.max_tree == 1 and self._before_pass is None

    def room_for_dead(self, cells: int) -> bool:
        """Whether lanes may let go of `cells` more cells before a reset (a request starting in a lane lets go of
        at most n_ctx: what the lane held)."""
        return self.dead + cells <= self.dead_room

    def reset(self) -> None:
        """Every lane empty, every cell free (the dead ones too). Only while no lane runs: their targets start over."""
        with self._cond:
            if self._asks:
                raise RuntimeError("the lanes cannot be reset while a pass is asked for")
            self.ctx.seq_rm(-1)
            self.dead = 0
            for target in self._targets.values():
                target.n_past, target._pending = 0, []

    def _context(self, target: LlamaTarget, n: int, n_ctx: int) -> Context:
        """One unified cache: every lane's n_ctx cells, and room for every lane's tree and pending tokens in flight."""
        settings = target.ctx.settings
        rows = n * self.lane_rows + self.pad_room  # (a padded pass's rows past the batch's)
        # a padded pass's rows in a seq no lane owns (below the dead seq), at the cache's tail
        self.pad_seq = n * self.seqs
        return Context(target.model, n * n_ctx + self.dead_room + rows, n_batch=max(LANE_BATCH, rows),
                       kv_type=settings["kv_type"], n_threads=settings["n_threads"], flash_attn=settings["flash_attn"],
                       n_outputs=max(n * self.max_tree, self.min_rows) + self.row_multiple,
                       on_layer=settings["on_layer"],
                       sequences=self.sequences, unified=True, threadpool=self._keeps_threads)

    def target(self, lane: int) -> TreeLaneTarget:
        if lane not in self._targets:
            self._targets[lane] = TreeLaneTarget(self, lane, self._template)
        return self._targets[lane]  # type: ignore[return-value]

    def seq(self, lane: int) -> int:
        """The seq id holding `lane`'s committed tokens (its block's first)."""
        return lane * self.seqs

    def remove(self, lane: int, start: int) -> None:
        """`lane` lets go of its cells from position `start` on. They stay taken, in the dead seq, where every lane's
        attention skips them: freed, they would be holes among the other lanes' cells, and llama.cpp puts a new
        token in the lowest free cell, which would then come before cells its lane wrote earlier."""
        with self._cond:
            seq = self.seq(lane)
            if self.ctx.seq_pos_max(seq) < start:
                return
            self.dead += self.ctx.seq_pos_max(seq) + 1 - max(start, self.ctx.seq_pos_min(seq))
            self.ctx.seq_cp(seq, self.dead_seq, start, -1)
            self.ctx.seq_rm(seq, start, -1)

    def verify(self, lane: int, tokens: list[int], start: int, tree: TokenTree) -> np.ndarray:
        """Run `tokens` (the pending ones and the root, at start...) and the rest of `tree` below the root in one of
        the batcher's passes: the tree's logits [len(tree), n_vocab] (a copy), in tree order."""
        leaves = tree.leaves()
        if len(tree) > self.max_tree or len(leaves) > self.seqs:
            raise ValueError(f"a tree of {len(tree)} nodes and {len(leaves)} leaves exceeds a lane's "
                             f"{self.max_tree} nodes and {self.seqs} leaves")
        membership = np.ones((len(tokens) - 1 + len(tree), len(leaves)), bool)
        membership[len(tokens) - 1:] = tree.ancestor_mask()[leaves].T
        root_pos = start + len(tokens) - 1
        ask = _TreeAsk(lane, tokens, start, True, body=tree.tokens[1:].astype(np.int32),
                       body_pos=(root_pos + tree.depth[1:]).astype(np.int32), membership=membership)
        logits = self._submit(ask)
        assert logits is not None
        return logits

    def _fill(self) -> list[tuple[_Ask, int, int]]:
        """Every tree whole (the pending tokens and roots first, the bodies after them), then prompts in the room
        left; a tree that does not fit waits for the next pass. (ask, its rows here, the row of its logits or -1:
        a tree's root's; its body's come after every kept row: _hand_back)."""
        batch, room, taken, trees = self._batch, self._batch.capacity - self.pad_room, [], []
        for ask in self._asks:
            if isinstance(ask, _TreeAsk) and len(ask.tokens) + len(ask.body) <= room:
                trees.append(ask)
                room -= len(ask.tokens) + len(ask.body)
        n = 0
        for ask in trees:  # the part that stays: pending tokens and the root
            rows = len(ask.tokens)
            self._put(n, ask.tokens, np.arange(ask.start, ask.start + rows), ask.lane, ask.membership[:rows])
            batch.output[n: n + rows] = 0
            batch.output[n + rows - 1] = 1
            taken.append((ask, rows, n + rows - 1))
            n += rows
        for ask in sorted((a for a in self._asks if not isinstance(a, _TreeAsk)), key=lambda a: len(a.tokens)):
            if room == 0:
                break
            count = min(room, len(ask.tokens) - ask.done)
            self._put(n, ask.tokens[ask.done: ask.done + count], np.arange(ask.start + ask.done,
                      ask.start + ask.done + count), ask.lane, np.ones((count, 1), bool))
            last = ask.done + count == len(ask.tokens)
            batch.output[n: n + count] = 0
            if last and ask.output:
                batch.output[n + count - 1] = 1
            taken.append((ask, count, n + count - 1 if last and ask.output else -1))
            n, room = n + count, room - count
        for ask in trees:  # the bodies, dropped after the pass
            rows = len(ask.body)
            self._put(n, ask.body, ask.body_pos, ask.lane, ask.membership[len(ask.tokens):])
            batch.output[n: n + rows] = 1
            n += rows
        batch.struct.n_tokens = n
        return taken

    def _put(self, at: int, tokens, positions: np.ndarray, lane: int, membership: np.ndarray) -> None:
        """Rows at..: `tokens` at `positions`, row i in the lane's seqs where membership[i]."""
        batch, rows = self._batch, len(tokens)
        batch.token[at: at + rows] = tokens
        batch.pos[at: at + rows] = positions
        batch.set_seqs(membership, at, self.seq(lane))

    def _decode(self, taken: list[tuple[_Ask, int, int]]) -> None:
        """The pass, each tree's branches seeing its lane's committed cells; after it, every body's cells dropped."""
        trees = [ask for ask, _, _ in taken if isinstance(ask, _TreeAsk)]
        for ask in trees:
            for leaf in range(1, ask.membership.shape[1]):
                self.ctx.seq_cp(self.seq(ask.lane), self.seq(ask.lane) + leaf)
        try:
            self._pass()
        finally:
            for ask in trees:
                base = self.seq(ask.lane)
                for leaf in range(1, ask.membership.shape[1]):
                    self.ctx.seq_rm(base + leaf)
                self.ctx.seq_rm(base, ask.start + len(ask.tokens), -1)

    def _hand_back(self, taken: list[tuple[_Ask, int, int]]) -> None:
        """Each ask's logits (a copy): the pass outputs in batch order, the kept rows' (roots, prompts' last tokens)
        first, then every tree's body, trees in the order of their roots."""
        kept = [ask for ask, _, row in taken if row >= 0]
        bodies = sum(len(ask.body) for ask in kept if isinstance(ask, _TreeAsk))
        logits = self.ctx.logits(len(kept) + bodies) if kept else None
        body = len(kept)
        for index, ask in enumerate(kept):
            assert logits is not None
            if isinstance(ask, _TreeAsk):
                ask.logits = np.concatenate([logits[index: index + 1], logits[body: body + len(ask.body)]])
                body += len(ask.body)
            else:
                ask.logits = logits[index].copy()
        for ask, count, _ in taken:
            ask.done += count


class TreeLaneTarget(LaneTarget):
    """One lane as a Target for a speculative decoder: the KV cache holds the committed tokens but the pending ones
    (the last round's accepted nodes below its root) and the newest, which run at the front of the next pass."""

    def __init__(self, lanes: TreeLanes, lane: int, template: LlamaTarget):
        super().__init__(lanes, lane, template)
        self._pending: list[int] = []

    @property
    def max_tree(self) -> int:  # type: ignore[override]
        """The largest tree the next pass holds beside the pending tokens (a prompt waiting for its first tree)."""
        lanes = self.tree_lanes
        return max(1, min(lanes.max_tree, lanes.lane_rows - len(self._pending)))

    @property
    def tree_lanes(self) -> TreeLanes:
        return self.lanes  # type: ignore[return-value]

    def prefill(self, tokens) -> None:
        """Tokens the cache is to hold. As many as a pass has room for beside the lane's tree wait, pending, for the
        next round's pass: a prompt then rides in the pass that verifies its first tree (one streamed read of the
        weights fewer before the first token), read in the same cells as a pass of its own would."""
        tokens = [*self._pending, *tokens]
        if len(tokens) < self.tree_lanes.lane_rows:
            self._pending = tokens
            return
        self._pending = []
        super().prefill(tokens)

    @property
    def deferred(self) -> int:
        return len(self._pending)

    def verify(self, tree: TokenTree) -> np.ndarray:
        if len(self._pending) + len(tree) > self.tree_lanes.lane_rows:
            pending, self._pending = self._pending, []
            super().prefill(pending)  # a pass of their own first
        tokens = [*self._pending, int(tree.tokens[0])]
        logits = self.tree_lanes.verify(self.lane, tokens, self.n_past, tree)
        self.n_past += len(self._pending)
        self._pending = []
        self.passes += 1
        return logits

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        self.n_past += 1  # the root's cell, kept by its pass
        self._pending = tree.path_tokens(path[1:])

    def truncate(self, n: int) -> None:
        self._pending = self._pending[: max(0, n - self.n_past)]
        self.lanes.remove(self.lane, n)  # a verified root's cell too, where no commit followed
        self.n_past = min(self.n_past, n)

    def resize(self, size: int) -> bool:
        return size <= self.tree_lanes.max_tree
