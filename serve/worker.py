"""The server's requests become jobs here, run in arrival order on threads of their own.

With --parallel 1 (the default) one generation runs at a time, with the pair's trees: requests wait in a queue, first
come first served, and the pair's decoder stays the same from job to job, so a prompt that extends the last one (a
chat's next turn) runs only its new tokens. With --parallel N, up to N requests decode together in lanes of one
target pass (Pair.lanes: for a target read from the drive, the weights are read once for all of them), each growing
its tree with a drafter of its own where the pair has one (runtimes/llama_cpp/tree_lanes.py), else plainly; a lane
keeps its principal's last prompt and reply for the next request of the same principal. A job is cancelled when its
client leaves: a waiting job is skipped, a running one stops after its current token, and its lane takes the next.
Events go back to the asyncio side as Steps, then None.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edge.models.cache import cache_dir
from edge.serve.states import MIN_GAIN, PromptStates

import edge
from edge.api import reply_steps
from edge.budget import LaneBudget, SharedBudget
from edge.errors import ModelFault, UserError
from edge.generate import Decoder, Step, common_prefix
from edge.lookup import Lookup
from edge.sampling import SamplingConfig
from edge.stops import StopStrings

if TYPE_CHECKING:
    from edge.models.pair import Pair

log = logging.getLogger("edge.serve")


@dataclass(frozen=True)
class Work:
    """What a request asks to be generated: everything checked, the prompt already tokens."""

    tokens: Sequence[int]
    sampling: SamplingConfig
    max_tokens: int
    stop: Sequence[str] = ()
    principal: str | None = None  # whose request (a server's API key): its state is kept apart (Pair.reused_decoder)


class GenerationFailed(Exception):
    """A job ended without its reply; the message is safe to show the client."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Job:
    work: Work
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    async def steps(self) -> AsyncIterator[Step]:
        """The reply's steps as the worker makes them; the last has a finish reason. Raises GenerationFailed."""
        while True:
            event = await self.events.get()
            if isinstance(event, GenerationFailed):
                raise event
            yield event
            if event.finish_reason is not None:
                return

    def _send(self, event: Step | GenerationFailed) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            self.cancelled.set()


def kept_conversations() -> PromptStates | None:
    """Where lanes keep conversations (serve/states.py), in the cache; None, said in the log, where the cache has no
    room for them (a folder it may not write to): the server then reads a prompt again where a lane let it go."""
    try:
        return PromptStates(cache_dir())
    except OSError as problem:
        log.warning("conversations a lane lets go of are not kept: %s", problem)
        return None


