"""One thread owns the engine; HTTP handlers hand it work through a queue, and concurrent generates share a step.

The embedded engine is not thread-safe and samples a whole batch per ``generate`` call. So every
engine call of the server goes through ``EngineWorker``: a single thread takes jobs off a queue in
arrival order. A generate job that reaches the head of the queue takes every other generate job
queued behind it (up to the first non-generate job, which is a barrier: a weight update never
overtakes a request sent before it, and no request sent after it runs on the old weights) and up to
``max_rows`` rows; the jobs are grouped by sampling parameters (the engine takes one set per call)
and each group runs as one engine step. So that a burst of requests (a rollout sent as one request
per sample) is not cut into a one-row step and the rest, a step starts only once the engine's batch
of rows (``--rollout-max-batch``) is queued or no request arrived for ``--serve-batch-wait-ms``; a
batch the client sent as one request (a list of prompts) starts at once.

Rows that arrive while a step runs join it (continuous batching across HTTP requests): when they
have the step's sampling parameters, fit the engine's batch beside the step's rows, number at least a
quarter of them (a cut prefills the step's rows again) and the step has run for ``admit_after_s``,
the worker cuts the step at the decoder's next host sync (the engine's
``pause_generation``, every few decode steps); requests whose rows all finished are answered then,
and the unfinished rows go back to the head of the queue with the tokens they have, to continue in
the next step beside the new rows (their prompt and partial response prefilled again, as SGLang's
``retract`` recomputes a retracted request). Each row keeps its own token budget and log-probs.
A request is answered as soon as its rows end, from inside the step (the engine's ``on_done``: the
fast decoder hands rows that ended on at its host syncs), not when the whole step ends.

Pause (SGLang's ``/pause_generation``, whose reply waits until no engine step runs): a running step
is cut at its next host sync in every mode. ``abort`` answers every request of the running step and
of the queue at once, with an ``abort`` finish reason and the tokens each row had (none for queued
ones). ``retract`` and ``in_place`` keep them: the running step's unfinished rows go back to the
queue with their tokens, and continue after ``/continue_generation`` (here ``in_place`` recomputes
the rows' KV cache too: the engine keeps no decode state between calls). Requests that arrive while
paused wait for ``/continue_generation``; other jobs (weight updates, memory) still run meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tidal.rollout.types import Sample, SamplingParams
from tidal.serve.clocks import GcClock, cpu_clocks, cpu_spent, decode_figures

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
    # CPU seconds during the engine call of the engine's thread and of the event loop's thread: the loop
    # busy while the engine decodes takes the GIL from it (None where the loop's clock is unreadable).
    engine_cpu_seconds: float = 0.0
    loop_cpu_seconds: float | None = None
    gc_seconds: float = 0.0  # in the garbage collector meanwhile (any thread)
    gc_passes: tuple[int, int, int] = (0, 0, 0)  # its collections of generations 0, 1, 2
    new_tokens: int = 0  # tokens the step added to its rows
    cut_rows: int = 0  # rows the step left unfinished (cut for ``cut_for``): continued later, or aborted
    cut_for: str = ""  # "admission" (rows joined) or "pause" (/pause_generation); "" when it ran to its end
    # The fast decoder's figures for the step's last chunk (``decode_figures``): prefill and decode-loop seconds,
    # decode steps, CUDA graph captures; the rest of ``seconds`` is the engine's work around the decoder.
    decoder: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GenerateResult:
    samples: list[Sample]
    step: StepInfo | None  # the step that ended the request's rows; None: aborted before any ran
    aborted: bool = False  # answered by an abort pause, rows cut short (status ``aborted``) or never started


@dataclasses.dataclass
class _Job:
    future: asyncio.Future  # of the event loop that submitted the job; settled there (``_settle``)
    prompts: list[list[int]] | None = None  # generate job
    sampling: SamplingParams | None = None
    fn: Callable[[], Any] | None = None  # any other engine call
    eager: bool = False  # part of a batch the client sent as one request: no burst to wait for
    # Built on the event loop at submit time, while the engine thread waits for the burst's end, so the
    # step starts without a pass over every row first.
    samples: list[Sample] = dataclasses.field(default_factory=list)
    key: tuple = ()
    answered: bool = False  # settled from inside its step, as soon as all its rows ended

    @property
    def is_generate(self) -> bool:
        return self.prompts is not None


async def _two_turns() -> None:
    """Returns after the event loop ran everything that was ready when it started, and what that scheduled."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


# Rows join a running step only when they are at least 1/ADMIT_SHARE of its rows: each cut prefills the
# step's rows (prompt and response so far) again, which a handful of new rows would not pay for.
ADMIT_SHARE = 4


