"""The trainer interface: what the driver, checkpoints, export and weight sync need from a training backend.

A backend is one class whose instances are the ranks of one training job (one Ray actor per device,
process on CPU). The cluster code builds every rank with the same arguments::

    cls(rank, world_size, master_addr, master_port, *, model, trainer, algorithm, memory, weight_sync,
        device, total_steps=None)

(each keyword is that config section's dataclass; ``device`` is ``"cpu"`` or ``"cuda"``), then calls
each method on all ranks at once; rank 0 returns the reduced result, the other ranks ``{}`` where
a result only makes sense once. ``--train-backend`` picks the class from ``BACKENDS``.

A backend implements the abstract methods below: its own process groups, model layout, optimizer
and memory (``pause``/``resume`` are written here once, around the backend's hooks that free its
transients and release/rebuild its process groups); a weight source (``iter_weights``: full tensors by Hugging Face names, whatever the
layout); and a state surface for checkpoints and export (``checkpoint_state``, which speaks
``tidal.checkpoint.store.TrainState`` and ``tidal.checkpoint.export.ExportSource``). What is the
same for every backend is written here once: connecting to the engines and pushing a weight
version through the weight-sync strategy, checksums, save/load/export and their bookkeeping.

The FSDP2 backend is ``tidal.trainer.actor.TrainerActor``; the Megatron-core backend is
``tidal.trainer.megatron.trainer.MegatronTrainer``, which converts its tensor- and pipeline-parallel
shards to full HF-named tensors in ``iter_weights`` and ``checkpoint_state``. Another backend adds
its class to ``BACKENDS`` and its name to ``--train-backend``'s choices.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tidal.checkpoint.export import ExportSource, export_hf
from tidal.checkpoint.store import TrainState, load_checkpoint, save_checkpoint
from tidal.config.schema import (
    AlgorithmConfig,
    MemoryConfig,
    ModelConfig,
    TrainerConfig,
    WeightSyncConfig,
    init_on_device_default,
)
from tidal.dtypes import as_dtype, default_dtype
from tidal.errors import ConfigError, ResidencyError
from tidal.memory.base import MemoryBackend, MemoryReport, MemoryResult, StateClass
from tidal.memory.residency import TrainerResidency, TrainerState
from tidal.profiling import ProfileRequest, profile_call
from tidal.rollout.types import WarmUpReport
from tidal.weight_sync.base import SyncReport

# What a trainer's memory backend pauses and resumes; each backend registers its tensors of each class.
STATE_CLASSES = (StateClass.WEIGHTS, StateClass.OPTIMIZER, StateClass.GRADS)
_PAUSE, _RESUME = "memory/trainer_pause", "memory/trainer_resume"

# --train-backend value -> "module:class"; imported only when chosen.
BACKENDS = {"fsdp": "tidal.trainer.actor:TrainerActor", "megatron": "tidal.trainer.megatron.trainer:MegatronTrainer"}


def trainer_class(name: str) -> type[Trainer]:
    """The backend class ``--train-backend name`` selects."""
    if name not in BACKENDS:
        raise ConfigError(f"--train-backend {name!r}: use one of {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def transient_reserve(freed: int, peak: int, in_use: int) -> int:
    """Bytes the next train takes back in one block (``Trainer.reserve_transients``): what the last train needed
    beside what is still allocated at its end (``peak - in_use``: its activations and temporaries, not the state
    classes or the gradients, whose pools are their own), 1/16 more for the allocator's splits, at most what its
    pause handed back (``freed``). Sized on ``freed`` alone, the block took the gradients' pool again each step
    and grew by the gradients' bytes until the device was full (65.3 to 73.5 GB over five steps of the 0.5B
    preset on an H100)."""
    need = max(0, peak - in_use)
    return max(0, min(freed, need + need // 16))


class Trainer(ABC):
    """One rank of a training backend; see the module docstring for how ranks are built and called."""

    rank: int
    world_size: int
    device_type: str  # "cpu" or "cuda"
    version: int  # weight version last pushed to the engines
    last_rollout_id: int  # the rollout last trained (saved in checkpoints)
    strategy: Any  # the weight-sync strategy on rank 0 once connected, else None
    engine_dtype: torch.dtype | None
    sync_cfg: WeightSyncConfig
    connected: bool  # connect_engines() has run
    memory: MemoryBackend  # set by init; holds the WEIGHTS, OPTIMIZER and GRADS tensors
    # The local model folder the weights were loaded from (None for a preset), set by init.
    model_path: str | None = None
    # Whether the backend settles its optimizer state (``memory.settle``) before every optimizer step, so that
    # a resume may leave the state's copy back running beside the forward and backward (``MemoryBackend.defers``).
    settles_optimizer: bool = False
    # Whether the first pause stage leaves the optimizer state's release to the second (its copy out beside the
    # weight sync): None decides by the room on the device (``_room_to_release_late``); tests force it.
    late_release: bool | None = None
    num_params: int = 0  # parameters of the whole policy model, set by init (what the engines hold)

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        *,
        model: ModelConfig,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig,
        memory: MemoryConfig,
        weight_sync: WeightSyncConfig,
        device: str,
        total_steps: int | None = None,
    ):
        """What every backend keeps from its arguments (the signature the cluster builds ranks with).
        ``total_steps``: optimizer steps of the whole run, needed only by a decaying LR schedule."""
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device {device!r}: use cpu or cuda")
        self.rank, self.world_size = rank, world_size
        self.master_addr, self.master_port = master_addr, master_port
        self.model_cfg, self.cfg, self.algo = model, trainer, algorithm
        self.memory_cfg, self.sync_cfg = memory, weight_sync
        self.device_type = device
        self.total_steps = total_steps
        self.offload = bool(memory.offload_train)
        self.residency = TrainerResidency(f"trainer rank {rank}")
        # The first of a two-stage pause (its report and figures), merged into the second's metrics.
        self._first_stage: tuple[MemoryReport, dict[str, float]] | None = None
        self._transient_bytes = 0  # what the last train needed of the caching allocator (reserve_transients)
        self._profile: ProfileRequest | None = None  # the next train's (profile_next)
        self.version = 0
        self.strategy = None
        self.connected = False
        self.engine_dtype = None
        self.ref_model = None
        self.custom_correction = None
        self.last_rollout_id = -1
        self._warned_oversized = False

    # ---- backend: lifecycle, training, memory -------------------------------------------------------
    @abstractmethod
    def init(self) -> dict:
        """Process groups, model, optimizer, schedule, memory backend; returns sizes (``num_params``, ...)."""

    @abstractmethod
    def train(self, samples: list, rollout_id: int) -> dict:
        """All optimizer steps of one rollout's samples; rank 0 returns the metrics reduced over ranks."""

    def warm_up(self, recompute: bool = False) -> WarmUpReport:
        """Compile what the first ``train`` would, before it (``--warm-up``; ``recompute``: the rollout recomputes
        old log-probs in a no-grad pass), leaving weights, optimizer state, schedule and gradients as they were.
        A backend with nothing to compile returns an empty report."""
        return WarmUpReport()

    @abstractmethod
    def _free_transients(self) -> None:
        """Before a pause: drop what is not state (grads set to None, unsharded compute copies, cached blocks)."""

    @abstractmethod
    def _release_groups(self) -> dict[str, float]:
        """Before a pause: destroy the process groups whose communicators hold device memory; their metrics
        (``groups_released``, ...; the ``memory/trainer_pause/`` prefix is added)."""

    @abstractmethod
    def _rebuild_groups(self) -> dict[str, float]:
        """After a resume: the groups ``_release_groups`` destroyed, built again and re-pointed; their metrics
        (``groups_rebuilt``, ...; under ``memory/trainer_resume/``)."""

    # ---- backend: the weight source and the state surface -------------------------------------------
    @abstractmethod
    def iter_weights(
        self, dtype: str | torch.dtype | None = None, *, on_device: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(HF name, full tensor in dtype)`` on rank 0, ``(name, None)`` elsewhere; all ranks iterate together.
        Tensors are on the host unless ``on_device`` (the strategy packs on the device). Works while paused."""

    @abstractmethod
    def checkpoint_state(self) -> TrainState | ExportSource:
        """The state surface checkpoints and export read and fill (one object speaking both protocols)."""

    def shutdown(self) -> None:
        """Close the weight-sync strategy (a backend then closes its process groups); call on all ranks."""
        if self.strategy is not None:
            self.strategy.close()

    # ---- the same for every backend -------------------------------------------------------------------
    def pause(self, keep_weights: bool = False) -> MemoryResult:
        """Release device memory (a no-op unless offload_train). From ACTIVE: the backend's transients, then the
        optimizer state and gradients, and unless ``keep_weights`` the process groups and the weights too; from
        WEIGHTS_ONLY (an earlier ``pause(keep_weights=True)``): the process groups and the weights. The colocated
        loop pauses in those two stages around the weight sync, which so reads the weights where they live on
        the device instead of from their host backups. Where the device has room, the first stage leaves the
        optimizer state's release to the second (``_room_to_release_late``), its copy out running beside the sync.
        Memory metrics on rank 0, with the figures of the report; the second of two stages returns both stages'
        figures together (the seconds summed)."""
        left = self.residency.pause(keep_weights)
        if not self.offload:
            return MemoryResult({f"{_PAUSE}/effective": 0})
        self.memory.settle()
        t0 = time.perf_counter()
        extra: dict[str, float] = {}
        classes = [c for c in STATE_CLASSES if c is not StateClass.WEIGHTS] if left is TrainerState.ACTIVE else []
        if left is TrainerState.ACTIVE:
            reserved, peak, in_use = self._reserved_bytes(), *self._allocated_bytes()
            self._free_transients()
            extra["free_transients_s"] = time.perf_counter() - t0
            self._transient_bytes = transient_reserve(reserved - self._reserved_bytes(), peak, in_use)
        if not keep_weights:
            extra.update(self._release_groups())
            classes.append(StateClass.WEIGHTS)
        late = keep_weights and StateClass.OPTIMIZER in classes and self._room_to_release_late()
        report = self.memory.pause(classes, defer=[StateClass.OPTIMIZER] if late else [])
        extra["total_s"] = time.perf_counter() - t0
        if keep_weights:
            self._first_stage = (report, dict(extra))
        elif left is TrainerState.WEIGHTS_ONLY:
            report, extra = self._after_first_stage(report, extra)
        return self._pause_result(report, extra)

    def settle_pause(self) -> MemoryResult:
        """The second pause stage with the weights kept (WEIGHTS_ONLY before and after): finish what the first stage
        left running (the optimizer state's late release, its copy awaited) and return both stages' figures, as
        ``pause()``'s second stage does. The colocated loop calls it instead of ``pause()`` where the next generate
        would bring the weights back early anyway (``--train-resume-early``): the device then holds through that
        generate what the early resume would have brought back, without the weights' copy out and back."""
        if self.residency.state is not TrainerState.WEIGHTS_ONLY:
            raise ResidencyError(
                f"{self.residency.name}: settle_pause() while {self.residency.state.value}; it ends a "
                "pause(keep_weights=True), which comes first"
            )
        if not self.offload:
            return MemoryResult({f"{_PAUSE}/effective": 0})
        t0 = time.perf_counter()
        self.memory.settle()
        report = self.memory.pause([])  # no class: the process's memory now, after the settled release
        seconds = time.perf_counter() - t0
        report, extra = self._after_first_stage(report, {"settle_s": seconds, "total_s": seconds})
        return self._pause_result(report, {**extra, "weights_kept": 1})

    def _after_first_stage(self, report: MemoryReport, extra: dict[str, float]) -> tuple[MemoryReport, dict]:
        """A second pause stage's report and figures joined to the first stage's (kept by ``pause(keep_weights=True)``,
        then forgotten): every class of both, the seconds summed; as they are when no first stage is kept."""
        if self._first_stage is None:
            return report, extra
        first, first_extra = self._first_stage
        self._first_stage = None
        return first.then(report), {**first_extra, **extra, "total_s": first_extra["total_s"] + extra["total_s"]}

    def _pause_result(self, report: MemoryReport, extra: dict[str, float]) -> MemoryResult:
        """A pause's step metrics (``memory/trainer_pause/...``: the report's, then ``extra``'s) on rank 0."""
        out = report.metrics(_PAUSE)
        out.update({f"{_PAUSE}/{k}": v for k, v in extra.items()})
        out[f"{_PAUSE}/effective"] = 1
        return MemoryResult(out, report.after) if self.rank == 0 else MemoryResult()

    def _reserved_bytes(self) -> int:
        """What the CUDA caching allocator holds (in use and cached); 0 elsewhere."""
        return torch.cuda.memory_reserved(self.device) if self.device_type == "cuda" else 0

    def _allocated_bytes(self) -> tuple[int, int]:
        """The device's peak allocated bytes since the last reset (the reserve's, the step's memory figures) and
        those allocated now; zeros elsewhere."""
        if self.device_type != "cuda":
            return 0, 0
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)

    def reserve_transients(self) -> dict[str, float]:
        """Before the first micro-batch after a pause: take back, in one ``cudaMalloc``, the device memory the last
        train needed for its activations and temporaries (``transient_reserve``: at most what the pause's
        ``_free_transients`` handed back), and leave it cached. The train then splits that one block instead of
        allocating its blocks anew (327 ``cudaMalloc`` calls, ~35 ms of host time in the 0.5B preset's train on an
        H100), and the next pause frees one block; both calls take longer the larger the block (~0.45 ms a GB each
        on an H100). At most what the device has free less 1 GiB; nothing without a pause since the last train.
        Metrics ``train_reserve_s`` and ``train_reserved_bytes``."""
        want, self._transient_bytes = self._transient_bytes, 0
        if self.device_type != "cuda" or want < 2**26:
            return {}
        t0 = time.perf_counter()
        free, _ = torch.cuda.mem_get_info(self.device)
        n = min(want, free - 2**30)
        if n < 2**26:
            return {}
        block = torch.empty(n, dtype=torch.uint8, device=self.device)
        del block  # back to the allocator's cache, as one free block
        # The block was never used: the device peak is the train's own (which holds every state class, so it is
        # at least the resume's peak this forgets).
        torch.cuda.reset_peak_memory_stats(self.device)
        return {"train_reserve_s": time.perf_counter() - t0, "train_reserved_bytes": float(n)}

    def _room_to_release_late(self) -> bool:
        """Whether the optimizer state may stay on the device through the weight sync (released by the second pause
        stage, its copy to the host running beside the sync, which only reads the weights): only with a backend
        that settles its optimizer state, and only while the device has room besides it for what the sync brings
        back: the engines' weights in their dtype and one sync buffer, with 1 GiB to spare."""
        if not self.settles_optimizer or self.late_release is not None:
            return bool(self.settles_optimizer and self.late_release)
        engine_bytes = self.num_params * (self.engine_dtype or default_dtype(self.device_type)).itemsize
        need = engine_bytes + min(self.sync_cfg.update_weight_buffer_size, engine_bytes) + 2**30
        if self.device_type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            import psutil

            free = psutil.virtual_memory().available
        return free >= need

    def resume(self, weights_only: bool = False) -> MemoryResult:
        """Bring back what ``pause`` released, bit for bit (grads start from zero at the next step), then the
        process groups when they were released. ``weights_only`` (from PAUSED): the weights and the process
        groups only, WEIGHTS_ONLY after it; a later ``resume()`` brings the rest (the colocated loop's early
        resume, ``--train-resume-early weights``: the weights come back while the engines generate). Memory
        metrics on rank 0."""
        left = self.residency.resume(weights_only)
        if not self.offload:
            return MemoryResult({f"{_RESUME}/effective": 0})
        t0 = time.perf_counter()
        self._first_stage = None
        weights = left is TrainerState.PAUSED
        if weights_only:
            classes = [StateClass.WEIGHTS]
        else:
            classes = [c for c in STATE_CLASSES if weights or c is not StateClass.WEIGHTS]
        # The optimizer state's copy back may run beside the forward and backward: settled before the step.
        report = self.memory.resume(classes, defer=[StateClass.OPTIMIZER] if self.settles_optimizer else [])
        groups = self._rebuild_groups() if weights else {}
        out = report.metrics(_RESUME)
        out.update({f"{_RESUME}/{k}": v for k, v in groups.items()})
        out[f"{_RESUME}/effective"] = 1
        out[f"{_RESUME}/total_s"] = time.perf_counter() - t0
        return MemoryResult(out, report.after) if self.rank == 0 else MemoryResult()

    def profile_next(self, request: ProfileRequest) -> None:
        """Run the next ``train`` under torch.profiler on rank 0, its files as ``request`` says
        (``--profile-rollouts``); call on all ranks."""
        if self.rank == 0:
            self._profile = request

    def _profiled(self, fn: Callable[[], dict]) -> dict:
        """``fn()`` (a backend's train), under torch.profiler when ``profile_next`` asked for it."""
        request, self._profile = self._profile, None
        if request is None:
            return fn()
        return profile_call(request, fn, self.device_type)

    def _init_device(self) -> torch.device:
        """Where presets draw their initial weights (``self.spec``, on ``self.device``): this rank's device with
        ``--init-on-device``, else the host. Every backend and the engines decide alike, so that they draw the
        same weights."""
        from tidal.model.load import preset_init_device

        on = self.model_cfg.init_on_device
        on = init_on_device_default(self.device_type) if on is None else on
        return preset_init_device(self.spec, self.device, on)

    def memory_stats(self) -> dict[str, int]:
        """Host RSS, device peak since the last call, and device memory in use (for the step line)."""
        from tidal.memory.telemetry import process_memory_stats

        return process_memory_stats(self.device_type)

    @property
    def weights_from_backup(self) -> bool:
        """Whether the weight source reads host backups now (paused with offload)."""
        return self.offload and self.residency.paused

    def require_active(self, what: str) -> None:
        """Raise ``ResidencyError`` unless the trainer is ACTIVE (``what`` names the operation)."""
        self.residency.require_active(what)

    def connect_engines(self, engines: list, engine_dtype: str | torch.dtype, colocated: bool | None = None) -> None:
        """Rank 0 builds and connects the weight-sync strategy; every rank records the engine dtype."""
        self.engine_dtype = as_dtype(engine_dtype)
        sync_cfg = self.sync_cfg
        if colocated is None:
            colocated = sync_cfg.update_weight_transport in (None, "tensor")
        if self.rank == 0:
            from tidal.weight_sync import make_strategy

            if self.strategy is not None:
                self.strategy.close()  # a reconnect after a restart: the old engine set's groups and sockets go
            # The engines' own checkpoint folder (None for a preset): version 0 of a delta-over-disk stream.
            self.strategy = make_strategy(
                sync_cfg, engines, device=self.device_type, colocated=colocated, base_dir=self.model_path
            )
            self.strategy.connect()
        self.connected = True

    def update_weights(self, new_version: bool = True) -> SyncReport | None:
        """Weight version += 1 and push every weight to the engines (rank 0 sends; all ranks gather).
        Rank 0 returns the sync's report (its ``metrics()`` are the ``sync/...`` step metrics), others None.
        ``new_version=False`` pushes the current version again (a resync after an engine restart: the
        weights did not change, so neither does their version)."""
        if not self.connected:
            raise ResidencyError("update_weights() before connect_engines(); connect the engines first")
        if new_version:
            self.version += 1
        t0 = time.perf_counter()
        # Full syncs packed on the device (CUDA IPC, NCCL) take device tensors and cast there; every
        # rank decides alike from the config, since the gather is collective.
        from tidal.weight_sync import packs_on_device

        on_device = packs_on_device(self.sync_cfg, self.device_type)
        it = self.iter_weights(self.engine_dtype, on_device=on_device)
        if self.rank != 0:
            for _ in it:
                pass
            return None
        try:
            report = self.strategy.sync(((n, t) for n, t in it), self.version, self.engine_dtype)
        except BaseException:
            # The other ranks still gather every weight with this one (collectives): keep in step to the
            # end, so that they finish too and the failure (an engine that died, say) reaches the driver.
            for _ in it:
                pass
            raise
        report.trainer_s = time.perf_counter() - t0
        report.from_backup = int(self.weights_from_backup)
        return report

    def weight_checksums(self, dtype: str | torch.dtype | None = None) -> dict[str, str]:
        """name -> checksum of the full tensor in the engine dtype (rank 0; ``{}`` elsewhere)."""
        from tidal.weight_sync.checksum import tensor_checksum

        want = as_dtype(dtype) or self.engine_dtype or default_dtype(self.device_type)
        return {name: tensor_checksum(full) for name, full in self.iter_weights(want) if full is not None}

    def state_checksums(self) -> dict[str, str]:
        """Checksums of the fp32 master weights and optimizer tensors (rank 0): a bitwise fingerprint for tests."""
        from tidal.weight_sync.checksum import tensor_checksum

        self.residency.require_whole("state_checksums")
        state = self._settled_state()
        out = {name: tensor_checksum(full) for name, full in state.model_state() if full is not None}
        for name, full in state.optimizer_state():
            if full is not None:
                out[f"optim/{name}"] = tensor_checksum(full)
        return out

    def save(self, dir: str, extra: dict | None = None) -> dict:
        """Atomic checkpoint under ``dir/iter_{rollout:07d}/`` (see ``tidal.checkpoint.store``); works while paused."""
        self.residency.require_whole("save")
        extra = dict(extra or {})
        extra.setdefault("rollout_id", self.last_rollout_id)
        extra["weight_version"] = self.version
        return save_checkpoint(self._settled_state(), dir, extra)

    def load(self, dir: str) -> dict:
        """Resume from the newest complete checkpoint in ``dir``; returns its ``extra`` ({} when there is none)."""
        self.require_active("load")
        extra = load_checkpoint(self._settled_state(), dir)
        if extra:
            self.version = int(extra.get("weight_version", self.version))
            self.last_rollout_id = int(extra.get("rollout_id", self.last_rollout_id))
        return extra

    def export(self, dir: str) -> dict:
        """A Hugging Face folder (config, safetensors, tokenizer) of the current fp32 weights, written atomically."""
        return export_hf(self._settled_state(), dir)

    def _settled_state(self) -> TrainState | ExportSource:
        """``checkpoint_state()`` once no copy back of a deferred resume is still running."""
        self.memory.settle()
        return self.checkpoint_state()
