"""Target and Drafter on llama.cpp: one tree = one llama_decode, the KV cache trimmed by seq ids.

Seq 0 always holds the committed tokens. During a round, other seq ids name branches: for the target one
per leaf (a node belongs to every leaf below it, so the seq-id mask IS the tree attention mask); for the
drafter one per branch of the nodes it ran (a node's seq holds its whole path: its parent's seq extended, or
the parent's path copied into a new seq where a sibling extends it already). So both bound a tree's leaves by
llama.cpp's 256 sequences, not its nodes: those are bounded by the batch and the KV cells sized for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
from edge.offload.pass_pages import PassPages
from edge.runtimes.llama_cpp._native import MAX_SEQ, Batch, Context, Model

from edge.protocols import ModelDefaults
from edge.tree import TokenTree

PAD_SEQ = MAX_SEQ - 1  # a pass padded to min_rows carries its throwaway rows here (a tree that needs it has < 9 leaves)

PENDING_ROOM = 64  # a target's batch also carries the previous round's accepted tokens (see LlamaTarget)


class _Runner(ModelDefaults):
    """A model + context with a linear committed history in seq 0.

    `_pending` holds committed tokens not run yet; they join the next pass (prefill, tree or root).
    """

    runtime = "llama_cpp"

    def __init__(self, model: Model, ctx: Context):
        self.model = model
        self.ctx = ctx
        self.path = model.path
        self.tokenizer = model
        self.special = model.special()
        self.n_vocab = model.n_vocab
        self.n_ctx = ctx.n_ctx
        self.n_past = 0
        self.passes = 0
        self.batch = Batch(ctx.n_batch)
        self._pending: list[int] = []

    def prefill(self, tokens: Sequence[int]) -> None:
        tokens = [*self._pending, *tokens]
        self._pending = []
        for start in range(0, len(tokens), self.batch.capacity):
            chunk = tokens[start : start + self.batch.capacity]
            self.batch.fill(chunk, self.n_past)
            self._decode()
            self.n_past += len(chunk)

    def truncate(self, n: int) -> None:
        self._pending = self._pending[: max(0, n - self.n_past)]
        self._drop_branches()
        self.ctx.seq_rm(0, n, -1)
        self.n_past = min(self.n_past, n)

    def _drop_branches(self) -> None:
        for seq in range(1, MAX_SEQ):
            self.ctx.seq_rm(seq)

    min_rows = 1  # a target on a GPU backend whose kernels change below it pads every pass to this many rows

    def _decode(self) -> None:
        padded = self.batch.struct.n_tokens < self.min_rows
        if padded:  # throwaway rows in a sequence of their own, dropped after the pass (kernels.MIN_ROWS)
            self.batch.pad(self.min_rows, PAD_SEQ)
        self.ctx.decode(self.batch)
        if padded:
            self.ctx.seq_rm(PAD_SEQ)
        self.passes += 1

    owns_model = True  # closing it frees the weights too (a fork shares another's: LlamaDrafter.fork)

    def close(self) -> None:
        """Frees the context (its KV cache) and the model's weights; the object is unusable afterwards."""
        self.ctx.close()
        if self.owns_model:
            self.model.close()


class LayerListener:
    """What a context's layer callback calls (edge.runtimes.llama_cpp.ggml_calls.layer_callback): the listener set
    since, if any. The callback is fixed when the context is made; the listener (a streamer) comes later. An error
    in it must not reach ggml (ctypes would print it and stop the pass): it is kept and raised after the pass."""

    def __init__(self) -> None:
        self.listener: Callable[[int], None] | None = None
        self.following: Callable[[], bool] = _never  # whether the pass about to run is followed
        self.error: BaseException | None = None

    def active(self) -> bool:
        return self.listener is not None and self.following()

    def __call__(self, layer: int) -> None:
        if self.listener is not None and self.error is None:
            try:
                self.listener(layer)
            except BaseException as problem:  # raised again after the pass (LlamaTarget._decode)
                self.error = problem


