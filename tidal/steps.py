"""The phases both loops share (``tidal.driver`` and ``tidal.driver_async``): phase timing, the weight sync, the step's end.

``sync_weights`` is the colocation order of a sync (engine weights back, push, KV cache back);
``resume_trainer_early`` / ``resume_trainer`` bring a paused trainer back beside the generate or after it;
``finish_step`` runs [eval] [save], logs the step's metrics and calls the ``on_step`` hook.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.errors import WeightSyncError

_RESUME = "memory/trainer_resume"

if TYPE_CHECKING:
    from tidal.memory.base import MemoryResult
    from tidal.weight_sync.base import SyncReport


class Timer(dict):
    """Collects ``<phase>_s`` seconds for the step line and metrics.jsonl."""

    @contextlib.contextmanager
    def __call__(self, phase: str, display=None):
        if display is not None:
            display.phase(phase)
        t = time.perf_counter()
        yield
        self[f"{phase}_s"] = self.get(f"{phase}_s", 0.0) + time.perf_counter() - t


def eval_due(cfg, rollout_id: int) -> bool:
    """Whether the step of ``rollout_id`` ends with an evaluation (``--eval-interval``)."""
    return bool(cfg.rollout.eval_interval) and (rollout_id + 1) % cfg.rollout.eval_interval == 0


def finish_step(s, rollout_id: int, metrics: dict, t: Timer, on_step=None) -> dict:
    """[eval] [save], then the step's metrics line, plots and the ``on_step`` hook; returns the row."""
    cfg, display = s.cfg, s.display
    if eval_due(cfg, rollout_id):
        with t("eval", display):
            from tidal.rollout import orchestrate  # torch: imported beside Ray's start by the session

            metrics.update(orchestrate.evaluate(s))
    if s.should_save(rollout_id):
        with t("save", display):
            s.save(rollout_id)
    row = s.run.log_step(rollout_id, metrics)
    display.step(row)
    s.after_step(rollout_id)
    if on_step is not None:
        on_step(s, rollout_id, row)
    return row


@dataclass
class EarlyResume:
    """A paused trainer's resume sent before the engines generate (``--train-resume-early``): ``refs`` of every
    rank's ``resume`` call, of its weights only (``weights_only``: the rest comes back after the generate)."""

    refs: list
    weights_only: bool


def resume_trainer_early(s, rollout_id: int, first_rollout: int, weights_kept: bool = False) -> EarlyResume | None:
    """Send the paused trainer's resume before the generate, so its copy from the host runs while the engines
    decode (``--train-resume-early all`` or ``weights``: rule ``resume-early`` derives weights on GPU where the
    memory plan fits them beside the generate phase); None where it waits for the generate's end. Never on a
    run's first rollout: the engines' first generate compiles and captures, with more memory than the plan counts
    for them. ``weights_kept``: the last sync kept the weights on the device (``keep_trainer_weights``), so
    ``weights`` has nothing to send and ``all`` sends the rest."""
    mode = s.cfg.memory.train_resume_early
    if not s.cfg.memory.offload_train or mode in (None, "off") or rollout_id == first_rollout:
        return None
    if weights_kept:
        return None if mode == "weights" else EarlyResume(s.trainer.call_async("resume"), False)
    weights_only = mode == "weights"
    return EarlyResume(s.trainer.call_async("resume", weights_only=weights_only), weights_only)


def keep_trainer_weights(s, rollout_id: int) -> bool:
    """Whether the sync ending ``rollout_id``'s step keeps the paused trainer's weights on the device: where the
    next generate would resume them early anyway (``--train-resume-early weights`` or ``all``; the memory plan
    fits them beside a generate), which then holds what it would have held, without their copy out and back.
    Not before an evaluation or a checkpoint (a save reads every state class from one place, an evaluation's
    first generate may capture graphs the plan does not count), nor after the last rollout."""
    cfg = s.cfg
    if not cfg.memory.offload_train or cfg.memory.train_resume_early not in ("weights", "all"):
        return False
    return rollout_id + 1 < cfg.rollout.num_rollout and not eval_due(cfg, rollout_id) and not s.should_save(rollout_id)


