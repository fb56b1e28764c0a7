"""The training loop, in colocation order.

Trainer and engines take turns on the same devices, so the order of calls below *is* the memory
plan: engine memory is released before the trainer wakes, engine weights come back before the
sync and the KV cache only after it, so the peak is weights + sync buffers, never + KV.

    generate -> reward -> advantages                 engines AWAKE, trainer PAUSED (or coming back early)
    release engine memory                            engines ASLEEP
    resume trainer -> train                          trainer ACTIVE only here
    pause trainer's optimizer state and grads        trainer WEIGHTS_ONLY
    resume engine weights -> sync (live weights) -> pause trainer's weights -> resume engine KV
    [eval] [save]

With ``--train-resume-early`` (by default the weights on GPU where the memory plan fits them) the trainer's
resume is sent before the generate and its copy from the host runs while the engines decode; the train still
waits for it. Where the weights would so come back at the next generate, the sync keeps them instead of pausing
them (``keep_trainer_weights``; not before an evaluation, a checkpoint or the end): the trainer stays
WEIGHTS_ONLY beside the KV cache, as it would be once resumed early, and its weights are never copied out and back.

Run it with ``tidal train`` (the embedded default: a tiny model on the built-in task). With
``--async one-step|full`` the same session runs ``tidal.driver_async`` instead (docs/async.md).

torch and the rollout functions are imported where they are used: the session reads its inputs
(and imports them) beside Ray's start-up, so the command's own start does not wait for them.
"""

from __future__ import annotations

import logging

from tidal.config.schema import TidalConfig
from tidal.rollout.types import SampleBatch
from tidal.steps import (
    Timer,
    finish_step,
    keep_trainer_weights,
    pause_after_early_resume,
    resume_trainer,
    resume_trainer_early,
    sync_weights,
)

log = logging.getLogger(__name__)


def train(cfg: TidalConfig, on_step=None, *, freeze_start: bool = False) -> dict:
    """Run the loop described in the module docstring; returns the last step's metrics.

    ``on_step(session, rollout_id, row)``, if given, is called after the initial sync (rollout_id
    -1) and after each step; tests use it to compare trainer and engine weights after every sync.
    ``freeze_start``: this process is the run's own (``tidal train``), started with the garbage
    collector off; once the session is up, everything alive is frozen out of the collector and it is
    turned on again (see ``tidal.cli.cmd_train``).
    """
    from tidal.session import Session

    with Session(cfg) as s:
        if freeze_start:
            import gc

            gc.freeze()
            gc.enable()
        try:
            if cfg.rollout.debug_rollout_only:
                return rollout_only(s, on_step)
            if cfg.rollout.async_mode != "off":
                from tidal.driver_async import run

                return run(s, on_step)
            return _loop(s, on_step)
        except Exception as e:
            short = _one_line(s, e)
            if short is e:
                raise
            raise short from None


def _one_line(s, e: BaseException) -> BaseException:
    """A trainer rank or an engine that died outside generation: one line with the checkpoint to resume from."""
    from ray.exceptions import RayActorError

    from tidal.errors import RunFailed, is_engine_death

    if isinstance(e, RunFailed):
        return e
    trainers = {a._actor_id.hex() for a in getattr(s.trainer, "actors", [])}
    if isinstance(e, RayActorError) and getattr(e, "actor_id", None) in trainers:
        return s.trainer_died(e)
    if is_engine_death(e):
        return RunFailed(f"an engine died and could not be restarted there: {_last(e)}{s.checkpoint_hint()}")
    return e