class LlamaTarget(_Runner):
    """Verifies a whole tree in one llama_decode.

    Committed cells must stay in position order: attention sums over cells in cell order, so a cell
    reused out of order changes the rounding and breaks bit-exactness with plain decoding. So a pass
    never leaves holes. The tree runs spine first (spine_first: the likeliest path, root to leaf, at the front of
    the batch, in its own cells in order); accepted nodes that lie on that spine keep their cells, as a plain
    decoder would have written them; the rest of the accepted path (`pending`) runs again at the front of the next
    tree's batch (nearly free when the pass is bound by streaming weights, not when it is bound by compute: a
    target in RAM on a CPU), and after the pass everything past the kept cells is dropped from the tail of the
    cache.
    """

    def __init__(self, model: Model, ctx: Context, max_tree: int, layers: LayerListener | None = None,
                 min_rows: int = 1, row_multiple: int = 1, chains_only: bool = False):
        super().__init__(model, ctx)
        self.chains_only = chains_only  # it verifies a tree's likeliest path alone (kernels.CHAIN_BACKENDS)
        # a pass's padding takes cells for its duration: the context holds min_rows - 1 cells past n_ctx
        self.min_rows, self.n_ctx = min_rows, ctx.n_ctx - (min_rows - 1)
        self.row_multiple = row_multiple
        self.split_rows = 1  # plain lanes over it split their passes by rows (RunOptions.split_rows)
        self.max_tree = min(max_tree, ctx.n_batch)
        self._layers = layers  # its context's passes call it as each layer is computed (RunOptions.layer_progress)
        self._n_leaves = 0
        self._place = np.zeros(1, np.int64)  # the last tree's node -> its place in the batch (spine_first)

    def resize(self, size: int) -> bool:
        """Verify trees of up to `size` nodes from now on: a new context with a batch and logits that large, over the
        same weights (nothing is read again). The KV cache starts empty, as after truncate(0)."""
        if size > self.max_tree:
            self.ctx = self.ctx.resized(n_batch=size + PENDING_ROOM, n_outputs=size)
            self.batch = Batch(self.ctx.n_batch)
            self.max_tree = min(size, self.ctx.n_batch)
            self.n_past, self._pending, self._n_leaves = 0, [], 0
            self._place = np.zeros(1, np.int64)
        return True

    def _decode(self) -> None:
        super()._decode()
        if self._layers is not None and self._layers.error is not None:
            error, self._layers.error = self._layers.error, None
            raise error

    def follow_layers(self, listener: Callable[[int], None], active: Callable[[], bool] | None = None) -> bool:
        if self._layers is None:
            return False
        self._layers.listener, self._layers.following = listener, active or _always
        return True

    def verify(self, tree: TokenTree) -> np.ndarray:
        n, n_pending = len(tree), len(self._pending)
        if n > self.max_tree:
            raise ValueError(f"tree of {n} nodes exceeds the verify batch of {self.max_tree}")
        if n + n_pending > self.batch.capacity:
            self.prefill([])
            n_pending = 0
        order = spine_first(tree)  # batch order: the spine's nodes right after the root
        place = np.empty(n, np.int64)
        place[order] = np.arange(n)
        leaves = tree.leaves()
        if len(leaves) > MAX_SEQ:
            raise ValueError(f"tree has {len(leaves)} leaves; llama.cpp allows {MAX_SEQ} sequences")
        leaves = leaves[np.argsort(place[leaves], kind="stable")]  # seq 0: the spine's leaf (the first in order)
        # membership: [n_pending + n, n_leaves]; a token is in seq j when it lies on the path to leaf j.
        membership = np.ones((n_pending + n, len(leaves)), bool)
        membership[n_pending:] = tree.ancestor_mask()[leaves].T[order]
        for seq in range(1, len(leaves)):
            self.ctx.seq_cp(0, seq)  # the committed prefix is visible to every branch
        positions = np.concatenate([np.arange(self.n_past, self.n_past + n_pending),
                                    self.n_past + n_pending + tree.depth[order]]).astype(np.int32)
        outputs = np.arange(n_pending + n) >= n_pending
        self.batch.fill([*self._pending, *tree.tokens[order].tolist()], positions, outputs=outputs)
        self.batch.set_seqs(membership)
        self._decode()
        self.n_past += n_pending
        self._pending = []
        self._n_leaves = len(leaves)
        self._place = place
        logits = self.ctx.logits(n)
        if not (order[1:] == np.arange(1, n)).all():
            permute_rows(logits, place)
        return logits

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        """Keep the root and the accepted nodes on the spine (their cells follow the committed ones, in order, in seq
        0); the accepted nodes past them run again next pass."""
        kept = 0
        while kept + 1 < len(path) and self._place[path[kept + 1]] == kept + 1:
            kept += 1
        for seq in range(1, self._n_leaves):
            self.ctx.seq_rm(seq)
        self.ctx.seq_rm(0, self.n_past + 1 + kept, -1)
        self.n_past += 1 + kept
        self._pending = tree.path_tokens(path[1 + kept:])