class Worker:
    """Runs jobs on `parallel` threads (lanes) until `close`: one by one with the pair's own decoder, or up to
    `parallel` at once in the pair's lanes."""

    def __init__(self, pair: Pair, speculate: bool = True, budget: int | str | None = None, parallel: int = 1):
        self.pair = pair
        self.speculate = speculate
        self.budget = budget
        self.completed = self.cancelled = self.failed = 0
        # with a drafter, each lane grows its trees with a drafter of its own and the pass verifies all of them
        self.trees = parallel > 1 and speculate and pair.drafter is not None
        self.lanes = pair.lanes(parallel, self.trees) if parallel > 1 else None
        self._lane_drafters = [pair.lane_drafter() for _ in range(parallel)] if self.trees else []
        self._nodes = pair.budget if budget is None else budget  # --budget N: the nodes of a pass in all
        # --budget auto: each lane's trees sized against the measured pass times, priced for the lanes that run
        self._costs = pair.pass_costs(large=False) if self.trees and self._nodes == "auto" else None
        self._running: set[Job] = set()
        self._busy_lanes: set[int] = set()
        self._lane_used: dict[int, int] = {}  # when each lane last took a job (a count)
        self._picked = 0
        self._lane_decoders: dict[int, tuple[str | None, Decoder]] = {}  # a lane's principal and decoder, kept
        # plain lanes keep the conversations they let go of on the drive, for the next request continuing one
        self._states = kept_conversations() if self.lanes is not None and not self.trees else None
        self._waiting: deque[Job] = deque()
        self._drain = False  # a job waits for the lanes' dead cells to be let go of: none starts until they are
        self._wake = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, args=(lane,), name=f"edge-spec generation {lane}",
                                          daemon=True) for lane in range(parallel)]
        for thread in self._threads:
            thread.start()

    @property
    def running(self) -> int:
        """Jobs generating now."""
        with self._wake:
            return len(self._running)

    def submit(self, work: Work) -> Job:
        job = Job(work, asyncio.get_running_loop())
        with self._wake:
            if self._closed:
                raise GenerationFailed("the server is shutting down", 503)
            self._waiting.append(job)
            self._wake.notify_all()  # the lane that should take it (Worker._lane_for) among the waiting
        return job

    @property
    def waiting(self) -> int:
        """Jobs in the queue whose clients are still there."""
        with self._wake:
            return sum(not job.cancelled.is_set() for job in self._waiting)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every job, waiting or running, and end the thread (the running job stops after its token)."""
        with self._wake:
            self._closed = True
            for job in [*self._waiting, *self._running]:
                job.cancel()
            self._wake.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        # the lanes' context goes before the pair's model does (serve's caller closes the pair); a lane still in a
        # pass (a Ctrl-C's close with no wait) keeps it until the final close
        if self.lanes is not None and not any(thread.is_alive() for thread in self._threads):
            self.lanes.close()
            for drafter in self._lane_drafters:
                drafter.close()
        if self._states is not None:
            self._states.close()

    def _next(self, lane: int) -> Job | None:
        with self._wake:
            while True:
                if self._closed and not self._waiting:
                    return None
                job = self._pick(lane)
                job = None if self._draining(job, lane) else job
                if job is not None or self._closed:
                    break
                self._wake.wait()
            job = job if job is not None else self._waiting[0]  # closed: each hears so
            self._waiting.remove(job)
            self._running.add(job)
            self._busy_lanes.add(lane)
            self._lane_used[lane] = self._picked = self._picked + 1
            # the jobs still waiting may have ranked this lane first (_lane_for): the idle lanes rank them again now
            self._wake.notify_all()
            return job

    def _draining(self, job: Job | None, lane: int) -> bool:
        """Tree lanes keep the cells a lane lets go of taken until every lane is empty (TreeLanes.remove): where `job`'s
        start in `lane` could let go of more than they have room for (what the lane holds, and what a conversation
        put back holds past the prompt), no job starts until the running ones end; then the lanes start over, empty
        (what they held kept on the drive, where plain lanes keep conversations: serve/states.py)."""
        lanes = self.lanes
        if lanes is None:
            return False
        if job is not None and not self._drain:
            put_back = 0 if self._states is None else self._states.largest(job.work.principal)
            self._drain = not lanes.room_for_dead(lanes.target(lane).n_past + put_back)
        # with conversations kept on the drive, idle lanes start over at little cost, their cells let go of freed
        # (a client that left, a conversation cut short): not left to run short under load, where a job would wait
        # for every running one to end
        self._drain |= self._states is not None and not self._busy_lanes and lanes.dead > 0
        if not self._drain:
            return False
        if self._busy_lanes:
            return True
        for idle, kept in self._lane_decoders.items():
            self._keep(idle, kept)
        lanes.reset()
        self._lane_decoders.clear()
        self._drain = False
        return False

    def _pick(self, lane: int) -> Job | None:
        """The first waiting job this lane should take: the idle lane whose cells hold the longest start of a job's
        prompt for the same principal (its last turn) takes it, else an empty lane, else the one idle longest."""
        for job in self._waiting:
            if self._lane_for(job) == lane:
                return job
        return None

    def _lane_for(self, job: Job) -> int | None:
        idle = [lane for lane in range(len(self._threads)) if lane not in self._busy_lanes]
        if not idle:
            return None

        def worth(lane: int) -> tuple[int, int]:  # (prompt tokens held for this job, -(how recently it ran))
            kept = self._lane_decoders.get(lane)
            if kept is None:
                return 0, 1
            held = common_prefix(kept[1].context, job.work.tokens) if kept[0] == job.work.principal else 0
            return held, -self._lane_used.get(lane, 0)

        return max(idle, key=worth)

    def _run(self, lane: int) -> None:
        while (job := self._next(lane)) is not None:
            try:
                if job.cancelled.is_set():  # its client left, or the server is shutting down (the client hears so)
                    self.cancelled += 1
                    if self._closed:
                        job._send(GenerationFailed("the server is shutting down", 503))
                    continue
                self._generate(job, lane)
            finally:
                self._release(job, lane)
        with self._wake:  # closed: whatever still waits hears so
            for job in self._waiting:
                job._send(GenerationFailed("the server is shutting down", 503))
            self._waiting.clear()

    def _steps(self, job: Job, lane: int) -> Iterator[Step]:
        work = job.work
        if self.lanes is None:
            return edge.stream_generate(self.pair, list(work.tokens), max_tokens=work.max_tokens,
                                        sampling=work.sampling, speculate=self.speculate, budget=self.budget,
                                        stop=list(work.stop) or None, should_stop=job.cancelled.is_set,
                                        principal=work.principal)
        self.pair.check_open()  # a model file changed on disk since it loaded is said, not computed with
        return self._lane_steps(job, lane)

    def _lane_steps(self, job: Job, lane: int) -> Iterator[Step]:
        """The job in its lane: the lane's decoder where the same principal ran there last (its prompt and reply
        still in the lane's cells), else a fresh one over an emptied lane: no prompt cache across principals."""
        assert self.lanes is not None
        work = job.work
        kept = self._lane_decoders.get(lane)
        if self._states is not None:
            kept = self._from_states(lane, work, kept)
        if kept is None or kept[0] != work.principal:
            target = self.lanes.target(lane)
            target.truncate(0)
            kept = work.principal, self._lane_decoder(lane, work)
            self._lane_decoders[lane] = kept
        decoder = kept[1]
        decoder.set_sampling(work.sampling)
        self.lanes.busy(lane, True)
        ended = None
        try:
            for step in reply_steps(decoder, list(work.tokens), work.max_tokens, StopStrings(list(work.stop)),
                                    job.cancelled.is_set):
                ended = step.finish_reason or ended
                yield step
        finally:
            self.lanes.busy(lane, False)
            if ended in (None, "interrupted"):  # its client left: the lane's cells are not kept for its next turn
                # let go of at once (freed when the lanes are next idle: _draining), where the dead cells' room holds
                # them; else when the lane's next job starts
                target = decoder.target
                if self.lanes.room_for_dead(target.n_past):
                    target.truncate(0)
                del self._lane_decoders[lane]

    def _from_states(self, lane: int, work: Work,
                     kept: tuple[str | None, Decoder] | None) -> tuple[str | None, Decoder] | None:
        """Where the lane is about to let go of cells, its conversation is kept first (serve/states.py); where a kept
        conversation of the job's principal holds more of its prompt than the lane does, it is put back into the
        lane. The lane's principal and decoder after that."""
        assert self.lanes is not None and self._states is not None
        target = self.lanes.target(lane)
        own = kept[1] if kept is not None and kept[0] == work.principal else None  # the principal's own decoder
        held = 0 if own is None else min(common_prefix(own.context, work.tokens), len(work.tokens) - 1)
        if kept is not None and held < target.n_past:
            self._keep(lane, kept)
        saved = self._states.best(work.principal, work.tokens, held + MIN_GAIN)
        if saved is None:
            return kept
        if target.restore_state(saved.path) != list(saved.context[:-1]):  # not what was written: read the prompt
            target.truncate(0)
            self._lane_decoders.pop(lane, None)
            return None
        decoder = own if own is not None else self._lane_decoder(lane, work)
        decoder.adopt(saved.context)
        self._lane_decoders[lane] = work.principal, decoder
        return work.principal, decoder

    def _keep(self, lane: int, kept: tuple[str | None, Decoder]) -> None:
        """The conversation the lane's cells hold, kept on the drive (where plain lanes keep them)."""
        if self._states is None or self.lanes is None:
            return
        target = self.lanes.target(lane)
        context = kept[1].context[: target.n_past + 1]  # the cells hold context[:-1]
        if target.n_past > 0:
            self._states.keep(kept[0], context, lambda path: target.save_state(path, context[:-1]))

    def _lane_decoder(self, lane: int, work: Work) -> Decoder:
        """A lane's decoder for `work`'s principal: plain, or its trees drafted by the lane's own drafter (and lookup
        over the principal's own replies), sized against the pass times for the lanes that run (LaneBudget), or
        --budget N nodes a pass shared out among them (SharedBudget)."""
        assert self.lanes is not None
        target, accept = self.lanes.target(lane), self.pair.options.accept
        if not self.trees:
            return Decoder(target, None, None, work.sampling, accept=accept)
        corpus = self.pair.corpus_of(work.principal)
        budget = (LaneBudget(self._costs, max_budget=self.lanes.max_tree - 1, sharers=self.lanes.running,
                             pass_room=self.pair.max_tree or 0, lanes=self.lanes.n)
                  if self._costs is not None else SharedBudget(int(self._nodes), self.lanes.running))
        return Decoder(target, self._lane_drafters[lane], budget, work.sampling, accept=accept,
                       lookup=None if corpus is None else Lookup(corpus))

    def _release(self, job: Job, lane: int) -> None:
        """The job is done with its lane: before its client hears the last step, so that the client's next request
        (a chat's next turn) finds the lane that holds its prompt free, not taken by another principal meanwhile."""
        with self._wake:
            self._running.discard(job)
            self._busy_lanes.discard(lane)
            self._wake.notify_all()  # a job left for this lane (its principal's next turn) may wait

    def _generate(self, job: Job, lane: int) -> None:
        try:
            for step in self._steps(job, lane):
                if step.finish_reason is not None:
                    self._release(job, lane)
                job._send(step)
        except ModelFault as problem:  # the model file changed under the server: not the client's fault, no trace
            self.failed += 1
            log.error("%s", problem)
            job._send(GenerationFailed(str(problem), 503))
            return
        except UserError as problem:  # the request was checked before it queued: this is rare (one line, no trace)
            self.failed += 1
            log.warning("request refused: %s", problem)
            job._send(GenerationFailed(str(problem), 400))
            return
        except Exception as problem:  # a fault of ours: the trace goes to the log, the client hears one line
            self.failed += 1
            log.exception("generation failed")
            job._send(GenerationFailed(f"generation failed: {type(problem).__name__}: {problem}", 500))
            return
        if step.finish_reason == "interrupted":
            self.cancelled += 1
        else:
            self.completed += 1
