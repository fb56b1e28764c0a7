"""One thread owns the engine; HTTP handlers hand it work through a queue, and concurrent generates share a step.

The embedded engine is not thread-safe and samples a whole batch per ``generate`` call. So every
engine call of the server goes through ``EngineWorker``: a single thread takes jobs off a queue in
arrival order. A generate job that reaches the head of the queue takes every other generate job
queued behind it (up to the first non-generate job, which is a barrier: a weight update never
overtakes a request sent before it, and no request sent after it runs on the old weights) and up to
``max_rows`` rows; the jobs are grouped by sampling parameters (the engine takes one set per call)
and each group runs as one engine step. Requests that arrive while a step runs wait in the queue
and form the next step together: continuous batching across HTTP requests, at the granularity of
whole engine steps (the engine does not admit rows into a running decode). So that a burst of
requests (a rollout sent as one request per sample) is not cut into a one-row step and the rest, a
step starts only once the engine's batch of rows (``--rollout-max-batch``) is queued or no request
arrived for ``--serve-batch-wait-ms``; a batch the client sent as one request (a list of prompts)
starts at once.

Pause (SGLang's ``/pause_generation``): while paused, generate jobs stay queued and other jobs
(weight updates, memory) still run; ``abort`` mode finishes the queued generates at once with an
``abort`` finish reason, ``in_place``/``retract`` keep them for ``/continue_generation``. A step
already running always finishes (an engine step cannot be interrupted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tidal.rollout.types import Sample, SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepInfo:
    """Which engine step served a request, and how many requests and rows that step held."""

    step: int
    requests: int
    rows: int
    seconds: float = 0.0  # the engine's generate call alone
    started: float = 0.0  # time.monotonic() when the engine call began and ended (the request timings' clock)
    ended: float = 0.0


@dataclasses.dataclass
class GenerateResult:
    samples: list[Sample]
    step: StepInfo | None  # None: aborted before it ran
    aborted: bool = False


@dataclasses.dataclass
class _Job:
    future: concurrent.futures.Future
    prompts: list[list[int]] | None = None  # generate job
    sampling: SamplingParams | None = None
    fn: Callable[[], Any] | None = None  # any other engine call
    eager: bool = False  # part of a batch the client sent as one request: no burst to wait for

    @property
    def is_generate(self) -> bool:
        return self.prompts is not None


async def _two_turns() -> None:
    """Returns after the event loop ran everything that was ready when it started, and what that scheduled."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def _key(s: SamplingParams) -> tuple:
    return (s.temperature, s.top_p, s.top_k, s.max_new_tokens, tuple(s.stop), tuple(s.stop_token_ids), s.seed)


