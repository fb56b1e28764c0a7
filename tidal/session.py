"""Everything a run sets up and tears down around the loop in ``tidal.driver``.

A ``Session`` is a context manager: entering it checks the inputs that can be checked on the
driver (model, tokenizer, dataset, reward function), opens the run directory, starts or joins Ray,
reserves the placement group and starts the trainer ranks and engines; leaving it (normally, on
an error, or on Ctrl-C) kills the actors, removes the placement group and stops Ray if it started
it. Nothing here decides the order of phases: that is the driver's job.

It runs past 500 lines because the start (what overlaps what), the end (what is drawn while Ray
stops) and the survival of an engine's death all act on the same session state; the helpers that
need none of it are module functions below.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
from typing import TYPE_CHECKING

from tidal.background import in_background
from tidal.cluster.groups import EngineGroup, TrainerGroup
from tidal.cluster.placement import Placement, create_placement_group, plan_placement
from tidal.cluster.ray_cluster import start_ray, start_warm, started_cluster_env, stop_ray
from tidal.compile_cache import cache_env
from tidal.config.schema import TidalConfig
from tidal.dtypes import default_dtype_name
from tidal.errors import RunFailed, UserError, WeightSyncError, is_engine_death
from tidal.observe.console import Display
from tidal.observe.plots import ChartThread, RedrawClock, import_plotting, plot_curves
from tidal.observe.run_dir import RunDir
from tidal.signals import Stopped, StopSignal

if TYPE_CHECKING:
    from tidal.memory.base import MemoryFigures

log = logging.getLogger(__name__)

STARTUP_SWITCH_INTERVAL_S = (
    0.0005  # the GIL's switch interval while Ray starts beside the inputs' imports (default 5 ms)
)


def steps_per_rollout(cfg: TidalConfig) -> int:
    """Optimizer steps one rollout makes (dynamic sampling can only make it fewer)."""
    samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    return max(1, -(-samples // (cfg.trainer.global_batch_size or samples)))


class Session:
    def __init__(self, cfg: TidalConfig):
        self.cfg = cfg
        self.device = cfg.cluster.device
        self._ray_started = False
        self._placement = None
        self.trainer: TrainerGroup | None = None
        self.engines: EngineGroup | None = None
        self.timeline = None
        self.redraw = RedrawClock()
        self.charts = ChartThread()
        self.display = None
        self.run = None
        self.tokenizer = self.dataset = self.agent = None  # read in __enter__, beside Ray's start
        self.engine_restarts = 0  # over the run, against --max-engine-restarts
        self.step_restarts = 0  # since the last step line (the step's engine_restarts metric)
        self.stop = StopSignal()
        self._last_saved: int | None = None
        self.cursor = (
            None  # the training loops' prompt cursor, whose data position checkpoints record (tidal.rollout.buffer)
        )
        self.last_sync_version = 0  # the weight version of the last sync (restarts resync under a new one)
        # Where the time before the first step goes: seconds since the process started at each stage,
        # and the actors' own build times (step 0's row carries them, ``startup_*``).
        self.startup: dict[str, float] = {}
        self._plotting: concurrent.futures.Future | None = None  # matplotlib's import, started after the first step

    # ---- setup / teardown -------------------------------------------------------------------
    def __enter__(self) -> Session:
        from tidal.memory.preload import actor_env
        from tidal.model import resolve_model
        from tidal.rollout.rewards import get_reward_fn

        cfg = self.cfg
        spec = resolve_model(cfg.model.model, cfg.model.tokenizer, cfg.model.trust_remote_code)
        self.reward_fn = get_reward_fn(cfg.data.rm_type, cfg.data.custom_rm_path)
        self.load_path, load_note = self._find_checkpoint()  # before the run folder: a bad --load leaves nothing
        trainer_env = actor_env(cfg.memory, dict(cfg.cluster.train_env_vars), self.device)
        placement, env, preload, warm = self._plan_cluster(spec.config_dict().get("model_type"), trainer_env)
        try:
            # First the warm process that imports the actors' modules once (a local cluster), then the tokenizer,
            # prompts and the agent loop, read beside Ray's start (transformers takes seconds to import on a small
            # host); a bad dataset still stops everything before the run folder or an actor exists.
            if start_warm(cfg.cluster.ray_address, env, warm):
                self.mark_startup("startup_warm_s")  # its imports are the start's critical path: the sooner the better
            # While the inputs' thread imports (holding the GIL for most of seconds), ray.init on this thread
            # waits for the GIL after each of its many short waits: up to the switch interval each time.
            switch = sys.getswitchinterval()
            sys.setswitchinterval(min(switch, STARTUP_SWITCH_INTERVAL_S))
            try:
                inputs = in_background(_read_inputs, cfg, spec, name="tidal-inputs")
                self._start_cluster(placement, env, preload)
                self.mark_startup("startup_ray_s")
                self.tokenizer, self.dataset, self.agent = inputs.result()
            finally:
                sys.setswitchinterval(switch)
            from tidal.memory.telemetry import MemoryTimeline

            self.run = RunDir(cfg)
            self.timeline = MemoryTimeline()
            self.display = Display(cfg.rollout.num_rollout, enabled=cfg.logging.progress)
            self.display.info(f"run directory: {self.run.path}")
            if load_note:
                self.display.info(load_note)
            self._start_actors(trainer_env)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _plan_cluster(self, model_type: str | None, trainer_env: dict) -> tuple[Placement, dict, list[str], list[str]]:
        """Placement, the environment of a local cluster's workers, the modules its prestarted workers preload
        (used without a warm process) and those a warm process imports (``--warm-process``; none: no warm process)."""
        from tidal.cluster.placement import worker_env
        from tidal.cluster.ray_cluster import prestart_modules

        cfg = self.cfg
        num_engines = cfg.cluster.rollout_num_gpus // cfg.cluster.rollout_num_gpus_per_engine
        if cfg.rollout.rollout_engine == "sglang" and cfg.rollout.rollout_external_engine_addrs:
            num_engines = 0  # servers outside tidal: their client actors need no bundle
        rollout_only = cfg.rollout.debug_rollout_only  # no trainer: no ranks, no bundles, no trainer memory
        placement = plan_placement(cfg.cluster, self.device, num_engines, with_trainer=not rollout_only)
        env = worker_env(placement)
        env.update(cache_env(cfg.cluster.compile_cache_dir))  # torch.compile's caches, kept across runs
        preload, warm = [], []
        if cfg.rollout.rollout_engine == "embedded" and not trainer_env:
            actors = len(placement.engines) + len(placement.trainers)
            kw = dict(actors=actors, trainer=not rollout_only, num_gpus=placement.num_gpus)
            preload = prestart_modules(model_type, **kw)
            # auto and on alike: a warm process wherever the cluster starts here (start_warm), CPU or GPU.
            warm = [] if cfg.cluster.warm_process == "off" else prestart_modules(model_type, any_host=True, **kw)
        return placement, env, preload, warm

    def _start_cluster(self, placement: Placement, env: dict, preload: list[str]) -> None:
        """Ray (started or joined) and the placement group."""
        cfg = self.cfg
        self._ray_started = start_ray(
            cfg.cluster.ray_address,
            num_cpus=placement.num_cpus,
            num_gpus=placement.num_gpus,
            worker_env=env,
            preload=preload,
        )
        # A cluster started here, by this session (with ``env``) or earlier in this process: actors whose
        # environment its workers have need no runtime env.
        placement.cluster_env = started_cluster_env()
        self.stop.install()  # after ray.init, which installs its own exit-at-once SIGTERM handler
        self._placement = create_placement_group(placement)

    def _start_actors(self, trainer_env: dict) -> None:
        """Every actor is created first, then all of them initialise at once (Ray starts them concurrently)."""
        from tidal.cluster.groups import get

        cfg = self.cfg
        placement = self._placement
        rollout_only = cfg.rollout.debug_rollout_only
        self.display.phase("starting actors")
        self.engines = EngineGroup(
            placement,
            model=cfg.model,
            rollout=cfg.rollout,
            memory=cfg.memory,
            weight_sync=cfg.weight_sync,
            seed=cfg.trainer.seed,  # presets are built from this seed on both sides: same initial weights
        )
        if rollout_only:
            self.engines.call("init")
            self.display.info(f"rollout only: {len(self.engines)} engine(s) on {self.device}, no trainer")
            return
        self.trainer = TrainerGroup(
            placement,
            env_vars=trainer_env,
            model=cfg.model,
            trainer=cfg.trainer,
            algorithm=cfg.algorithm,
            memory=cfg.memory,
            weight_sync=cfg.weight_sync,
            total_steps=cfg.rollout.num_rollout * steps_per_rollout(cfg),
        )
        engine_init = self.engines.call_async("init")
        trainer_init = self.trainer.call_async("init")
        warm = self._warm_up_calls()  # queued behind each actor's init: every actor warms at once
        info = get(trainer_init)[0]
        engine_info = get(engine_init)
        warmed = {side: get(call) for side, call in warm.items()}
        self.mark_startup("startup_actors_s")
        self.startup["startup_trainer_init_s"] = round(info.get("init_s", 0.0), 3)
        self.startup["startup_trainer_build_s"] = round(info.get("build_s", 0.0), 3)
        builds = [e.get("build_s", 0.0) for e in engine_info if isinstance(e, dict)]
        self.startup["startup_engine_build_s"] = round(max(builds, default=0.0), 3)
        for side, reports in warmed.items():  # the slowest actor of each side, and where its time went
            slowest = max(reports, key=lambda r: r.seconds)
            for what in ("seconds", "compile_s", "backend_s"):
                name = "warmup_s" if what == "seconds" else f"warmup_{what}"
                self.startup[f"startup_{side}_{name}"] = round(getattr(slowest, what), 3)
        self.display.info(
            f"trainer: {len(placement.trainers)} rank(s), {info.get('num_params', 0) / 1e6:.2f}M params on {self.device}; "
            f"engines: {len(self.engines)} ({'colocated' if placement.colocated else 'disaggregated'})"
        )
        if cfg.weight_sync.check_weight_update_equal:
            self.engines.call("randomize_weights", cfg.trainer.seed + 1)
        if cfg.memory.offload_rollout:
            self.timeline_mark(
                "engines released", self.engines.call("release_memory", ["kv_cache", "weights"])[0].after
            )
        self.trainer.call("connect_engines", self.engines.actors, default_dtype_name(self.device))

    def _warm_up_calls(self) -> dict[str, list]:
        """With ``--warm-up``: each engine's ``warm_up`` at its share of the first rollout's samples (whole prompt
        groups per engine, as ``run_engines`` splits them) and the trainer's, sent now; by side."""
        cfg = self.cfg
        if not cfg.cluster.warm_up:
            return {}
        from tidal.rollout.orchestrate import sampling_params

        r = cfg.rollout
        prompts = r.over_sampling_batch_size or r.rollout_batch_size
        rows = -(-prompts // max(1, len(self.engines))) * r.n_samples_per_prompt
        sampling = sampling_params(r, self.tokenizer)
        return {
            "engine": self.engines.call_async("warm_up", rows, sampling),
            "trainer": self.trainer.call_async("warm_up", steps_per_rollout(cfg) > 1 or cfg.trainer.recompute_logprobs),
        }

    def mark_startup(self, name: str) -> None:
        """Record seconds since this process started under ``name`` (a ``startup_*`` figure of step 0)."""
        import time

        import psutil

        self.startup[name] = round(time.time() - psutil.Process().create_time(), 3)

    def __exit__(self, exc_type, exc, tb) -> None:
        import ray

        self.stop.restore()
        if self.display is not None:
            self.display.close()
        # The last charts are drawn (~1 s of CPU) while the actors and Ray stop, which is mostly waiting.
        closing = in_background(self._close_run, name="tidal-close") if self.run is not None else None
        try:
            if ray.is_initialized():
                if self.engines is not None:
                    try:
                        self.engines.shutdown()
                    except Exception:  # noqa: BLE001 - the actors are killed below anyway
                        log.debug("engine shutdown failed", exc_info=True)
                for group in (self.trainer, self.engines):
                    for a in getattr(group, "actors", []):
                        ray.kill(a)
                if self._placement is not None and self._placement.pg is not None:
                    from ray.util.placement_group import remove_placement_group

                    remove_placement_group(self._placement.pg)
        finally:
            try:
                stop_ray(self._ray_started)
            finally:
                if closing is not None:
                    closing.result()

    def _close_run(self) -> None:
        """The run directory's last charts, then its files closed."""
        try:
            self.draw_charts()
        finally:
            self.run.close()

    # ---- engines that die ---------------------------------------------------------------------
    def dead_engines(self) -> list[int]:
        """Engines that do not answer ``health()`` within ``--engine-health-timeout``."""
        import ray

        refs = [a.health.remote() for a in self.engines.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.rollout.engine_health_timeout)
        dead = []
        for i, ref in enumerate(refs):
            if ref not in ready:
                dead.append(i)
                continue
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - sorted below
                if not is_engine_death(e):
                    raise
                dead.append(i)
        return dead

    def restart_engines(self, dead: list[int], why: str, *, new_version: bool = True):
        """Restart (or reconnect) the dead engines, then resync every engine to the trainer's weights
        (``resync_engines``); returns the resync's ``SyncReport``. Past ``--max-engine-restarts`` the run
        stops with one line. ``new_version=False`` where the trainer's weights are the ones it last
        pushed (the synchronous loop, while generating): the resync keeps their version."""
        limit = self.cfg.rollout.max_engine_restarts
        for i in dead:
            self.engine_restarts += 1
            if self.engine_restarts > limit:
                raise RunFailed(
                    f"engine {i} died ({why}) after {limit} engine restart(s), the most --max-engine-restarts allows; "
                    f"fix what kills it or raise the limit{self.checkpoint_hint()}"
                )
            log.warning("engine %d died (%s); restarting it (%d/%d)", i, why, self.engine_restarts, limit)
            self.display.info(f"engine {i} died ({why}); restarting it ({self.engine_restarts}/{limit})")
            self.engines.restart(i, initial_weights=self.trainer is None)
        self.step_restarts += len(dead)
        if self.trainer is None:
            return self._agree_without_trainer()
        return self.resync_engines(new_version=new_version)

    def _agree_without_trainer(self) -> None:
        """``--debug-rollout-only``: no trainer exists and none ever pushed weights, so every engine, a
        restarted one too, holds the weights it was started with; nothing to resync. They must still
        report one weight version, or the rollout would mix policies."""
        versions = self.engines.call("get_weight_version")
        if len(set(versions)) > 1:
            raise WeightSyncError(
                f"engines report weight versions {versions} after a restart with --debug-rollout-only (no trainer "
                "to resync them); start every engine from the same weights"
            )

    def resync_engines(self, *, new_version: bool = True):
        """Every engine back to generating with the trainer's weights: engine memory resumed (weights
        before the sync, the KV cache after it, as in a step's sync), the strategy reconnected to the
        engine set, then a full sync: of a new version, or with ``new_version=False`` of the version the
        trainer last pushed (its weights did not change since, so a restart leaves the version alone)."""
        from tidal.cluster.groups import get

        engines = self.engines
        states = engines.call("residency")
        get([a.resume_memory.remote(["weights"]) for a, st in zip(engines.actors, states) if st == "ASLEEP"])
        self.trainer.call("connect_engines", engines.actors, default_dtype_name(self.device))
        report = self.trainer.call("update_weights", new_version)
        versions = engines.call("get_weight_version")
        if any(v != report.version for v in versions):
            raise WeightSyncError(
                f"engines report weight versions {versions} after the resync to version {report.version}"
            )
        self.last_sync_version = report.version
        get([a.resume_memory.remote(["kv_cache"]) for a, st in zip(engines.actors, states) if st != "AWAKE"])
        return report

    def survive_engine_death(self, exc: BaseException, phase: str, *, new_version: bool):
        """An engine died outside generation (``phase``: "releasing memory", "syncing weights"): restart
        the engines that do not answer and resync every engine (``restart_engines``), so that all of them
        generate again with the trainer's weights; returns the resync's report. ``exc`` is raised again
        when it is not an engine's death or no engine is found dead (the run then ends in one line)."""
        if not is_engine_death(exc) or self.is_trainer_death(exc):
            raise exc
        dead = self.dead_engines()
        if not dead:
            raise exc
        return self.restart_engines(dead, f"{_last_line(exc)[:200]}, while {phase}", new_version=new_version)

    def is_trainer_death(self, exc: BaseException) -> bool:
        from ray.exceptions import RayActorError

        trainers = {a._actor_id.hex() for a in getattr(self.trainer, "actors", [])}
        return isinstance(exc, RayActorError) and getattr(exc, "actor_id", None) in trainers

    def checkpoint_hint(self) -> str:
        """'; resume with --load DIR (newest checkpoint rollout N)' when one was saved, else ''."""
        ck = self.cfg.checkpoint
        folder = ck.save or ck.load
        if not folder or not os.path.isdir(folder):
            return "; no checkpoint was saved (--save DIR keeps one to resume from)"
        newest = newest_checkpoint(folder)
        return (
            f"; resume with --load {folder} (newest checkpoint: {newest})"
            if newest
            else f"; no checkpoint in {folder} yet"
        )

    def trainer_died(self, exc: BaseException) -> RunFailed:
        """One line naming the trainer rank that died and the checkpoint to resume from."""
        from ray.exceptions import RayActorError

        rank = "?"
        actor_id = getattr(exc, "actor_id", None)
        for r, a in enumerate(getattr(self.trainer, "actors", [])):
            if actor_id is not None and a._actor_id.hex() == actor_id:
                rank = str(r)
        kind = "died" if isinstance(exc, RayActorError) else "failed"
        return RunFailed(f"trainer rank {rank} {kind}: {_last_line(exc)}{self.checkpoint_hint()}")

    # ---- pieces the driver calls -----------------------------------------------------------
    def timeline_mark(self, phase: str, after: MemoryFigures | None) -> None:
        """Record host and device memory after a pause/resume/release (None: nothing was measured)."""
        if self.timeline is not None and after is not None:
            self.timeline.mark(phase, after.host_rss, after.device_used)

    def memory_metrics(self) -> dict:
        """Host RSS of driver, trainer rank 0 and engine 0; device peaks since the last step and device in use."""
        from tidal.cluster.groups import get
        from tidal.memory.telemetry import host_rss_bytes

        none = {"host_rss": 0, "device_peak": 0, "device_used": 0}
        refs = [self.engines.actors[0].memory_stats.remote()]
        if self.trainer is not None:
            refs.append(self.trainer.actors[0].memory_stats.remote())
        engine, trainer = (get(refs) + [none])[:2]
        out = {
            "host_rss_bytes": host_rss_bytes() + trainer["host_rss"] + engine["host_rss"],
            "trainer_host_rss_bytes": trainer["host_rss"],
            "engine_host_rss_bytes": engine["host_rss"],
            "trainer_device_peak_bytes": trainer["device_peak"],
            "engine_device_peak_bytes": engine["device_peak"],
            "device_peak_bytes": trainer["device_peak"] + engine["device_peak"]
            if self.cfg.cluster.colocate
            else max(trainer["device_peak"], engine["device_peak"]),
            "device_used_bytes": max(trainer["device_used"], engine["device_used"]),
        }
        # One point per step on memory.png, paused or not; on CPU the device is the host (the actors' RSS).
        device = out["device_used_bytes"] if self.device == "cuda" else trainer["host_rss"] + engine["host_rss"]
        if self.timeline is not None:
            self.timeline.mark("step", out["host_rss_bytes"], device)
        return out

    def check_weights_equal(self) -> None:
        from tidal.weight_sync.verify import compare_checksums

        want = self.trainer.call("weight_checksums")
        for i, got in enumerate(self.engines.call("weight_checksums")):
            bad = compare_checksums(want, got)
            if bad:
                raise WeightSyncError(
                    f"engine {i} differs from the trainer after the first sync in {len(bad)} tensor(s): {', '.join(bad[:5])}"
                )
        self.display.info(
            f"check-weight-update-equal: {len(want)} tensors bitwise equal on {len(self.engines)} engine(s)"
        )

    def _find_checkpoint(self) -> tuple[str | None, str | None]:
        """The checkpoint ``--load`` names, checksums verified (``tidal.checkpoint.manifest``), and a line to show."""
        from tidal.checkpoint.manifest import find_loadable

        load = self.cfg.checkpoint.load
        if not load:
            return None, None
        found = find_loadable(load)
        if found.path is None and found.skipped:
            bad, problem = found.skipped[0]
            more = "" if os.path.abspath(bad) == os.path.abspath(load) else f" (newest: {os.path.basename(bad)})"
            raise UserError(f"--load {load}: checkpoint damaged{more}: {problem}; no intact checkpoint to load")
        if found.skipped:
            bad, problem = found.skipped[0]
            others = f" and {len(found.skipped) - 1} more" if len(found.skipped) > 1 else ""
            note = f"--load {load}: {os.path.basename(bad)}{others} damaged ({problem}); loading {os.path.basename(found.path)}"
            return found.path, note
        return found.path, None

    def resume_from_checkpoint(self) -> int:
        ck = self.cfg.checkpoint
        if not ck.load:
            return 0
        if self.load_path is None:
            self.display.info(f"--load {ck.load}: no checkpoint there yet (it is the --save folder): starting fresh")
            return self._start_rows_at(0)
        extra = self.trainer.call("load", self.load_path)
        if not extra:
            raise UserError(f"--load {self.load_path}: the trainer found no checkpoint there; check the folder")
        if self.cursor is not None:
            self.cursor.load_state_dict({"data": extra["data"], "done_after": extra.get("data_done_after", [])})
        else:
            self.dataset.load_state_dict(extra["data"])
        self._last_saved = int(extra["rollout_id"])
        self.display.info(f"resumed from {self.load_path} at rollout {extra['rollout_id'] + 1}")
        return self._start_rows_at(int(extra["rollout_id"]) + 1)

    def _start_rows_at(self, start: int) -> int:
        """The run folder's rows of rollouts from ``start`` on (an earlier process's, past its checkpoint) dropped."""
        dropped = self.run.resume_at(start)
        if dropped:
            self.display.info(
                f"{self.run.metrics_path}: {dropped} row(s) of rollouts {start} and later dropped (run again)"
            )
        return start

    def log_samples(self, rollout_id: int, samples: list) -> None:
        """``--log-samples`` of this rollout to samples.jsonl; ``--show-samples`` prints one."""
        from tidal.observe.samples import pick, sample_line, sample_record

        records = self.run.samples.write(rollout_id, samples)
        if self.cfg.logging.show_samples:
            for r in records[:1] or [sample_record(rollout_id, x) for x in pick(samples, 1)]:
                self.display.info(sample_line(r))

    def should_save(self, rollout_id: int) -> bool:
        ck = self.cfg.checkpoint
        if not ck.save:
            return False
        last = rollout_id == self.cfg.rollout.num_rollout - 1
        return last or (ck.save_interval > 0 and (rollout_id + 1) % ck.save_interval == 0)

    def save(self, rollout_id: int) -> None:
        extra = {"rollout_id": rollout_id, "data": self.dataset.state_dict()}
        if self.cursor is not None:  # prompts in flight are not done: the position is the first one not done
            state = self.cursor.state_dict()
            extra.update(data=state["data"], data_done_after=state["done_after"])
        ck = self.cfg.checkpoint
        report = self.trainer.call("save", ck.save, extra) or {}
        self._last_saved = rollout_id
        if ck.keep_checkpoints:
            from tidal.checkpoint.manifest import prune

            prune(ck.save, ck.keep_checkpoints, report.get("checkpoint/path", ""))

    def check_stop(self, last_done: int) -> None:
        """At a safe point (between steps): after SIGTERM, save the last finished step (``--save``) and stop."""
        if not self.stop.requested:
            return
        save = self.cfg.checkpoint.save
        if not save or self.trainer is None:
            raise Stopped(
                f"SIGTERM: stopped after rollout {last_done}; nothing saved (pass --save DIR to keep progress)"
            )
        if last_done >= 0 and self._last_saved != last_done:
            self.save(last_done)
        if self._last_saved is None:
            raise Stopped("SIGTERM: stopped before the first rollout finished; nothing to save")
        raise Stopped(f"SIGTERM: checkpoint of rollout {self._last_saved} in {save}; continue with --load {save}")

    def after_step(self, rollout_id: int) -> None:
        if self._plotting is None:
            # matplotlib (~0.7 s of CPU) is imported beside the steps rather than after the last one: the
            # run's end waits for its charts.
            self._plotting = in_background(import_plotting, name="tidal-plotting")
        if self.redraw.due():  # drawn beside the next step, from a copy of what is recorded now
            timeline = self.timeline.snapshot() if self.timeline is not None else None
            self.charts.start(self._draw, list(self.run.history), timeline)

    def draw_charts(self) -> None:
        """``curves.png`` and ``memory.png`` in the run directory, from what the run has recorded so far
        (after the redraw in flight, if any)."""
        self.charts.wait()
        self._draw(self.run.history, self.timeline)

    def _draw(self, rows: list[dict], timeline) -> None:
        if rows:
            plot_curves(rows, os.path.join(self.run.path, "curves.png"))
        if timeline is not None:
            timeline.write_png(os.path.join(self.run.path, "memory.png"))


def newest_checkpoint(folder: str) -> str | None:
    """The newest complete checkpoint under ``folder`` (its folder name), if any."""
    from tidal.checkpoint.manifest import find_loadable

    path = find_loadable(folder).path  # checksums verified: the hint names one that loads
    return os.path.basename(path.rstrip("/")) if path else None


def _last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def _read_inputs(cfg: TidalConfig, spec):
    """The tokenizer, the prompt dataset and the agent loop (multi-turn rollouts; None: one response per
    prompt), each checked here: a bad one raises its UserError. Read below the warm process's priority, if any."""
    from tidal.cluster.ray_cluster import yield_to_warm
    from tidal.data.dataset import PromptDataset
    from tidal.model import load_tokenizer
    from tidal.rollout.agent import make_agent

    yield_to_warm()
    tokenizer = load_tokenizer(spec, driver=True)  # the char tokenizer without transformers (a second of CPU)
    dataset = PromptDataset.build(cfg.data, cfg.rollout, tokenizer, seed=cfg.trainer.seed)
    agent = make_agent(cfg, tokenizer)
    import tidal.rollout.orchestrate  # noqa: F401 - torch and the advantage functions, needed at the first step

    if not cfg.rollout.debug_rollout_only:  # the trainer class Ray needs to create the ranks (its torch.distributed
        from tidal.trainer.base import trainer_class  # imports), here rather than on the main thread after Ray's start

        trainer_class(cfg.trainer.train_backend)
    return tokenizer, dataset, agent