class PlainTarget(LlamaTarget):
    """A target that decodes plainly, one token a pass, never a tree (ModelOptions.stock): it runs a prompt as
    llama.cpp runs it, in batches of n_batch from its start with the last one holding the prompt's last token, not as
    a prefill and then a pass of that token alone. On llama.cpp's own kernels, which differ by batch size, that is what
    gives llama.cpp's text."""

    def prefill(self, tokens: Sequence[int]) -> None:
        self._pending.extend(tokens)  # run with the next token, as llama.cpp runs a prompt

    @property
    def deferred(self) -> int:
        return len(self._pending)

    def resize(self, size: int) -> bool:
        return size <= 1

    one_token_s = 0.0  # the time of its one-token passes (a prompt's excluded), and their count: what the plan's
    one_token_passes = 0  # rate for a target in RAM is fitted to (models.kept.keep_plain_pass)
    pass_pages: PassPages | None = None  # under a memory limit: the pages of its mapping a pass reads, locked

    def _drop_branches(self) -> None:
        pass  # one sequence: no branch to drop

    def verify(self, tree: TokenTree) -> np.ndarray:
        if len(tree) != 1:
            raise ValueError(f"a plain target verifies one token a pass, not a tree of {len(tree)}")
        tokens = [*self._pending, int(tree.tokens[0])]
        self._pending = []
        if self.pass_pages is not None:
            self.pass_pages.before_pass()
        started = time.perf_counter()
        capacity = self.batch.capacity
        for start in range(0, len(tokens), capacity):
            chunk = tokens[start : start + capacity]
            last = start + capacity >= len(tokens)
            outputs = np.arange(len(chunk)) == len(chunk) - 1 if last else False
            self.batch.fill(chunk, self.n_past, outputs=outputs)
            self._decode()
            self.n_past += len(chunk) - (1 if last else 0)  # the token itself is counted as commit keeps it
        if len(tokens) == 1:  # a prompt's pass is not a one-token pass
            self.one_token_s += time.perf_counter() - started
            self.one_token_passes += 1
        if self.pass_pages is not None:
            self.pass_pages.after_pass()
        self._n_leaves = 1
        self._place = np.zeros(1, np.int64)
        return self.ctx.logits(1)


def permute_rows(rows: np.ndarray, place: np.ndarray) -> None:
    """rows[i] = rows[place[i]] for every i, in place (one row of scratch), cycle by cycle: llama.cpp's own logits
    buffer put in tree order. A gathered copy took as much memory again (155 MB for 256 rows of a 152k vocabulary,
    under a memory limit that the weights' pages need) and, made fresh each pass, the page faults of a new array."""
    done = place == np.arange(len(place))
    scratch = np.empty(rows.shape[1], rows.dtype)
    for start in np.flatnonzero(~done):
        if done[start]:
            continue
        scratch[:] = rows[start]
        at = start
        while (source := int(place[at])) != start:
            rows[at] = rows[source]
            done[at] = True
            at = source
        rows[at] = scratch
        done[at] = True


