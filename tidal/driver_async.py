"""The asynchronous loop: engines generate while the trainer trains (``--async one-step`` and ``--async full``).

Trainer and engines hold their memory the whole run (no offload: the ``async`` config rule), on
their own devices or, on one GPU, side by side. Every sample carries the weight version that
generated it; the trainer's loss takes the engine's log-probs as the behaviour policy with the
configured correction (``--use-tis`` unless another is chosen).

one-step, in the order of slime's ``train_async.py``: rollout k+1 is generated on the weights
before step k while step k trains, and the weights are synced only after that generation ended,
so every sample is exactly one version behind the trainer:

    wait for rollout k's generation                        (started one step earlier)
    start generating rollout k+1                           engines on version v
    train on rollout k                                     trainer v -> v+1, engines busy
    wait for rollout k+1's generation; sync (version v+1)
    start generating rollout k+2 (unless an eval is due)   engines on version v+1
    [eval] [save]; the next step finds rollout k+1 ready and k+2 in flight

full: every engine always has one call of whole prompt groups in flight, as long as the bounded
buffer (``--async-buffer-size`` groups, buffered plus in flight) has room. The trainer takes the
oldest ``--rollout-batch-size`` groups as soon as they are there, after dropping (and counting)
those more than ``--max-staleness`` versions behind it. After each step the calls in flight finish
on the old weights (an engine would apply an update only after its call anyway, and an engine that
died shows it there, not in the middle of a sync), then the weights are pushed:

    drop stale groups; wait until a batch is buffered      engines generate
    train on it                                            engines keep generating
    collect the calls in flight (old weights); sync        no call starts until the sync is done
    [eval] [save]

With ``--partial-rollout`` (full only) the calls in flight are not waited for before a sync: each
engine is asked to pause (``pause_generation``), its call returns at the next step boundary with the
rows it cut short ``aborted``, and after the sync those chunks are sent back and continued from
where they stopped on the new weights, each token's weight version recorded in the sample.

Prompts are counted by serial (``tidal.rollout.buffer.PromptCursor``): a checkpoint records the
first prompt not yet trained or dropped and the finished ones after it, so a resumed run neither
skips nor repeats one; groups in flight at a stop (SIGTERM, the end) are generated again on resume.
"""

from __future__ import annotations

import time

from tidal.errors import ray_get as get
from tidal.rollout.buffer import Group, GroupBuffer, PromptCursor
from tidal.rollout.inflight import Finished, InFlight
from tidal.rollout.orchestrate import decode_metrics
from tidal.rollout.types import SampleBatch
from tidal.steps import Timer, eval_due, finish_step, sync_weights


def run(s, on_step=None) -> dict:
    """Run ``--async one-step`` or ``--async full`` inside an open session; returns the last step's metrics."""
    s.cursor = PromptCursor(s.dataset)
    start = s.resume_from_checkpoint()
    row = sync_weights(s, first=True)
    s.last_sync_version = row["sync/version"]
    if on_step is not None:
        on_step(s, start - 1, row)
    loop = s.async_loop = OneStep(s) if s.cfg.rollout.async_mode == "one-step" else Full(s)
    for rollout_id in range(start, s.cfg.rollout.num_rollout):
        s.check_stop(rollout_id - 1)  # the safe point; the checkpoint's data position excludes groups in flight
        row = loop.step(rollout_id, on_step)
    s.check_stop(s.cfg.rollout.num_rollout - 1)
    return row


