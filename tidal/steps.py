"""The phases both loops share (``tidal.driver`` and ``tidal.driver_async``): phase timing, the weight sync, the step's end.

``sync_weights`` is the colocation order of a sync (engine weights back, push, KV cache back);
``finish_step`` runs [eval] [save], logs the step's metrics and calls the ``on_step`` hook.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from tidal.errors import WeightSyncError

if TYPE_CHECKING:
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


def sync_weights(s, first: bool = False, release_trainer: bool = False) -> dict:
    """Resume engine weights -> trainer pushes the new version -> [trainer pauses its weights] -> resume engine
    KV cache.

    ``release_trainer``: the trainer is WEIGHTS_ONLY (``pause(keep_weights=True)`` after training), so the push
    reads its weights on the device; they are paused once the engines hold them and before the engines' KV
    cache comes back, so the device never holds the trainer's weights beside a KV cache. Its pause figures
    (``memory/trainer_pause/...``, both stages) join the sync's metrics.

    An engine that dies during it is restarted and every engine resynced with the trainer's weights
    (``Session.survive_engine_death``: a new version when the trainer had not begun to push this one)."""
    cfg, trainer, engines = s.cfg, s.trainer, s.engines
    pushing, released = False, None
    try:
        if cfg.memory.offload_rollout:
            engines.call("resume_memory", ["weights"])
        pushing = True
        report: SyncReport = trainer.call("update_weights")
        versions = engines.call("get_weight_version")
        if any(v != report.version for v in versions):
            raise WeightSyncError(f"engines report weight versions {versions} after syncing version {report.version}")
        if release_trainer:
            released = trainer.call("pause")
        if cfg.memory.offload_rollout:
            engines.call("resume_memory", ["kv_cache"])
    except Exception as e:  # noqa: BLE001 - only an engine's death is survived
        report = s.survive_engine_death(e, "syncing weights", new_version=not pushing)
    if release_trainer and released is None:  # an engine died before: the resync read the live weights
        released = trainer.call("pause")
    if first and cfg.weight_sync.check_weight_update_equal:
        s.check_weights_equal()
    if released is None:
        return report.metrics()
    s.timeline_mark("trainer paused", released.after)
    return {**report.metrics(), **released.metrics}
