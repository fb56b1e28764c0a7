"""The rollout-engine interface every engine implements, modelled on SGLang's engine API.

An engine owns a copy of the policy and generates responses. The driver, ``orchestrate`` and
every weight-sync strategy talk to engines only through these calls (as Ray actor methods), so an
embedded engine (``tidal.rollout.actor.EngineActor``: the policy inside the actor) and an HTTP
engine (``tidal.rollout.http_engine.HttpEngineActor``: a client of a server speaking SGLang's
protocol) are interchangeable. The calls are named as SGLang names its endpoints:

    generate(samples, sampling)                  prompt_ids in; response ids, raw-policy log-probs,
                                                 finish status and weight version filled in
    release_memory(tags) / resume_memory(tags)   tags: "weights", "kv_cache"      -> MemoryReport
    update_weights_from_tensor(bucket, version)  colocated, one bucket per call    -> WeightUpdateResult
    update_weights_from_distributed(bucket, version)  header, then the broadcast   -> WeightUpdateResult
    update_weights_from_disk(path, version)      a safetensors folder per version  -> WeightUpdateResult
    pull_weights(source_dir, local_checkpoint_dir, target_version)  delta over disk -> PullResult
    init_weights_update_group(...)               join the trainer's broadcast group
    get_weight_version() / flush_cache() / pause_generation() / continue_generation()
    health()                                     -> EngineHealth (the driver's liveness probe)

Results are the dataclasses below, never free-form dicts. A weight bucket's header (``BucketHeader``, a
dataclass in ``tidal.weight_sync.bucket``) is the message ``tidal.weight_sync.stream`` builds: its
entries, checksum and flags (plus, for the tensor transport, where its bytes are).

Residency is an explicit state machine (AWAKE / WEIGHTS_ONLY / ASLEEP, ``tidal.memory.residency``):
generating while any memory is released, or syncing into released weights, raises a clear error.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig, TrainerConfig, WeightSyncConfig
from tidal.memory.base import MemoryFigures
from tidal.profiling import ProfileRequest
from tidal.rollout.types import DecodeStats, Sample, SamplingParams, WarmUpReport
from tidal.weight_sync.bucket import BucketHeader  # the weight-bucket message (``Bucket.header`` builds it)
from tidal.weight_sync.local_checkpoint import PullResult

TAGS = ("weights", "kv_cache")


@dataclass
class MemoryReport:
    """What a release or resume did: the residency state after it and memory figures (``memory/...``)."""

    residency: str
    metrics: dict[str, float | int] = field(default_factory=dict)
    after: MemoryFigures | None = None  # process memory after it, where the engine measures it


@dataclass
class WeightUpdateResult:
    """One weight-update call's outcome: ``complete`` once the whole version is applied."""

    version: int  # the version this call carried
    complete: bool  # True on the last bucket (the engine adopted ``version``)
    engine_version: int  # the version the engine serves after the call
    apply_s: float = 0.0
    nbytes: int = 0


@dataclass
class EngineHealth:
    """An engine's answer to the liveness probe."""

    engine_rank: int
    weight_version: int
    residency: str
    address: str = ""  # host:port of an HTTP engine's server; empty for an embedded engine
    protocol: str = "tidal"  # how weight buckets must travel: "tidal" (as packed) or "sglang" (SGLang's layout)


