"""The rollout engine as a Ray actor: a plain class that ``tidal.cluster`` wraps with ``ray.remote``.

It forwards every call of ``tidal.rollout.engine.RolloutEngine`` (plus ``init``, weight checks and
the broadcast-group setup) to one ``EmbeddedEngine``. Samples cross Ray as small dataclasses whose
ids and log-probs are plain lists; weights never travel through these calls' return values.

The model is built in ``init()``, not in the constructor, so that the driver can start every actor
at once and wait for all of them together, and so that a failure there surfaces as the remote
call's error rather than as a dead actor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import ray
import torch

from tidal.memory.base import MemoryFigures
from tidal.profiling import ProfileRequest, profile_call
from tidal.rollout.engine import (
    TAGS,
    BucketHeader,
    EngineHealth,
    MemoryReport,
    RolloutEngine,
    WeightUpdateResult,
    update_result,
)
from tidal.rollout.types import DecodeStats, Sample, SampleBatch, SamplingParams, WarmUpReport

if TYPE_CHECKING:
    from tidal.rollout.embedded import EmbeddedEngine


def cpu_allotment() -> float | None:
    """CPUs Ray reserved for the current actor, or None outside Ray."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.get_runtime_context().get_assigned_resources().get("CPU")
    except Exception:  # noqa: BLE001 - not inside a Ray worker
        return None


def set_torch_threads(cpus: float | None) -> int:
    """Intra-op threads from the actor's CPU share: a fractional actor gets one thread at least.

    Without this torch starts one thread per core of the host, and several actors sharing a few
    cores then oversubscribe them (each thread waits on the others; throughput drops several-fold).
    """
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, math.ceil(cpus - 1e-6))
    torch.set_num_threads(threads)
    return threads


def _memory_report(stats: dict, after: MemoryFigures | None = None) -> MemoryReport:
    stats = dict(stats)
    return MemoryReport(str(stats.pop("residency")), stats, after)