def spine_first(tree: TokenTree) -> np.ndarray:
    """The tree's nodes in depth-first order, each node's children best score first: the root, then the likeliest
    path down to its leaf (the spine), then the rest; parents always come before their children."""
    n = len(tree)
    if n <= 2:
        return np.arange(n)
    kids = np.arange(1, n)
    kids = kids[np.lexsort((kids, -tree.score[1:], tree.parents[1:]))]  # grouped by parent, best first
    by_parent = tree.parents[kids]
    starts = np.searchsorted(by_parent, np.arange(n), "left")
    ends = np.searchsorted(by_parent, np.arange(n), "right")
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(kids[starts[node]:ends[node]][::-1].tolist())
    return np.array(order, np.int64)


class LlamaDrafter(_Runner):
    """Expands tree nodes, one pass per call; each node run has a seq holding its whole path.

    Like the target, it keeps only the root after a round and runs the accepted tokens again in the
    next root pass: the committed cells stay in order, so its drafts match a fresh run of the same text.
    The context holds `expand_capacity` cells past the target's context for the nodes a round runs.
    """

    def __init__(self, model: Model, ctx: Context, kv_type: str, expand_capacity: int = MAX_SEQ - 1):
        super().__init__(model, ctx)
        self.kv_type = kv_type
        self.vocab = model.n_vocab  # llama.cpp always computes the full head
        self.expand_capacity = expand_capacity
        self._base = 0  # position of this round's root
        self._node_seq: dict[int, int] = {}  # tree node -> the seq holding its path
        self._tip: dict[int, int] = {}  # seq -> its deepest node (the seq holds that node's path, nothing more)

    def fork(self) -> LlamaDrafter:
        """Another drafter over the same weights, with a KV cache of its own (a lane's: tree_lanes.py); closing it
        leaves the weights to this one."""
        forked = LlamaDrafter(self.model, Context(self.model, **self.ctx.settings), self.kv_type,
                              self.expand_capacity)
        forked.owns_model = False
        return forked

    def resize(self, size: int) -> bool:
        """Room for `size` nodes a round from now on: a new context over the same weights, with that many more cells
        past the target's context. The KV cache starts empty, as after truncate(0)."""
        if size > self.expand_capacity:
            self.ctx = self.ctx.resized(n_ctx=self.ctx.n_ctx + size - self.expand_capacity)
            self.n_ctx, self.expand_capacity = self.ctx.n_ctx, size
            self.n_past, self._pending = 0, []
            self._node_seq.clear()
            self._tip.clear()
        return True

    def truncate(self, n: int) -> None:
        super().truncate(n)
        self._node_seq.clear()
        self._tip.clear()

    def kv_bytes_per_token(self) -> float:
        """Bytes one committed token takes in the KV cache (keys + values, all layers)."""
        from edge.runtimes.gguf_file import gguf_shape

        shape = gguf_shape(self.model.path)
        bits = {"q4_0": 4.5, "q8_0": 8.5, "f16": 16, "bf16": 16, "f32": 32}[self.kv_type]
        return shape.n_layers * shape.n_kv_heads * shape.head_dim * 2 * bits / 8

    def expand(self, tree: TokenTree, nodes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return top_k_log_probs(self._run(tree, nodes), k)

    def expand_logits(self, tree: TokenTree, nodes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        logits = self._run(tree, nodes)  # [len(nodes), n_vocab]
        ids, log_probs = top_k_log_probs(logits, k)
        return ids, log_probs, np.take_along_axis(logits, ids, axis=1)

    def _run(self, tree: TokenTree, nodes: np.ndarray) -> np.ndarray:
        """One pass over `nodes`; their logits [len(nodes), n_vocab]."""
        if len(self._node_seq) + len(nodes) > self.expand_capacity:
            raise ValueError("drafter asked to expand more nodes in one round than it has seq ids")
        if nodes[0] == 0:
            self._run_root(int(tree.tokens[0]))
        else:
            self._run_nodes(tree, nodes)
        return self.ctx.logits(len(nodes))

    def _run_root(self, root: int) -> None:
        """Pending tokens and the root join seq 0 (committed) and seq 1 (the root's path) in one pass."""
        if len(self._pending) + 1 > self.batch.capacity:  # after a long plain stretch (--budget auto)
            self.prefill([])
        self._node_seq, self._tip = {0: 1}, {1: 0}
        self.ctx.seq_cp(0, 1)
        n = len(self._pending) + 1
        self._base = self.n_past + n - 1
        self.batch.fill([*self._pending, root], self.n_past, outputs=np.arange(n) == n - 1)
        self.batch.set_seqs(np.ones((n, 2), bool))
        self._decode()
        self.n_past += n
        self._pending = []

    def _run_nodes(self, tree: TokenTree, nodes: np.ndarray) -> None:
        """A node extends its parent's seq when the parent is still that seq's tip; otherwise (a sibling ran first)
        the parent's path, the committed cells included, is copied into a new seq. One seq per branch of the nodes
        run: growth keeps those branches within the leaf bound (edge/grow.py), so trees of more nodes than seq ids
        can be grown."""
        seqs = []
        for node, parent in zip(nodes.tolist(), tree.parents[nodes].tolist(), strict=True):
            seq = self._node_seq[parent]
            if self._tip[seq] != parent:
                if len(self._tip) + 1 >= MAX_SEQ:
                    raise ValueError(f"drafter asked to run more than {MAX_SEQ - 1} branches in one round")
                branch = len(self._tip) + 1
                self.ctx.seq_cp(seq, branch, -1, self._base + int(tree.depth[parent]) + 1)  # positions up to parent
                seq = branch
            self._tip[seq] = node
            self._node_seq[node] = seq
            seqs.append(seq)
        self.batch.fill(tree.tokens[nodes], self._base + tree.depth[nodes], outputs=True)
        self.batch.seq_id[: len(nodes), 0] = seqs
        self._decode()

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        tokens = tree.path_tokens(path)
        if not self._node_seq:  # this round ran without the drafter: catch up at the next root
            self._pending += tokens
            return
        for seq in self._tip:  # every branch cell goes; the root stays in seq 0
            self.ctx.seq_rm(seq)
        self._node_seq.clear()
        self._tip.clear()
        self._pending = tokens[1:]


def top_k_log_probs(logits: np.ndarray, k: int, window: float = 20.0) -> tuple[np.ndarray, np.ndarray]:
    """logits: [rows, n_vocab] -> (ids [rows, k] best first, log-probs [rows, k]).

    The normalizer sums only tokens within `window` logits of the best: the rest add under
    n_vocab * e^-window (5e-4 for 262k tokens) to it, and exp over a whole 262k row costs more than the
    drafter's matmuls. Draft log-probs only steer the tree, so this cannot affect the output.
    """
    rows = np.arange(len(logits))[:, None]
    ids = np.argpartition(logits, -k, axis=1)[:, -k:]
    ids = ids[rows, np.argsort(-logits[rows, ids], axis=1, kind="stable")]
    top = logits[rows, ids]  # [rows, k], best first
    peak = top[:, :1]
    near_rows, near_cols = np.nonzero(logits >= peak - window)
    mass = np.bincount(near_rows, weights=np.exp(logits[near_rows, near_cols] - peak[near_rows, 0]),
                       minlength=len(logits))
    return ids.astype(np.int32), (top - peak - np.log(mass)[:, None]).astype(np.float32)


def _never() -> bool:
    return False


def _always() -> bool:
    return True
