"""Residency state machines: where the trainer's and an engine's memory is, checked on every transition.

torch_memory_saver terminates the process on a double pause or on resuming memory that is not
paused, and a weight sync into an engine whose weights are released silently loses the update
(the next resume hands back undefined bytes). These classes make every such order raise a
``ResidencyError`` that names the illegal step *before* any memory call is made.

Trainer::

    ACTIVE --pause()--> PAUSED --resume()--> ACTIVE

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
    PAUSED = "PAUSED"


class EngineState(str, Enum):
    AWAKE = "AWAKE"
    WEIGHTS_ONLY = "WEIGHTS_ONLY"
    ASLEEP = "ASLEEP"


class TrainerResidency:
    """ACTIVE/PAUSED of one trainer rank. Starts ACTIVE (the model was just built on the device)."""

    def __init__(self, name: str = "trainer"):
        self.name = name
        self.state = TrainerState.ACTIVE
        self._lock = threading.Lock()

    @property
    def paused(self) -> bool:
        return self.state is TrainerState.PAUSED

    def pause(self) -> None:
        with self._lock:
            if self.state is TrainerState.PAUSED:
                raise ResidencyError(f"{self.name}: pause() while already PAUSED (double pause); call resume() first")
            self.state = TrainerState.PAUSED

    def resume(self) -> None:
        with self._lock:
            if self.state is TrainerState.ACTIVE:
                raise ResidencyError(
                    f"{self.name}: resume() of an ACTIVE trainer (nothing is paused); call pause() first"
                )
            self.state = TrainerState.ACTIVE

    def require_active(self, action: str) -> None:
        """Raise unless the device memory is resident (train, save, forward passes)."""
        if self.state is not TrainerState.ACTIVE:
            raise ResidencyError(f"{self.name}: {action} while PAUSED (device memory released); call resume() first")

    def require_paused(self, action: str) -> None:
        """Raise unless paused (reading weights from the host backup only exists while paused)."""
        if self.state is not TrainerState.PAUSED:
            raise ResidencyError(f"{self.name}: {action} while ACTIVE (there is no host backup); read live weights")


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