class EngineActor(RolloutEngine):
    """One rollout engine (built from ``RolloutEngine``'s arguments)."""

    engine: EmbeddedEngine | None = None  # built by init()
    _profile: ProfileRequest | None = None  # the next generate's (profile_next)

    def init(self) -> dict:
        """Build the model and the memory backend; returns sizes for the driver's log."""
        from tidal.memory.history import MemoryHistory
        from tidal.rollout.embedded import EmbeddedEngine

        if self.device == "cpu":
            set_torch_threads(cpu_allotment())
        self._history = MemoryHistory(self.memory_cfg, self.device, f"engine-{self.engine_rank}")
        device = self.device
        if device == "cuda":
            # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU, so it is always device 0 here.
            device = "cuda:0"
            torch.cuda.set_device(0)
        self.engine = EmbeddedEngine(
            self.model_cfg,
            self.rollout_cfg,
            self.memory_cfg,
            self.weight_sync_cfg,
            device=device,
            engine_rank=self.engine_rank,
            seed=self.seed,
        )
        return {
            "engine_rank": self.engine_rank,
            "param_bytes": self.engine.param_bytes(),
            "dtype": str(self.engine.dtype).removeprefix("torch."),
            "device": str(self.engine.device),
            "torch_threads": torch.get_num_threads(),
            "memory_backend": self.engine.backend.name,
            "build_s": self.engine.build_s,
        }

    def _engine(self):
        if self.engine is None:
            raise RuntimeError(f"engine {self.engine_rank}: init() was not called")
        return self.engine

    def generate(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        engine, request, self._profile = self._engine(), self._profile, None
        if request is None:
            out = engine.generate(samples, sampling)
        else:
            out = profile_call(request, lambda: engine.generate(samples, sampling), str(engine.device))
        self._history.step()
        return SampleBatch(out)  # one object on the wire (tidal.rollout.types)

    def warm_up(self, rows: int, sampling: SamplingParams) -> WarmUpReport:
        return self._engine().warm_up(rows, sampling)

    def profile_next(self, request: ProfileRequest) -> bool:
        self._profile = ProfileRequest(request.dir, f"{request.label}-engine{self.engine_rank}")
        return True

    def take_decode_stats(self) -> DecodeStats:
        return self._engine().take_decode_stats()

    def release_memory(self, tags: Sequence[str] = TAGS) -> MemoryReport:
        engine = self._engine()
        return _memory_report(engine.release_memory(tags), engine.last_memory)

    def resume_memory(self, tags: Sequence[str] = TAGS) -> MemoryReport:
        engine = self._engine()
        return _memory_report(engine.resume_memory(tags), engine.last_memory)

    def update_weights_from_tensor(self, bucket: BucketHeader, version: int) -> WeightUpdateResult:
        return self._update(self._engine().update_weights_from_tensor(bucket, version))

    def update_weights_from_distributed(self, bucket: BucketHeader, version: int) -> WeightUpdateResult:
        return self._update(self._engine().update_weights_from_distributed(bucket, version))

    def update_weights_from_disk(self, path: str, version: int) -> WeightUpdateResult:
        return self._update(self._engine().update_weights_from_disk(path, version))

    def _update(self, stats: dict) -> WeightUpdateResult:
        return update_result(stats, self._engine().get_weight_version())

    def pull_weights(
        self, source_dir: str, local_checkpoint_dir: str | None = None, target_version: int | str | None = None
    ):
        """slime's ``/pull_weights`` (files only; see ``EmbeddedEngine.pull_weights``) -> ``PullResult``."""
        return self._engine().pull_weights(source_dir, local_checkpoint_dir, target_version)

    def init_weights_update_group(
        self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str
    ) -> None:
        return self._engine().init_weights_update_group(master_addr, master_port, rank, world_size, backend)

    def destroy_weights_update_group(self) -> None:
        self._engine().destroy_weights_update_group()

    def get_weight_version(self) -> int:
        return self._engine().get_weight_version()

    def flush_cache(self) -> None:
        """The embedded engine's ``flush_cache``: frees the CUDA allocator's cached blocks; no KV/prefix cache exists."""
        self._engine().flush_cache()

    def pause_generation(self) -> None:
        """A running ``generate`` returns at its next step boundary, rows it cut short ``aborted`` (their tokens
        so far kept, continued by a later call); calls made before ``continue_generation`` return at once.
        ``ProbedEngineActor`` answers it beside a running call."""
        self._engine().pause_generation()

    def continue_generation(self) -> None:
        """Generate again after ``pause_generation`` (same concurrency group as ``generate``: in order)."""
        self._engine().continue_generation()

    def health(self) -> EngineHealth:
        engine = self._engine()
        return EngineHealth(self.engine_rank, engine.get_weight_version(), engine.residency.state.value)

    def randomize_weights(self, seed: int) -> None:
        self._engine().randomize_weights(seed)

    def pid(self) -> int:
        """This engine's process id (to signal it from outside, as the restart tests do)."""
        return os.getpid()

    def memory_stats(self) -> dict[str, int]:
        """Host RSS, device peak since the last call, and device memory in use (for the step line)."""
        from tidal.memory.telemetry import process_memory_stats

        return process_memory_stats(self.device)

    def weight_checksums(self, algo: str = "xxh3-128") -> dict[str, str]:
        return self._engine().weight_checksums(algo)

    def residency(self) -> str:
        return self._engine().residency.state.value


class ProbedEngineActor(EngineActor):
    """``EngineActor`` whose ``health``, ``pid``, ``pause_generation``, ``memory_stats`` and ``take_decode_stats``
    answer from their own concurrency group, beside a running ``generate``: an engine whose process stopped
    (frozen, or stuck holding the GIL) does not answer, a busy one does. Start it with ``ray.remote(concurrency_groups={"probe": 2})`` (``cluster.groups`` does);
    ``EngineActor`` itself stays a plain actor class for ``ray.remote`` alone."""

    @ray.method(concurrency_group="probe")
    def health(self) -> EngineHealth:
        return super().health()

    @ray.method(concurrency_group="probe")
    def pid(self) -> int:
        return super().pid()

    @ray.method(concurrency_group="probe")
    def pause_generation(self) -> None:
        super().pause_generation()

    @ray.method(concurrency_group="probe")
    def memory_stats(self) -> dict[str, int]:
        """Read each step beside the call out (the async loops): waiting behind it would stall every step."""
        return super().memory_stats()

    @ray.method(concurrency_group="probe")
    def take_decode_stats(self) -> DecodeStats:
        """Read each step beside the call out, as ``memory_stats`` (the decoder's totals hold a lock)."""
        return super().take_decode_stats()
