"""Several requests decoding together: one llama.cpp context whose sequences are lanes, one pass for all of them.

This base keeps a KV stream for each lane, as llama-server's slots do. But llama.cpp splits a pass over streams into
micro-batches, one for each run of consecutive seq ids in batch order, each computing every layer again (a streamed
target's weights read again), so Pair.lanes makes TreeLanes (runtimes/llama_cpp/tree_lanes.py), whose lanes share one
KV cache, plain or not; they take the batcher and LaneTarget from here.

Each lane is a sequence with a KV stream of its own (the context is not unified, as llama-server's slots), so a lane's
cells stay in position order whatever the other lanes do: its attention sums what it would sum alone. The weights'
kernels are the batch-invariant ones (runtimes/llama_cpp/kernels.py), so a lane's logits do not depend on what else
rode in the pass either: every lane's reply is the one it gets alone, bit for bit (tests/test_batching.py).

A lane is a Target (LaneTarget) that one request's decoder runs on its own thread; its passes are requests to the
lanes' batcher, which waits until every busy lane has asked (or GATHER_S has passed), then runs them all in one
llama_decode. For a target streamed from the drive, that pass reads the weights once for every lane.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from edge.runtimes.llama_cpp._native import Batch, Context
from edge.runtimes.llama_cpp.kernels import lane_padding, padding_room
from edge.runtimes.llama_cpp.models import LlamaTarget

from edge.protocols import ModelDefaults
from edge.tree import TokenTree

GATHER_S = 0.02  # how long a pass waits for a busy lane's next request (its thread samples and hands on a token)
LANE_BATCH = 256  # tokens one pass carries: every lane's next token, and prompts in chunks of what is left


@dataclass(eq=False)
class _Ask:
    """One lane's tokens for the batcher: run from `done` on at positions start + i; the last one's logits kept."""

    lane: int
    tokens: Sequence[int]
    start: int
    output: bool
    done: int = 0
    logits: np.ndarray | None = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)


class Lanes:
    """`n` lanes over a target's weights, each of `n_ctx` tokens, and the thread that runs their passes."""

    keeps_cells = False  # a lane's cells are freed as it lets go of them (TreeLanes keeps them until a reset)

    def __init__(self, target: LlamaTarget, n: int, n_ctx: int,
                 before_pass: Callable[[np.ndarray], None] | None = None, after_pass: Callable[[], None] | None = None):
        """`before_pass(tokens)` and `after_pass()` around each pass: a target streamed from the drive reads the
        tokens' embedding rows and drops its pages behind (offload/ssd.py SsdTarget does the same around its own)."""
        # a target whose kernels change with a pass's rows (a GPU backend's min_rows, repacked weights' row_multiple)
        # pads every pass (kernels.lane_padding): the throwaway rows go in a sequence of their own (pad_seq), dropped
        # after the pass. Exact only in one KV cache (TreeLanes: Pair.lanes picks it for such a target): over these
        # per-lane streams llama.cpp splits a pass into micro-batches, each short of the padded rows.
        self.min_rows, self.row_multiple = target.min_rows, target.row_multiple  # (kernels.lane_padding)
        self.pad_room = padding_room(self.min_rows, self.row_multiple)  # rows and cells a pass's padding may take
        self.padded = 0  # passes padded
        self._before_pass, self._after_pass = before_pass, after_pass
        self.ctx = self._context(target, n, n_ctx)
        self.n, self.n_ctx, self.model, self._template = n, self.ctx.n_ctx // self.streams, target.model, target
        self.gather_s = GATHER_S  # how long a pass waits for the busy lanes that have not asked yet
        self.passes = 0  # passes run, all lanes together
        self.lane_passes = 0  # lanes' passes, counted in each pass they rode in
        self._batch = Batch(self.ctx.n_batch)
        self._asks: list[_Ask] = []
        self._targets: dict[int, LaneTarget] = {}
        self._busy: set[int] = set()  # lanes whose request is running: the batcher waits for their next ask
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="edge-spec lanes", daemon=True)
        self._thread.start()

    def _context(self, target: LlamaTarget, n: int, n_ctx: int) -> Context:
        """n KV streams of n_ctx cells, one a lane, over the target's weights and settings; one more for a pass's
        padding (pad_seq) where passes are padded."""
        settings = target.ctx.settings
        self.streams, self.pad_seq = n + (self.pad_room > 0), n
        return Context(target.model, self.streams * n_ctx, n_batch=max(LANE_BATCH, n) + self.pad_room,
                       kv_type=settings["kv_type"], n_threads=settings["n_threads"],
                       flash_attn=settings["flash_attn"], n_outputs=max(n, self.min_rows) + self.row_multiple,
                       on_layer=settings["on_layer"], sequences=self.streams, unified=False)

    def target(self, lane: int) -> LaneTarget:
        """The lane as a Target (the same object for a lane every time: it knows what the lane's cells hold)."""
        if lane not in self._targets:
            self._targets[lane] = LaneTarget(self, lane, self._template)
        return self._targets[lane]

    def busy(self, lane: int, running: bool) -> None:
        """Whether `lane` runs a request now: the batcher waits for a busy lane's next pass."""
        with self._cond:
            (self._busy.add if running else self._busy.discard)(lane)
            self._cond.notify_all()

    def running(self) -> int:
        """Lanes whose request runs now (read without the lock, which a pass holds: a round's start does not wait
        for another lane's pass)."""
        return len(self._busy)

    def run(self, lane: int, tokens: Sequence[int], start: int, output: bool) -> np.ndarray | None:
        """Run `tokens` in `lane` at positions start..., in the batcher's passes; the last token's logits
        ([n_vocab] float32, a copy) when `output`."""
        return self._submit(_Ask(lane, list(tokens), start, output))

    def _submit(self, ask: _Ask) -> np.ndarray | None:
        """Hand `ask` to the batcher and wait until its passes have run: its logits, if it asked for any."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the lanes are closed")
            self._asks.append(ask)
            self._cond.notify_all()
        ask.finished.wait()
        if ask.error is not None:
            raise ask.error
        return ask.logits

    def seq(self, lane: int) -> int:
        """The seq id holding `lane`'s tokens."""
        return lane

    def remove(self, lane: int, start: int) -> None:
        """Drop `lane`'s cells from position `start` on (between passes)."""
        with self._cond:
            self.ctx.seq_rm(lane, start, -1)

    def save(self, lane: int, path: Path, tokens: Sequence[int]) -> int:
        """Write `lane`'s cells (which hold `tokens`) to `path`, between passes: the file's bytes."""
        with self._cond:
            return self.ctx.save_seq(self.seq(lane), path, tokens)

    def restore(self, lane: int, path: Path) -> list[int]:
        """Put a `save`d file's cells into `lane` (empty), between passes: the tokens they hold. They take the lowest
        free cells, as a pass's tokens do (which TreeLanes' cell order relies on)."""
        with self._cond:
            return self.ctx.load_seq(self.seq(lane), path, self.n_ctx)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for ask in self._asks:
                ask.error = RuntimeError("the lanes are closed")
                ask.finished.set()
            self._asks.clear()
            self._cond.notify_all()
        self._thread.join(10)
        self.ctx.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._asks and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                deadline = time.monotonic() + self.gather_s
                while self._busy - {ask.lane for ask in self._asks} and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._closed:
                    return
                taken = self._fill()
                try:
                    if self._before_pass is not None:
                        self._before_pass(self._batch.token[: self._batch.struct.n_tokens])
                    self._decode(taken)
                    if self._after_pass is not None:
                        self._after_pass()
                except BaseException as problem:
                    for ask, _, _ in taken:
                        ask.error = problem
                else:
                    self.passes += 1
                    self.lane_passes += len({ask.lane for ask, _, _ in taken})
                    self._hand_back(taken)
                for ask, _, _ in taken:
                    if ask.error is not None or ask.done == len(ask.tokens):
                        self._asks.remove(ask)
                        ask.finished.set()

    def _decode(self, taken: list[tuple[_Ask, int, int]]) -> None:
        self._pass()

    def _pass(self) -> None:
        """The batch's pass, padded where the target's kernels change with its rows (kernels.lane_padding; the
        padding's outputs after the batch's own)."""
        batch = self._batch
        n = batch.struct.n_tokens
        rows, outputs = lane_padding(n, int(batch.output[:n].sum()), self.min_rows, self.row_multiple)
        padded = rows > n
        if padded:
            batch.pad(rows, self.pad_seq, outputs)
            self.padded += 1
        try:
            self.ctx.decode(self._batch)
        finally:
            if padded:
                self.ctx.seq_rm(self.pad_seq)

    def _fill(self) -> list[tuple[_Ask, int, int]]:
        """The batch: each ask's next tokens, the shortest first so that every lane's one token rides before any
        prompt fills the rest; (ask, its first token here, the row of its logits or -1)."""
        room, taken, n = self._batch.capacity - self.pad_room, [], 0
        for ask in sorted(self._asks, key=lambda a: len(a.tokens) - a.done):
            if room == 0:
                break
            count = min(room, len(ask.tokens) - ask.done)
            rows = slice(n, n + count)
            self._batch.token[rows] = ask.tokens[ask.done: ask.done + count]
            self._batch.pos[rows] = np.arange(ask.start + ask.done, ask.start + ask.done + count)
            self._batch.n_seq_id[rows] = 1
            self._batch.seq_id[rows, 0] = ask.lane
            last = ask.done + count == len(ask.tokens)
            self._batch.output[rows] = 0
            if last and ask.output:
                self._batch.output[n + count - 1] = 1
            taken.append((ask, count, n + count - 1 if last and ask.output else -1))
            n, room = n + count, room - count
        self._batch.struct.n_tokens = n
        return taken

    def _hand_back(self, taken: list[tuple[_Ask, int, int]]) -> None:
        n_outputs = sum(row >= 0 for _, _, row in taken)
        logits = self.ctx.logits(n_outputs) if n_outputs else None  # [n_outputs, n_vocab], in batch order
        output = 0
        for ask, count, row in taken:
            ask.done += count
            if row >= 0 and logits is not None:
                ask.logits = logits[output].copy()
                output += 1