class RolloutEngine(abc.ABC):
    def __init__(
        self,
        engine_rank: int,
        *,
        model: ModelConfig,
        rollout: RolloutConfig,
        memory: MemoryConfig,
        weight_sync: WeightSyncConfig,
        device: str,
        seed: int = TrainerConfig.seed,
    ) -> None:
        """What every engine is built from: its rank, the config sections it reads, its device and
        ``seed``, the trainer's model-init seed (``--seed``), so that both build the same weights.
        Nothing is built here: ``init()`` builds (a failure there is the remote call's error)."""
        self.engine_rank = engine_rank
        self.model_cfg, self.rollout_cfg, self.memory_cfg, self.weight_sync_cfg = model, rollout, memory, weight_sync
        self.device, self.seed = device, seed

    @abc.abstractmethod
    def generate(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        """Generate one response per sample (prompt_ids filled); return the samples completed."""

    def warm_up(self, rows: int, sampling: SamplingParams) -> WarmUpReport:
        """Compile and capture what a first ``generate`` of ``rows`` samples under ``sampling`` would, before it
        (``--warm-up``), leaving no trace in later calls' results. An engine with nothing to warm returns an
        empty report (a server warms itself)."""
        return WarmUpReport()

    def take_decode_stats(self) -> DecodeStats:
        """Where this engine's generate calls spent their time since the last ask (then zero again): the
        rollout's ``decode/*`` metrics. An engine that does not decode itself returns zeros."""
        return DecodeStats()

    @abc.abstractmethod
    def release_memory(self, tags: Sequence[str] = TAGS) -> MemoryReport:
        """Release device memory of these tags."""

    @abc.abstractmethod
    def resume_memory(self, tags: Sequence[str] = TAGS) -> MemoryReport:
        """Re-materialise memory of these tags (weights contents are undefined until a sync)."""

    @abc.abstractmethod
    def update_weights_from_tensor(self, bucket: BucketHeader, version: int) -> WeightUpdateResult:
        """Apply one bucket handed over in process (colocated)."""

    @abc.abstractmethod
    def update_weights_from_distributed(self, bucket: BucketHeader, version: int) -> WeightUpdateResult:
        """Receive one bucket over the broadcast group and apply it."""

    @abc.abstractmethod
    def update_weights_from_disk(self, path: str, version: int) -> WeightUpdateResult:
        """Load weights from a safetensors folder written by the trainer."""

    @abc.abstractmethod
    def pull_weights(
        self, source_dir: str, local_checkpoint_dir: str | None = None, target_version: int | str | None = None
    ) -> PullResult:
        """slime's ``/pull_weights`` (delta over disk): bring the engine's host-local checkpoint up to
        ``target_version`` from the versions published under ``source_dir``, each verified; the engine's
        weights change with the next ``update_weights_from_disk`` of that folder."""

    @abc.abstractmethod
    def init_weights_update_group(
        self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str
    ) -> None:
        """Join the trainer's weight broadcast group as ``rank`` (blocks until the group formed)."""

    @abc.abstractmethod
    def destroy_weights_update_group(self) -> None:
        """Leave the broadcast group (SGLang's ``/destroy_weights_update_group``): the trainer forms a new
        one when it reconnects the engine set after a restart."""

    @abc.abstractmethod
    def get_weight_version(self) -> int:
        """Version of the weights the engine serves now (-1 before the first sync)."""

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Called before releasing memory and before a sync; the name is SGLang's endpoint's.

        What it does depends on the engine: an SGLang server (``HttpEngineActor``) drops its radix
        (prefix) cache and KV pool contents; the embedded engine keeps no KV or prefix state past a
        ``generate`` call, so there it only returns the CUDA caching allocator's free blocks to the
        driver (``gc.collect()`` + ``torch.cuda.empty_cache()``) and does nothing on CPU.
        """

    @abc.abstractmethod
    def pause_generation(self) -> None:
        """Stop generating until ``continue_generation``. The embedded engine cuts a running ``generate`` at its
        next step boundary (rows cut short come back ``aborted``, to be continued by a later call); an HTTP
        engine asks its server for SGLang's ``abort`` mode (requests in flight come back aborted, and its
        ``generate`` sends them again, answered once the server continues); with ``--partial-rollout`` it
        aborts them (``/abort_request``) and returns their rows ``aborted`` with the tokens they had."""

    @abc.abstractmethod
    def continue_generation(self) -> None:
        """Take generate work again after ``pause_generation``."""

    @abc.abstractmethod
    def health(self) -> EngineHealth:
        """Answer the liveness probe (raises when the engine cannot serve)."""

    @abc.abstractmethod
    def weight_checksums(self, algo: str = "xxh3-128") -> dict[str, str]:
        """Name -> checksum of every weight's bytes (``--check-weight-update-equal``)."""

    @abc.abstractmethod
    def randomize_weights(self, seed: int) -> None:
        """Fill every weight with random values (before the first sync of an equality check)."""

    def profile_next(self, request: ProfileRequest) -> bool:
        """Run the next ``generate`` under torch.profiler, its files as ``request`` says (``--profile-rollouts``);
        False where this engine cannot (a server in another process: use its own profiler)."""
        return False


def update_result(stats: dict, engine_version: int) -> WeightUpdateResult:
    """The typed result of a receiver's stats (``apply_s``, ``bytes``, ``complete``, ``version``)."""
    return WeightUpdateResult(
        version=int(stats.get("version", engine_version)),
        complete=bool(stats.get("complete", True)),
        engine_version=int(engine_version),
        apply_s=float(stats.get("apply_s", 0.0)),
        nbytes=int(stats.get("bytes", 0)),
    )