def _last(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def _loop(s, on_step) -> dict:
    """The steps of one run inside an open session (see the module docstring)."""
    from tidal.rollout import orchestrate
    from tidal.rollout.buffer import PromptCursor

    cfg = s.cfg
    trainer, display = s.trainer, s.display
    offload_train, offload_rollout = cfg.memory.offload_train, cfg.memory.offload_rollout
    profiled = {int(k) for k in cfg.logging.profile_rollouts}
    # Prompts by serial, as in the async loops: a checkpoint's data position and the prompts done past it
    # (an async run's, whose groups finished out of order) are honoured here too.
    s.cursor = PromptCursor(s.dataset)
    start = s.resume_from_checkpoint()
    if offload_train:  # optimizer state and gradients now, the weights once the sync has read them
        s.timeline_mark("trainer init", trainer.call("pause", keep_weights=True).after)
    row: dict = sync_weights(s, first=True, release_trainer=offload_train)
    s.mark_startup("startup_synced_s")
    if on_step is not None:
        on_step(s, start - 1, row)
    # The curve's first point: greedy eval accuracy of the starting weights (kept in step 0's row),
    # and where the time before it went.
    initial = dict(s.startup)
    if cfg.rollout.eval_interval and start == 0:
        initial = {f"{k}_initial": v for k, v in orchestrate.evaluate(s).items()}
        initial["eval_initial_elapsed_s"] = round(s.run.elapsed(), 3)
    kept = False  # the last sync kept the paused trainer's weights on the device (keep_trainer_weights)
    for rollout_id in range(start, cfg.rollout.num_rollout):
        if kept and s.stop.requested:  # the save below reads a whole trainer: the kept weights are paused first
            s.trainer.call("pause")
            kept = False
        s.check_stop(rollout_id - 1)  # the safe point: SIGTERM saves the last finished step and stops
        t = Timer()
        if rollout_id in profiled:
            arm_profiles(s, rollout_id)
        early = resume_trainer_early(s, rollout_id, start, kept)  # --train-resume-early: beside the generate
        with t("generate", display):
            samples, gen_metrics = orchestrate.generate_rollout(s, rollout_id)
        s.cursor.finish_drawn()  # trained below, or dropped (dynamic sampling, over-sampling)
        s.log_samples(rollout_id, samples)
        if offload_rollout:
            with t("release", display):
                s.timeline_mark("engines released", release_engines(s))
        train_metrics: dict = {}
        if samples:
            if offload_train:
                with t("resume", display):
                    resumed = resume_trainer(s, early)  # its metrics: memory/trainer_resume/*, per state class
                    s.timeline_mark("trainer resumed", resumed.after)
                train_metrics.update(resumed.metrics)
            with t("train", display):
                train_metrics.update(trainer.call("train", SampleBatch(samples), rollout_id))
            if offload_train:
                with t("pause", display):  # the weights stay for the sync, which pauses them (sync_s)
                    paused = trainer.call("pause", keep_weights=True)
                    s.timeline_mark("trainer state paused", paused.after)
                train_metrics.update(paused.metrics)
        else:
            train_metrics.update(pause_after_early_resume(s, early, kept))
        kept = bool(samples) and keep_trainer_weights(s, rollout_id)
        with t("sync", display):
            sync_metrics = sync_weights(s, release_trainer=offload_train and bool(samples), keep_weights=kept)
        metrics = {**initial, **gen_metrics, **train_metrics, **sync_metrics, **t, **s.memory_metrics()}
        metrics["train_samples"] = len(samples)
        initial = {}
        metrics["engine_restarts"], s.step_restarts = s.step_restarts, 0
        row = finish_step(s, rollout_id, metrics, t, on_step)
    s.check_stop(cfg.rollout.num_rollout - 1)
    return row


def rollout_only(s, on_step=None) -> dict:
    """``--debug-rollout-only``: generate, score and evaluate every rollout; no trainer exists, nothing syncs."""
    from tidal.rollout import orchestrate

    row: dict = {}
    for rollout_id in range(s.cfg.rollout.num_rollout):
        s.check_stop(rollout_id - 1)
        t = Timer()
        if rollout_id in {int(k) for k in s.cfg.logging.profile_rollouts}:
            arm_profiles(s, rollout_id)
        with t("generate", s.display):
            samples, gen_metrics = orchestrate.generate_rollout(s, rollout_id)
        s.log_samples(rollout_id, samples)
        metrics = {**gen_metrics, **t, **s.memory_metrics()}
        metrics["engine_restarts"], s.step_restarts = s.step_restarts, 0
        row = finish_step(s, rollout_id, metrics, t, on_step)
    return row


def arm_profiles(s, rollout_id: int) -> None:
    """``--profile-rollouts``: the rollout's next generate on each engine and its train on trainer rank 0 run under
    torch.profiler, each writing ``rollout<id>-<phase>[-engine<rank>].json`` (kernels by category, the top ones)
    and ``.trace.json`` (a Chrome trace) into ``<output-dir>/profiles/`` on the actor's node."""
    import os

    from tidal.profiling import ProfileRequest

    folder = os.path.join(s.cfg.logging.output_dir, "profiles")
    answered = s.engines.call("profile_next", ProfileRequest(folder, f"rollout{rollout_id}-generate"))
    if not all(answered):
        engine = s.cfg.rollout.rollout_engine
        log.info(
            "rollout %d: engines of --rollout-engine %s are not profiled (use the server's own)", rollout_id, engine
        )
    if s.trainer is not None:
        s.trainer.call("profile_next", ProfileRequest(folder, f"rollout{rollout_id}-train"))


def release_engines(s):
    """Release every engine's memory; returns engine 0's memory figures after it. An engine that dies
    here is restarted and resynced (``Session.survive_engine_death``), then every engine is released."""
    from tidal.rollout.engine import TAGS

    try:
        return s.engines.call("release_memory", list(TAGS))[0].after
    except Exception as e:  # noqa: BLE001 - only an engine's death is survived
        s.survive_engine_death(e, "releasing memory", new_version=False)
        return s.engines.call("release_memory", list(TAGS))[0].after
