"""One generation at a time, in arrival order, on a thread of its own: the server's requests become jobs here.

A laptop runs one generation at a time (the models use every core), so requests wait in a queue, first come first
served. The pair's decoder stays the same from job to job, so a prompt that extends the last one (a chat's next turn)
runs only its new tokens. A job is cancelled when its client leaves: a waiting job is skipped, a running one stops
after its current token. Events go back to the asyncio side as Steps, then None.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import edge
from edge.errors import ModelFault, UserError
from edge.generate import Step
from edge.sampling import SamplingConfig

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


class Worker:
    """Runs jobs one by one on its own thread until `close`."""

    def __init__(self, pair: Pair, speculate: bool = True, budget: int | str | None = None):
        self.pair = pair
        self.speculate = speculate
        self.budget = budget
        self.completed = self.cancelled = self.failed = 0
        self.running: Job | None = None
        self._waiting: deque[Job] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="edge-spec generation", daemon=True)
        self._thread.start()

    def submit(self, work: Work) -> Job:
        job = Job(work, asyncio.get_running_loop())
        with self._wake:
            if self._closed:
                raise GenerationFailed("the server is shutting down", 503)
            self._waiting.append(job)
            self._wake.notify()
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
            for job in [*self._waiting, *([self.running] if self.running else [])]:
                job.cancel()
            self._wake.notify()
        self._thread.join(timeout)

    def _next(self) -> Job | None:
        with self._wake:
            while not self._closed and not self._waiting:
                self._wake.wait()
            if not self._waiting:
                return None
            job = self._waiting.popleft()
            self.running = job
            return job

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                if job.cancelled.is_set():  # its client left, or the server is shutting down (the client hears so)
                    self.cancelled += 1
                    if self._closed:
                        job._send(GenerationFailed("the server is shutting down", 503))
                    continue
                self._generate(job)
            finally:
                with self._wake:
                    self.running = None
        with self._wake:  # closed: whatever still waits hears so
            for job in self._waiting:
                job._send(GenerationFailed("the server is shutting down", 503))
            self._waiting.clear()

    def _generate(self, job: Job) -> None:
        work = job.work
        try:
            for step in edge.stream_generate(self.pair, list(work.tokens), max_tokens=work.max_tokens,
                                             sampling=work.sampling, speculate=self.speculate, budget=self.budget,
                                             stop=list(work.stop) or None, should_stop=job.cancelled.is_set,
                                             principal=work.principal):
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