class _Loop:
    def __init__(self, s):
        self.s, self.r = s, s.cfg.rollout
        self.flight = InFlight(s)
        self.ready: list[Group] = []  # kept groups not trained yet (one-step)
        self.gen_samples = 0
        self.filtered = 0
        self.engine_busy_s = 0.0
        self.dropped_serials: list[int] = []  # done without training: stale, or filtered by dynamic sampling
        self.trained_from = s.last_sync_version  # the weight version the step's training started from

    def pending_groups(self) -> int:
        """Groups generated or in flight, not trained yet."""
        return len(self.ready) + self.flight.groups_in_flight() + len(getattr(self, "buffer", ()))

    def collect(self, got: Finished) -> list[Group]:
        self.s.cursor.done(got.filtered)  # dynamic sampling dropped them: done, never trained
        self.dropped_serials += got.filtered
        self.filtered += len(got.filtered)
        self.gen_samples += sum(m["gen_samples"] for m in got.metrics)
        self.engine_busy_s += got.busy_s
        return got.groups

    def chunks(self, prompts: int) -> list[int]:
        """Prompt groups per engine for ``prompts`` prompts (whole groups, spread evenly)."""
        n = len(self.s.engines)
        return [prompts // n + (1 if i < prompts % n else 0) for i in range(n)]

    def train(self, rollout_id: int, groups: list[Group], t: Timer, while_training=None) -> dict:
        """Train on ``groups`` while ``while_training(train_refs)`` keeps the engines fed; marks them done."""
        samples = [x for g in groups for x in g.samples]
        self.s.log_samples(rollout_id, samples)
        self.trained_from = self.s.last_sync_version  # a restart's resync during the step must not move staleness
        self.flight.trainer_ahead = True
        refs = self.s.trainer.call_async("train", SampleBatch(samples), rollout_id)
        with t("train", self.s.display):
            if while_training is not None:
                while_training(refs)
            metrics = get(refs)[0]
        self.s.cursor.done(g.serial for g in groups)
        return metrics

    def sync(self) -> dict:
        """Engines with no call out are checked, then the weights are pushed (an engine that dies in it is
        restarted and resynced: ``sync_weights``)."""
        self.flight.restart_idle_dead()
        row = sync_weights(self.s)
        self.s.last_sync_version = row["sync/version"]
        self.flight.trainer_ahead = False
        return row

    def finish(self, rollout_id: int, groups: list[Group], metrics: dict, t: Timer, wall: float, on_step) -> dict:
        version = self.trained_from
        sync = metrics.pop("_sync")
        samples = [x for g in groups for x in g.samples]
        stale = [version - g.version for g in groups]
        rewards = [x.reward for x in samples]
        metrics.update(
            {
                "reward_mean": sum(rewards) / max(1, len(rewards)),
                "response_len_mean": sum(len(x.response_ids) for x in samples) / max(1, len(samples)),
                "gen_samples": self.gen_samples,
                "train_samples": len(samples),
                "async/staleness_mean": sum(stale) / max(1, len(stale)),
                "async/staleness_max": max(stale, default=0),
                "async/trainer_version": version,
                "async/partial_samples": sum(1 for x in samples if x.response_versions),
                "async/filtered_groups": self.filtered,
                "samples_per_s": len(samples) / wall if wall > 0 else 0.0,
                "trainer_busy_frac": t.get("train_s", 0.0) / wall if wall > 0 else 0.0,
                "engine_busy_frac": self.engine_busy_s / (wall * len(self.s.engines)) if wall > 0 else 0.0,
                **sync,
                **t,
                **self.s.memory_metrics(),
                **decode_metrics(self.s),  # the generate calls that ended since the last step
            }
        )
        self.gen_samples, self.filtered, self.engine_busy_s = 0, 0, 0.0
        metrics["engine_restarts"], self.s.step_restarts = self.s.step_restarts, 0
        return finish_step(self.s, rollout_id, metrics, t, on_step)


class OneStep(_Loop):
    def start_round(self) -> None:
        """Start one generation round (``--over-sampling-batch-size`` prompts) on every engine."""
        for engine, count in enumerate(self.chunks(self.r.over_sampling_batch_size)):
            if count:
                self.flight.start(engine, self.s.cursor.draw(count))

    def step(self, rollout_id: int, on_step) -> dict:
        s, t, t0 = self.s, Timer(), time.perf_counter()
        self.flight.mark()
        with t("generate", s.display):
            # The first step (or the first after a resume) generates its own rollout; later ones find it
            # generated, unless dynamic sampling kept too few (the round started at the last sync, or another).
            while len(self.ready) < self.r.rollout_batch_size:
                if not self.flight.calls:
                    self.start_round()
                self.ready += self.collect(self.flight.drain())
        groups, self.ready = self.ready[: self.r.rollout_batch_size], self.ready[self.r.rollout_batch_size :]
        if rollout_id + 1 < self.r.num_rollout and not self.flight.calls:
            self.start_round()  # rollout k+1, on the weights before this step
        metrics = self.train(rollout_id, groups, t)
        with t("wait", s.display):  # sync only after the generation in flight has finished
            self.ready += self.collect(self.flight.drain())
        with t("sync", s.display):
            metrics["_sync"] = self.sync()
        if rollout_id + 2 < self.r.num_rollout and not eval_due(s.cfg, rollout_id):
            # Rollout k+2 is generated on the weights just pushed, as it would be from the next step's start:
            # starting it now keeps the engines busy through this step's save, metrics line and hook, and the
            # next step's start. Not before an evaluation (it generates on the same engines, and would wait).
            self.start_round()
        return self.finish(rollout_id, groups, metrics, t, time.perf_counter() - t0, on_step)


class Full(_Loop):
    def __init__(self, s):
        super().__init__(s)
        self.buffer = GroupBuffer(self.r.async_buffer_size, self.r.max_staleness)
        self.per_call = max(1, -(-self.r.over_sampling_batch_size // len(s.engines)))

    def fill(self) -> None:
        """One call on every idle engine while the buffer has room (groups in flight count against it)."""
        for engine in self.flight.idle():
            room = self.buffer.room(self.flight.groups_in_flight())
            if room <= 0:
                return
            self.flight.start(engine, self.s.cursor.draw(min(room, self.per_call)))

    def pump(self, also: list | None = None) -> None:
        self.buffer.put(self.collect(self.flight.wait(also=also)))
        self.fill()

    def step(self, rollout_id: int, on_step) -> dict:
        s, t, t0 = self.s, Timer(), time.perf_counter()
        self.flight.mark()
        dropped = 0
        self.fill()
        with t("wait", s.display):  # the trainer waits for a batch
            while True:
                stale = self.buffer.drop_stale(s.last_sync_version)
                s.cursor.done(g.serial for g in stale)
                self.dropped_serials += [g.serial for g in stale]
                dropped += len(stale)
                if len(self.buffer) >= self.r.rollout_batch_size:
                    break
                self.pump()
        groups = self.buffer.take(self.r.rollout_batch_size)
        self.fill()  # the room the batch left: the engines generate while it trains

        def keep_generating(refs):
            import ray

            pending = list(refs)
            while pending:  # only the ranks still training wake the wait (a finished one would spin it)
                pending = ray.wait(pending, num_returns=len(pending), timeout=0)[1]
                if pending:
                    self.pump(also=pending)

        metrics = self.train(rollout_id, groups, t, keep_generating)
        with t("drain", s.display):  # the calls in flight finish on the old weights (an update would wait for them)
            if self.r.partial_rollout:  # ... or stop at their next step, to be continued on the new weights
                self.flight.pause()
            self.buffer.put(self.collect(self.flight.drain()))
        with t("sync", s.display):  # no call starts during the sync
            metrics["_sync"] = self.sync()
        if rollout_id + 1 < self.r.num_rollout:  # after the last step nothing would use them
            self.flight.resume()
            self.fill()
        metrics["async/paused_groups"], self.flight.paused_groups = self.flight.paused_groups, 0
        metrics.update(
            {
                "async/dropped_groups": dropped,
                "async/dropped_total": self.buffer.dropped,
                "async/buffered_groups": len(self.buffer),
                "async/in_flight_groups": self.flight.groups_in_flight(),
            }
        )
        return self.finish(rollout_id, groups, metrics, t, time.perf_counter() - t0, on_step)