def resume_trainer(s, early: EarlyResume | None) -> MemoryResult:
    """The trainer ACTIVE for its train: an early resume awaited (and after a weights-only one the rest brought
    back now), else the whole resume now. Metrics: the resumes' (``memory/trainer_resume/...``, the later
    call's where both report a figure), ``.../early`` 1 and ``.../early_s`` the early call's own seconds."""
    from tidal.cluster.groups import get
    from tidal.memory.base import MemoryResult  # torch: imported beside Ray's start by the session

    if early is None:
        return s.trainer.call("resume")
    first: MemoryResult = get(early.refs)[0]
    later = s.trainer.call("resume") if early.weights_only else first
    metrics = {**first.metrics, **later.metrics}
    if first.metrics:  # rank 0's
        metrics[f"{_RESUME}/early"] = 1
        metrics[f"{_RESUME}/early_s"] = first.metrics.get(f"{_RESUME}/total_s", 0.0)
    return MemoryResult(metrics, later.after)


def pause_after_early_resume(s, early: EarlyResume | None, weights_kept: bool = False) -> dict:
    """A rollout that trains nothing (every group dropped) leaves the trainer paused: an early resume is undone,
    and weights the last sync kept are paused. Returns that pause's metrics (``memory/trainer_pause/...``; none
    where the trainer was paused already)."""
    from tidal.cluster.groups import get

    if early is None and not weights_kept:
        return {}
    if early is not None:
        get(early.refs)
    return s.trainer.call("pause").metrics


def sync_weights(s, first: bool = False, release_trainer: bool = False, keep_weights: bool = False) -> dict:
    """Resume engine weights -> trainer pushes the new version -> [trainer pauses its weights] -> resume engine
    KV cache.

    ``release_trainer``: the trainer is WEIGHTS_ONLY (``pause(keep_weights=True)`` after training), so the push
    reads its weights on the device; they are paused once the engines hold them and before the engines' KV
    cache comes back, so the device holds the trainer's weights beside a KV cache only where it would anyway:
    with ``keep_weights`` (``keep_trainer_weights``) the second stage only finishes the first
    (``settle_pause``) and the weights stay, where the next generate's early resume would have brought them
    back. Its pause figures (``memory/trainer_pause/...``, both stages) join the sync's metrics.

    An engine that dies during it is restarted and every engine resynced with the trainer's weights
    (``Session.survive_engine_death``: a new version when the trainer had not begun to push this one)."""
    cfg, trainer, engines = s.cfg, s.trainer, s.engines
    pushing, released = False, None
    resumed: dict[str, float] = {}  # engine 0's resume seconds, weights and KV cache: the sync's time beside the push
    try:
        if cfg.memory.offload_rollout:
            resumed["sync/engine_resume_weights_s"] = _seconds(engines.call("resume_memory", ["weights"]))
        pushing = True
        report: SyncReport = trainer.call("update_weights")
        versions = engines.call("get_weight_version")
        if any(v != report.version for v in versions):
            raise WeightSyncError(f"engines report weight versions {versions} after syncing version {report.version}")
        if release_trainer:
            released = trainer.call("settle_pause" if keep_weights else "pause")
        if cfg.memory.offload_rollout:
            resumed["sync/engine_resume_kv_s"] = _seconds(engines.call("resume_memory", ["kv_cache"]))
    except Exception as e:  # noqa: BLE001 - only an engine's death is survived
        report = s.survive_engine_death(e, "syncing weights", new_version=not pushing)
    if release_trainer and released is None:  # an engine died before: the resync read the live weights
        released = trainer.call("settle_pause" if keep_weights else "pause")
    if first and cfg.weight_sync.check_weight_update_equal:
        s.check_weights_equal()
    if released is None:
        return {**report.metrics(), **resumed}
    s.timeline_mark("trainer paused", released.after)
    return {**report.metrics(), **resumed, **released.metrics}


def _seconds(reports: list) -> float:
    """Engine 0's seconds in a resume (its ``MemoryReport``: ``memory/engine_resume/seconds``), 0 where it reports
    none."""
    return float(reports[0].metrics.get("memory/engine_resume/seconds", 0.0)) if reports else 0.0