def _key(s: SamplingParams) -> tuple:
    return (s.temperature, s.top_p, s.top_k, s.max_new_tokens, tuple(s.stop), tuple(s.stop_token_ids), s.seed)


class EngineWorker:
    """``max_rows``: rows one step may take; ``fill_rows`` / ``wait_s``: a step starts once ``fill_rows``
    rows are queued or no request arrived for ``wait_s`` (a burst of requests becomes one step);
    ``admit_after_s``: rows arriving while a step runs join it once it ran this long (bounds how often a
    step's rows are prefilled again), if the step and they fit ``fill_rows`` and they are at least
    ``1/ADMIT_SHARE`` of its rows."""

    def __init__(
        self,
        engine,
        *,
        max_rows: int = 4096,
        fill_rows: int = 512,
        wait_s: float = 0.05,
        admit_after_s: float = 0.2,
    ) -> None:
        self.engine = engine
        self.max_rows = max_rows
        self.fill_rows = min(fill_rows, max_rows)
        self.wait_s = wait_s
        self.admit_after_s = admit_after_s
        self._pause_mode: str | None = None  # of /pause_generation, until /continue_generation
        self._running: list[_Job] = []  # jobs of the engine step running now
        self._running_since = 0.0
        self._cut_for = ""  # why the running step was asked to stop early ("" = it was not)
        self._admit_timer = None  # a later admission check, scheduled on the event loop
        # Pause calls waiting for the running step to return, with the requests they aborted meanwhile.
        self._drained: list[tuple[asyncio.Future, int]] = []
        self._last_arrival = 0.0
        self._arrivals = 0  # jobs submitted so far
        self._rows = 0  # rows of the generate jobs queued
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the event loop the handlers run on
        self._loop_thread: int | None = None  # its thread's ident
        self._jobs: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.steps = 0
        self.busy = False
        self.recent: deque[StepInfo] = deque(maxlen=64)
        GcClock.start()
        self._thread = threading.Thread(target=self._loop, name="tidal-serve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ client side (event loop)

    async def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, eager: bool = False
    ) -> GenerateResult:
        """``eager``: the rows came as one batched request; the step need not wait for more to arrive."""
        return await self.submit_generate(prompts, sampling, eager=eager)

    def submit_generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, eager: bool = False
    ) -> asyncio.Future:
        """Queue the rows now (no task in between, so the queue holds them when this returns); the future
        gets their ``GenerateResult``. Call it on the event loop."""
        loop = asyncio.get_running_loop()
        samples = [Sample(index=0, group=0, prompt=None, prompt_ids=list(p)) for p in prompts]
        job = _Job(loop.create_future(), prompts, sampling, eager=eager, samples=samples, key=_key(sampling))
        return self._submit(job, loop)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread, after every job queued before it."""
        loop = asyncio.get_running_loop()
        return await self._submit(_Job(loop.create_future(), fn=fn), loop)

    def _submit(self, job: _Job, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        self._event_loop, self._loop_thread = loop, threading.get_ident()
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
            if job.is_generate and self._running:
                self._maybe_admit()
        return job.future

    def _maybe_admit(self) -> None:
        """With the lock held, on the event loop: cut the running step so that the queued rows join it, when
        they share its sampling parameters, fit beside it and it ran ``admit_after_s``; else check again then."""
        if not self._running or self._cut_for or self._pause_mode is not None:
            return
        key, rows = self._running[0].key, sum(len(j.prompts) for j in self._running)
        waiting = 0
        for job in self._jobs:
            if not job.is_generate:
                break  # rows behind a barrier never join a step that began before it
            waiting += len(job.prompts) if job.key == key else 0
        if waiting == 0 or rows + waiting > self.fill_rows or ADMIT_SHARE * waiting < rows:
            return  # none, too many, or too few to pay for prefilling the step's rows again
        left = self._running_since + self.admit_after_s - time.monotonic()
        if left > 0:
            if self._admit_timer is None and self._event_loop is not None:
                self._admit_timer = self._event_loop.call_later(left, self._admit_later)
            return
        self._cut("admission")

    def _admit_later(self) -> None:
        with self._cv:
            self._admit_timer = None
            self._maybe_admit()

    def _cut(self, why: str) -> None:
        """Ask the engine to end the running step at its next host sync (rows cut short come back ``aborted``)."""
        self._cut_for = why
        stop = getattr(self.engine, "pause_generation", None)
        if stop is not None:
            stop()

    def pause(self, mode: str) -> asyncio.Future:
        """Pause generation (SGLang's modes, see the module docstring); the future (of the calling event
        loop) gets the number of requests answered as aborted once no engine step runs."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._cv:
            self._pause_mode = mode
            aborted = 0
            if mode == "abort":
                keep: deque[_Job] = deque()
                settled = []
                for job in self._jobs:
                    if job.is_generate:
                        for s in job.samples:
                            s.status = "aborted" if s.status == "pending" else s.status
                        settled.append((job, GenerateResult(job.samples, None, aborted=True), None))
                        self._rows -= len(job.prompts)
                    else:
                        keep.append(job)
                self._jobs = keep
                _settle_soon(settled)
                aborted = len(settled)
            if self._running:
                self._cut("pause")
                self._drained.append((done, aborted))
            else:
                done.set_result(aborted)
        return done

    def resume(self) -> None:
        with self._cv:
            self._pause_mode = None
            go = getattr(self.engine, "continue_generation", None)
            if go is not None and not self._running:
                go()
            self._cv.notify()

    @property
    def paused(self) -> bool:
        return self._pause_mode is not None

    def running_rows(self) -> int:
        with self._cv:
            return sum(len(j.prompts) for j in self._running)

    def queued(self) -> int:
        with self._cv:
            return len(self._jobs)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            _settle_soon([(job, None, RuntimeError("the server is shutting down")) for job in self._jobs])
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
                if self._jobs and self._pause_mode is None:
                    if self._queued_rows() < self.fill_rows and not self._all_eager():
                        quiet = time.monotonic() - self._last_arrival
                        if quiet < self.wait_s:
                            self._cv.wait(self.wait_s - quiet)  # more of the burst may be on its way
                            continue
                        if not self._loop_caught_up():
                            continue  # the event loop was still queueing the burst: wait for its end again
                        if self._pause_mode is not None or not self._jobs or not self._jobs[0].is_generate:
                            continue  # a pause (or its abort) came while the lock was released: look again
                    batch, rows = [], 0
                    while self._jobs and self._jobs[0].is_generate:
                        n = len(self._jobs[0].prompts)
                        if batch and rows + n > self.max_rows:
                            break
                        batch.append(self._jobs.popleft())
                        rows += n
                    self._rows -= rows
                    return batch
                if self._pause_mode is not None and any(not j.is_generate for j in self._jobs):
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
            if not jobs:
                continue
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
            settled = (job, job.fn(), None)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting request
            settled = (job, None, e)
        _settle_soon([settled])

    def _run_step(self, jobs: list[_Job]) -> None:
        groups: dict[tuple, list[_Job]] = {}
        for job in jobs:
            groups.setdefault(job.key, []).append(job)
        order = list(groups.values())
        for i, group in enumerate(order):
            with self._cv:
                if self._pause_mode is not None:  # paused between two groups: the rest is held (or aborted) too
                    self._end_step([j for g in order[i:] for j in g], None, None)
                    return
                self._running, self._running_since, self._cut_for = group, time.monotonic(), ""
                if self._jobs:
                    self._maybe_admit_soon()
            try:
                info, error = self._run_group(group)
                with self._cv:
                    self._end_step(group, info, error, enable_gc=True)
            except BaseException:
                gc.enable()  # else the event loop turns it back on once the step's replies are rendered
                raise

    def _maybe_admit_soon(self) -> None:
        loop = self._event_loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._admit_later)  # rows queued before the step began may join it

    def _run_group(self, group: list[_Job]) -> tuple[StepInfo, BaseException | None]:
        """One engine call over the rows of ``group`` (one set of sampling parameters); each job's samples are
        replaced by what the engine returned for them."""
        samples = [s for job in group for s in job.samples]
        for i, s in enumerate(samples):
            s.index = s.group = i
        self.steps += 1
        info = StepInfo(step=self.steps, requests=len(group), rows=len(samples))
        before = sum(len(s.response_ids) for s in samples)
        info.started = time.monotonic()
        clocks, gc0, passes = cpu_clocks(self._loop_thread), GcClock.seconds, list(GcClock.passes)
        # A collection stops every thread, the decode loop's too: none during the step, nor until its replies
        # are rendered (``_end_step`` has the event loop turn the collector back on after them).
        gc.disable()
        try:
            out = self.engine.generate(samples, group[0].sampling, self._answer_early(group, info))
        except BaseException as e:  # noqa: BLE001 - every request of the step gets the error
            return info, e
        info.ended = time.monotonic()
        info.decoder = decode_figures(self.engine)
        info.seconds = info.ended - info.started
        info.engine_cpu_seconds, info.loop_cpu_seconds = cpu_spent(self._loop_thread, clocks)
        info.gc_seconds = GcClock.seconds - gc0
        info.gc_passes = tuple(b - a for a, b in zip(passes, GcClock.passes))
        info.new_tokens = sum(len(s.response_ids) for s in out) - before
        lo = 0
        for job in group:
            job.samples, lo = out[lo : lo + len(job.prompts)], lo + len(job.prompts)
        return info, None

    def _answer_early(self, group: list[_Job], info: StepInfo):
        """The engine's ``on_done`` for a step: a request whose rows have all ended is answered at once, while
        the step goes on for the others (its reply names the step; its ``ended`` is when it was answered)."""
        owner = [job for job in group for _ in job.samples]
        left = {id(job): sum(s.status in ("pending", "aborted") for s in job.samples) for job in group}

        def on_done(samples: list[Sample]) -> None:
            now, settled = time.monotonic(), []
            for s in samples:
                job = owner[s.index]
                left[id(job)] -= 1
                if left[id(job)] == 0:
                    job.answered = True
                    settled.append((job, GenerateResult(job.samples, dataclasses.replace(info, ended=now)), None))
            _settle_soon(settled)

        return on_done

    def _end_step(
        self, group: list[_Job], info: StepInfo | None, error: BaseException | None, enable_gc: bool = False
    ) -> None:
        """With the lock held: answer the jobs of the step that ended (or of groups a pause held back before
        they ran: ``info`` None); jobs with rows cut short go back to the head of the queue, or are answered
        as aborted under an abort pause."""
        why, self._cut_for, self._running, self._admit_timer = self._cut_for, "", [], None
        if self._pause_mode is None:
            go = getattr(self.engine, "continue_generation", None)
            if go is not None:
                go()  # the cut was for admission: the next step runs
        settled, again, aborted = [], [], 0
        for job in group:
            if job.answered:
                continue  # its rows ended inside the step and it was answered then
            if error is not None:
                settled.append((job, None, error))
                continue
            cut = [s for s in job.samples if s.status in ("pending", "aborted")]
            if cut and self._pause_mode == "abort":
                for s in cut:
                    s.status = "aborted"
                settled.append((job, GenerateResult(job.samples, info, aborted=True), None))
                aborted += 1
            elif cut and (why or info is None):
                again.append(job)
            else:
                settled.append((job, GenerateResult(job.samples, info), None))
        if info is not None:
            info.cut_rows = sum(1 for job in group for s in job.samples if s.status in ("pending", "aborted"))
            info.cut_for = why if info.cut_rows else ""
            self.recent.append(info)
            log.debug("engine step %d: %d requests, %d rows, %.3f s", info.step, info.requests, info.rows, info.seconds)
        self._jobs.extendleft(reversed(again))
        self._rows += sum(len(job.prompts) for job in again)
        drained, self._drained = self._drained, []
        for future, count in drained:
            settled.append((_Waiter(future), count + aborted, None))
        _settle_soon(settled, enable_gc)
        self._cv.notify()