class EngineWorker:
    """``max_rows``: rows one step may take; ``fill_rows`` / ``wait_s``: a step starts once ``fill_rows``
    rows are queued or no request arrived for ``wait_s`` (a burst of requests becomes one step)."""

    def __init__(self, engine, *, max_rows: int = 4096, fill_rows: int = 512, wait_s: float = 0.05) -> None:
        self.engine = engine
        self.max_rows = max_rows
        self.fill_rows = min(fill_rows, max_rows)
        self.wait_s = wait_s
        self._last_arrival = 0.0
        self._arrivals = 0  # jobs submitted so far
        self._rows = 0  # rows of the generate jobs queued
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the event loop the handlers run on
        self._jobs: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._paused = False
        self._closed = False
        self.steps = 0
        self.busy = False
        self.recent: deque[StepInfo] = deque(maxlen=64)
        self._thread = threading.Thread(target=self._loop, name="tidal-serve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ client side (event loop)

    async def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, eager: bool = False
    ) -> GenerateResult:
        """``eager``: the rows came as one batched request; the step need not wait for more to arrive."""
        job = _Job(concurrent.futures.Future(), prompts=prompts, sampling=sampling, eager=eager)
        return await self._submit(job)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread, after every job queued before it."""
        return await self._submit(_Job(concurrent.futures.Future(), fn=fn))

    async def _submit(self, job: _Job) -> Any:
        self._event_loop = asyncio.get_running_loop()
        with self._cv:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._jobs.append(job)
            self._last_arrival = time.monotonic()
            self._arrivals += 1
            self._rows += len(job.prompts) if job.is_generate else 0
            # Wake the engine thread only when this job can change what it does; a request in the middle of
            # a burst need not (it would take the GIL from the event loop that is parsing the rest).
            if len(self._jobs) == 1 or not job.is_generate or job.eager or self._rows >= self.fill_rows:
                self._cv.notify()
        return await asyncio.wrap_future(job.future)

    def pause(self, mode: str) -> int:
        """Hold queued generates (``abort``: finish them now as aborted); returns how many were aborted."""
        with self._cv:
            self._paused = True
            aborted = 0
            if mode == "abort":
                keep: deque[_Job] = deque()
                for job in self._jobs:
                    if job.is_generate:
                        job.future.set_result(GenerateResult([], None, aborted=True))
                        aborted += 1
                        self._rows -= len(job.prompts)
                    else:
                        keep.append(job)
                self._jobs = keep
            return aborted

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    @property
    def paused(self) -> bool:
        return self._paused

    def queued(self) -> int:
        with self._cv:
            return len(self._jobs)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for job in self._jobs:
                job.future.set_exception(RuntimeError("the server is shutting down"))
            self._jobs.clear()
            self._cv.notify()

    # ------------------------------------------------------------------ engine thread

    def _all_eager(self) -> bool:
        return all(job.eager for job in self._jobs if job.is_generate)

    def _queued_rows(self) -> int:
        rows = 0
        for job in self._jobs:
            if not job.is_generate:
                break
            rows += len(job.prompts)
        return rows

    def _next(self) -> list[_Job] | None:
        """Block until work is runnable: one non-generate job, or the generate jobs of the next step."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                if self._jobs and not self._jobs[0].is_generate:
                    return [self._jobs.popleft()]
                if self._jobs and not self._paused:
                    if self._queued_rows() < self.fill_rows and not self._all_eager():
                        quiet = time.monotonic() - self._last_arrival
                        if quiet < self.wait_s:
                            self._cv.wait(self.wait_s - quiet)  # more of the burst may be on its way
                            continue
                        if not self._loop_caught_up():
                            continue  # the event loop was still queueing the burst: wait for its end again
                    batch, rows = [], 0
                    while self._jobs and self._jobs[0].is_generate:
                        n = len(self._jobs[0].prompts)
                        if batch and rows + n > self.max_rows:
                            break
                        batch.append(self._jobs.popleft())
                        rows += n
                    self._rows -= rows
                    return batch
                if self._paused and any(not j.is_generate for j in self._jobs):
                    # A paused queue still runs weight updates and memory calls, in their order.
                    for i, job in enumerate(self._jobs):
                        if not job.is_generate:
                            del self._jobs[i]
                            return [job]
                self._cv.wait()

    def _loop_caught_up(self) -> bool:
        """Called with the lock held, after ``wait_s`` without an arrival: whether the event loop, given two
        turns, queued nothing more. A burst's requests reach the queue only when the loop runs their
        handlers, after it parsed every request that came in with them; a loop busy parsing a big burst
        looks quiet from here, and without this check a step would start with its first few rows."""
        loop, mark = self._event_loop, self._arrivals
        if loop is None or loop.is_closed():
            return True
        self._cv.release()
        try:
            asyncio.run_coroutine_threadsafe(_two_turns(), loop).result(timeout=max(1.0, 20 * self.wait_s))
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # a loop that does not answer has nothing more to queue
        finally:
            self._cv.acquire()
        return self._arrivals == mark

    def _loop(self) -> None:
        while (jobs := self._next()) is not None:
            self.busy = True
            try:
                if jobs[0].is_generate:
                    self._run_step(jobs)
                else:
                    self._run_call(jobs[0])
            finally:
                self.busy = False

    @staticmethod
    def _run_call(job: _Job) -> None:
        try:
            job.future.set_result(job.fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting request
            job.future.set_exception(e)

    def _run_step(self, jobs: list[_Job]) -> None:
        groups: dict[tuple, list[_Job]] = {}
        for job in jobs:
            groups.setdefault(_key(job.sampling), []).append(job)
        for group in groups.values():
            samples = [
                Sample(index=i, group=i, prompt=None, prompt_ids=list(p))
                for i, p in enumerate(p for job in group for p in job.prompts)
            ]
            self.steps += 1
            info = StepInfo(step=self.steps, requests=len(group), rows=len(samples))
            info.started = time.monotonic()
            try:
                out = self.engine.generate(samples, group[0].sampling)
            except BaseException as e:  # noqa: BLE001 - every request of the step gets the error
                for job in group:
                    job.future.set_exception(e)
                continue
            info.ended = time.monotonic()
            info.seconds = info.ended - info.started
            self.recent.append(info)
            log.debug("engine step %d: %d requests, %d rows, %.3f s", info.step, info.requests, info.rows, info.seconds)
            lo = 0
            for job in group:
                part = out[lo : lo + len(job.prompts)]
                lo += len(job.prompts)
                job.future.set_result(GenerateResult(part, info))