class LaneTarget(ModelDefaults):
    """One lane as a Target for a plain decoder: the KV cache holds context[:-1], and a pass runs the root alone."""

    max_tree = 1

    def __init__(self, lanes: Lanes, lane: int, template: LlamaTarget):
        self.lanes, self.lane = lanes, lane
        self.runtime, self.path, self.n_vocab = template.runtime, template.path, template.n_vocab
        self.tokenizer, self.special = template.tokenizer, template.special
        self.n_ctx = lanes.n_ctx
        self.n_past = 0
        self.passes = 0

    def prefill(self, tokens: Sequence[int]) -> None:
        if tokens:
            self.lanes.run(self.lane, tokens, self.n_past, output=False)
            self.n_past += len(tokens)
            self.passes += 1

    def verify(self, tree: TokenTree) -> np.ndarray:
        if len(tree) != 1:
            raise ValueError(f"a lane decodes one token a pass, not a tree of {len(tree)}")
        logits = self.lanes.run(self.lane, [int(tree.tokens[0])], self.n_past, output=True)
        self.passes += 1
        assert logits is not None
        return logits[None, :]  # [1, n_vocab]

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        self.n_past += 1  # the root's cell, written by its pass

    def truncate(self, n: int) -> None:
        if n < self.n_past:
            self.lanes.remove(self.lane, n)
            self.n_past = n

    def save_state(self, path: Path, tokens: Sequence[int]) -> int:
        """Write the lane's cells, which hold `tokens` (n_past of them), to `path`: the file's bytes."""
        if len(tokens) != self.n_past:
            raise ValueError(f"the lane's cells hold {self.n_past} tokens, not {len(tokens)}")
        return self.lanes.save(self.lane, path, tokens)

    def restore_state(self, path: Path) -> list[int]:
        """The lane's cells replaced by those a save_state file holds: the tokens they hold."""
        self.truncate(0)
        tokens = self.lanes.restore(self.lane, path)
        self.n_past = len(tokens)
        return tokens

    def resize(self, size: int) -> bool:
        return size <= 1

    def close(self) -> None:
        """The lanes own the context (Lanes.close)."""
