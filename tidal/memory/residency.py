"""Residency state machines: where the trainer's and an engine's memory is, checked on every transition.

torch_memory_saver terminates the process on a double pause or on resuming memory that is not
paused, and a weight sync into an engine whose weights are released silently loses the update
(the next resume hands back undefined bytes). These classes make every such order raise a
``ResidencyError`` that names the illegal step *before* any memory call is made.

Trainer (with offload the step pauses in two stages: the optimizer state and gradients after training,
the weights once the sync has read them on the device, so the sync never reads host backups)::

    ACTIVE --pause()--> PAUSED --resume()--> ACTIVE
    ACTIVE --pause(keep_weights=True)--> WEIGHTS_ONLY --pause()--> PAUSED
    WEIGHTS_ONLY --resume()--> ACTIVE

Engine (weights are resumed before the sync and the KV cache after it, so the peak during a
sync is weights + sync buffers, not + KV cache)::

    AWAKE --release()--> ASLEEP --resume_weights()--> WEIGHTS_ONLY --resume_kv()--> AWAKE
    WEIGHTS_ONLY --release()--> ASLEEP

Released engine weights come back with undefined contents, so after ``resume_weights()`` the
engine cannot generate until a sync has rewritten them (``mark_synced()``).
"""

from __future__ import annotations

import threading
from enum import Enum

from tidal.errors import ResidencyError


class TrainerState(str, Enum):
    ACTIVE = "ACTIVE"
    WEIGHTS_ONLY = "WEIGHTS_ONLY"  # optimizer state and gradients paused, weights resident
    PAUSED = "PAUSED"


class EngineState(str, Enum):
    AWAKE = "AWAKE"
    WEIGHTS_ONLY = "WEIGHTS_ONLY"
    ASLEEP = "ASLEEP"


class TrainerResidency:
    """ACTIVE/WEIGHTS_ONLY/PAUSED of one trainer rank. Starts ACTIVE (the model was just built on the device)."""

    def __init__(self, name: str = "trainer"):
        self.name = name
        self.state = TrainerState.ACTIVE
        self._lock = threading.Lock()

    @property
    def paused(self) -> bool:
        """Whether the weights are paused (their host backups are the only readable copy)."""
        return self.state is TrainerState.PAUSED

    def pause(self, keep_weights: bool = False) -> TrainerState:
        """ACTIVE -> PAUSED, ACTIVE -> WEIGHTS_ONLY (``keep_weights``), or WEIGHTS_ONLY -> PAUSED; returns the
        state it left."""
        with self._lock:
            left = self.state
            if left is TrainerState.PAUSED:
                raise ResidencyError(f"{self.name}: pause() while already PAUSED (double pause); call resume() first")
            if left is TrainerState.WEIGHTS_ONLY and keep_weights:
                raise ResidencyError(
                    f"{self.name}: pause(keep_weights=True) while already WEIGHTS_ONLY; pause() releases the weights"
                )
            self.state = TrainerState.WEIGHTS_ONLY if keep_weights else TrainerState.PAUSED
            return left

    def resume(self, weights_only: bool = False) -> TrainerState:
        """PAUSED or WEIGHTS_ONLY -> ACTIVE, or PAUSED -> WEIGHTS_ONLY (``weights_only``: the weights come back
        first, the rest at a later resume); returns the state it left."""
        with self._lock:
            left = self.state
            if left is TrainerState.ACTIVE:
                raise ResidencyError(
                    f"{self.name}: resume() of an ACTIVE trainer (nothing is paused); call pause() first"
                )
            if weights_only and left is not TrainerState.PAUSED:
                raise ResidencyError(
                    f"{self.name}: resume(weights_only=True) while WEIGHTS_ONLY (the weights are live); call resume()"
                )
            self.state = TrainerState.WEIGHTS_ONLY if weights_only else TrainerState.ACTIVE
            return left

    def require_active(self, action: str) -> None:
        """Raise unless all device memory is resident (train, save, forward passes)."""
        if self.state is not TrainerState.ACTIVE:
            raise ResidencyError(
                f"{self.name}: {action} while {self.state.value} (device memory released); call resume() first"
            )

    def require_whole(self, action: str) -> None:
        """Raise in WEIGHTS_ONLY, where the weights are live and the optimizer state paused: what reads both
        (a checkpoint) reads them either all live or all from host backups."""
        if self.state is TrainerState.WEIGHTS_ONLY:
            raise ResidencyError(
                f"{self.name}: {action} while WEIGHTS_ONLY (optimizer state paused, weights live); call pause() "
                "or resume() first"
            )

    def require_paused(self, action: str) -> None:
        """Raise unless the weights are paused (reading them from the host backup only exists then)."""
        if self.state is not TrainerState.PAUSED:
            raise ResidencyError(
                f"{self.name}: {action} while {self.state.value} (the weights have no host backup); read live weights"
            )


class EngineResidency:
    """AWAKE/WEIGHTS_ONLY/ASLEEP of one rollout engine, plus whether its weights hold real values."""

    def __init__(self, name: str = "engine"):
        self.name = name
        self.state = EngineState.AWAKE
        # Weights resumed from a discard hold undefined bytes until a sync rewrites them.
        self.weights_valid = True
        self._lock = threading.Lock()

    def release(self) -> None:
        """KV cache then weights are released (after the cache was flushed)."""
        with self._lock:
            if self.state is EngineState.ASLEEP:
                raise ResidencyError(f"{self.name}: release() while already ASLEEP (double release)")
            self.state = EngineState.ASLEEP
            self.weights_valid = False

    def resume_weights(self) -> None:
        with self._lock:
            if self.state is not EngineState.ASLEEP:
                raise ResidencyError(
                    f"{self.name}: resume_weights() while {self.state.value} (weights are resident); only an ASLEEP "
                    "engine resumes weights"
                )
            self.state = EngineState.WEIGHTS_ONLY

    def resume_kv(self) -> None:
        with self._lock:
            if self.state is EngineState.ASLEEP:
                raise ResidencyError(
                    f"{self.name}: resume_kv() while ASLEEP; resume weights (and sync) before KV cache"
                )
            if self.state is EngineState.AWAKE:
                raise ResidencyError(f"{self.name}: resume_kv() while AWAKE (KV cache is resident); release() first")
            self.state = EngineState.AWAKE

    def require_sync(self) -> None:
        """A weight sync needs resident weights (WEIGHTS_ONLY or AWAKE)."""
        if self.state is EngineState.ASLEEP:
            raise ResidencyError(
                f"{self.name}: weight sync into an ASLEEP engine (weights released, the update would be lost); "
                "call resume_weights() first"
            )

    def mark_synced(self) -> None:
        """A sync rewrote every weight: they hold real values again."""
        self.require_sync()
        self.weights_valid = True

    def require_generate(self) -> None:
        """Generation needs weights and KV cache resident, and weights rewritten since their release."""
        if self.state is not EngineState.AWAKE:
            raise ResidencyError(
                f"{self.name}: generate while {self.state.value}; resume weights, sync, then resume_kv() first"
            )
        if not self.weights_valid:
            raise ResidencyError(
                f"{self.name}: generate with weights resumed but never synced (undefined contents); sync weights first"
            )