@dataclasses.dataclass
class _Waiter:
    """A pause call waiting for the running step to end, settled like a job."""

    future: asyncio.Future


def _settle(items: list[tuple[_Job | _Waiter, Any, BaseException | None]], enable_gc: bool = False) -> None:
    """On the event loop: each job's future gets its result or error (a request that went away is skipped).
    ``enable_gc``: turn the collector back on once the handlers woken here have run (rendered their replies)."""
    for job, result, error in items:
        if job.future.done():
            continue
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)
    if enable_gc:
        asyncio.get_running_loop().call_soon(gc.enable)  # after the wake-ups set_result scheduled


def _settle_soon(items: list[tuple[_Job | _Waiter, Any, BaseException | None]], enable_gc: bool = False) -> None:
    """Hand every result of a step to the event loop in one call: one wake-up of the loop, and its handlers
    all resume in the same turn, instead of one thread-safe call (a wake-up and a callback chain) per request.
    ``enable_gc``: the step ran with the collector off; it stays off until its replies are rendered (each
    reply's log-prob triples are tracked objects: thousands per step that would trigger collections)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for item in items:
        by_loop.setdefault(item[0].future.get_loop(), []).append(item)
    for i, (loop, part) in enumerate(by_loop.items()):
        try:
            loop.call_soon_threadsafe(_settle, part, enable_gc and i == len(by_loop) - 1)
        except RuntimeError:
            pass  # that loop is closed: nobody waits on these futures any more
        else:
            if i == len(by_loop) - 1:
                enable_gc = False
    if enable_gc:
        gc.enable()
