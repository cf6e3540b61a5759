"""Several requests decoding together: one llama.cpp context whose sequences are lanes, one pass for all of them.

A lane is a Target (LaneTarget) that one request's decoder runs on its own thread; its passes are requests to the
lanes' batcher (Lanes), which waits until every busy lane has asked (or `gather_s` has passed), then runs them all in
one llama_decode. For a target streamed from the drive, that pass reads the weights once for every lane. The weights'
kernels are the batch-invariant ones (runtimes/llama_cpp/kernels.py), so a lane's logits do not depend on what else
rode in the pass: every lane's reply is the one it gets alone, bit for bit (tests/test_batching.py).

How a pass lays out its lanes' tokens and cells is TreeLanes' (runtimes/llama_cpp/tree_lanes.py): every lane in one
KV cache. Not a KV stream a lane, as llama-server's slots have: llama.cpp splits a pass over streams into
micro-batches, one for each run of consecutive seq ids in batch order, each computing every layer again (for a
streamed target, reading its weights again).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from edge.runtimes.llama_cpp._native import Batch, Context
from edge.runtimes.llama_cpp.kernels import lane_padding, padding_room
from edge.runtimes.llama_cpp.models import LlamaTarget

from edge.protocols import ModelDefaults

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


class Lanes(ABC):
    """`n` lanes over a target's weights, each of `n_ctx` tokens, and the thread that runs their passes; a subclass
    makes the context and lays out each pass (TreeLanes)."""

    def __init__(self, target: LlamaTarget, n: int, n_ctx: int,
                 before_pass: Callable[[np.ndarray], None] | None = None, after_pass: Callable[[], None] | None = None):
        """`before_pass(tokens)` and `after_pass()` around each pass: a target streamed from the drive reads the
        tokens' embedding rows and drops its pages behind (offload/ssd.py SsdTarget does the same around its own)."""
        # a target whose kernels change with a pass's rows (a GPU backend's min_rows, repacked weights' row_multiple)
        # pads every pass (kernels.lane_padding): the throwaway rows go in a sequence of their own (pad_seq), dropped
        # after the pass; exact only where a pass is one micro-batch (one KV cache)
        self.min_rows, self.row_multiple = target.min_rows, target.row_multiple  # (kernels.lane_padding)
        # plain lanes in RAM on llama.cpp's kernels by rows split each pass by rows (split_rows, _split_pass)
        self.split_rows = target.split_rows
        if self.split_rows > 1 and n >= self.split_rows:
            raise ValueError(f"{n} lanes' tokens would take the kernel of {self.split_rows} rows and more: "
                             f"load the target for {n} lanes")
        self.pad_room = max(padding_room(self.min_rows, self.row_multiple),  # rows and cells a padding may take
                            self.split_rows - 1)
        self.padded = 0  # passes padded
        self._before_pass, self._after_pass = before_pass, after_pass
        self.ctx = self._context(target, n, n_ctx)
        self.n, self.n_ctx, self.model, self._template = n, n_ctx, target.model, target
        self.gather_s = GATHER_S  # how long a pass waits for the busy lanes that have not asked yet
        self.passes = 0  # passes run, all lanes together
        self.lane_passes = 0  # lanes' passes, counted in each pass they rode in
        self._batch = Batch(self.ctx.n_batch)
        self._part = Batch(self.ctx.n_batch) if self.split_rows > 1 else None  # one call of a split pass
        self._asks: list[_Ask] = []
        self._targets: dict[int, LaneTarget] = {}
        self._busy: set[int] = set()  # lanes whose request is running: the batcher waits for their next ask
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="edge-spec lanes", daemon=True)
        self._thread.start()

    @abstractmethod
    def _context(self, target: LlamaTarget, n: int, n_ctx: int) -> Context:
        """The context over the target's weights and settings for n lanes of n_ctx cells (it sets `pad_seq`: the
        seq a padded pass's throwaway rows take)."""

    @abstractmethod
    def target(self, lane: int) -> LaneTarget:
        """The lane as a Target (the same object for a lane every time: it knows what the lane's cells hold)."""

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

    @abstractmethod
    def seq(self, lane: int) -> int:
        """The seq id holding `lane`'s tokens."""

    @abstractmethod
    def remove(self, lane: int, start: int) -> None:
        """`lane` lets go of its cells from position `start` on (between passes)."""

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

    @abstractmethod
    def _decode(self, taken: list[tuple[_Ask, int, int]]) -> None:
        """The pass over the batch `_fill` laid out (`_pass` runs it)."""

    def _pass(self) -> None:
        """The batch's pass, padded where the target's kernels change with its rows (kernels.lane_padding; the
        padding's outputs after the batch's own), or split by them (_split_pass)."""
        batch = self._batch
        n = batch.struct.n_tokens
        if self._part is not None:
            self._split_pass(n)
            return
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

    def _split_pass(self, n: int) -> None:
        """The batch's `n` rows in two calls, where the kernel goes by a call's rows (kernels.TILED_MIN_ROWS): first
        the rows that only fill the KV cache (prompts, pending tokens), padded to split_rows or more, then the rows
        that output (each lane's newest token, fewer than split_rows). Every row then takes the same kernel whatever
        rode beside it, the prompts the faster one for many rows. A lane's rows keep their order in its cells: its
        filling rows come before its output row in the batch (_fill), and so in the calls."""
        batch, part = self._batch, self._part
        assert part is not None
        outputs = batch.output[:n] != 0
        if outputs.sum() >= self.split_rows:
            raise RuntimeError(f"a split pass of {int(outputs.sum())} outputs: fewer than {self.split_rows} only")
        if outputs.all():
            self.ctx.decode(batch)
            return
        part.take(batch, np.flatnonzero(~outputs))
        padded = part.struct.n_tokens < self.split_rows
        if padded:
            part.pad(self.split_rows, self.pad_seq, 0)
            self.padded += 1
        try:
            self.ctx.decode(part)
        finally:
            if padded:
                self.ctx.seq_rm(self.pad_seq)
        if outputs.any():
            part.take(batch, np.flatnonzero(outputs))
            self.ctx.decode(part)

    @abstractmethod
    def _fill(self) -> list[tuple[_Ask, int, int]]:
        """The batch: the asks' next tokens; (ask, its rows here, the row of its logits or -1)."""

    @abstractmethod
    def _hand_back(self, taken: list[tuple[_Ask, int, int]]) -> None:
        """Each ask's logits after the pass (a copy), and its tokens counted as done."""


class LaneTarget(ModelDefaults, ABC):
    """One lane as a Target for a decoder (TreeLaneTarget verifies its trees): the KV cache holds context[:-1]."""

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

    @abstractmethod
    def truncate(self, n: int) -> None:
        """Keep the first n of the lane's tokens."""

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

    def close(self) -> None:
        """The lanes own the context (Lanes.close)."""
