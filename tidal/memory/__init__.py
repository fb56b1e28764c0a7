"""Pause and resume of device memory, by state class, for trainers and rollout engines.

Everything in tidal that releases or restores device memory goes through a ``MemoryBackend`` made
here: ``tms`` (torch_memory_saver on CUDA) or ``portable`` (any device; the one CI runs). Callers
also keep a residency state machine (``tidal.memory.residency``) so that illegal orders raise
before any memory call. See docs/memory.md.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.memory.base import MemoryBackend

# The names below are read from their modules on first use (PEP 562): ``tidal.memory.base`` imports
# torch, and the driver imports ``tidal.memory.preload`` and ``tidal.memory.telemetry`` before Ray
# starts, where a 2-core host would spend seconds importing torch for nothing.
_EXPORTS = {
    "ClassPolicy": "base",
    "ClassReport": "base",
    "MemoryBackend": "base",
    "MemoryReport": "base",
    "StateClass": "base",
    "engine_policy": "base",
    "trainer_policy": "base",
    "EngineResidency": "residency",
    "EngineState": "residency",
    "TrainerResidency": "residency",
    "TrainerState": "residency",
    "MemoryTimeline": "telemetry",
    "device_used_bytes": "telemetry",
    "host_rss_bytes": "telemetry",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"tidal.memory.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'tidal.memory' has no attribute {name!r}")


log = logging.getLogger("tidal.memory")

__all__ = [
    "ClassPolicy",
    "ClassReport",
    "EngineResidency",
    "EngineState",
    "MemoryBackend",
    "MemoryReport",
    "MemoryTimeline",
    "StateClass",
    "TrainerResidency",
    "TrainerState",
    "device_used_bytes",
    "engine_policy",
    "host_rss_bytes",
    "make_backend",
    "trainer_policy",
]


def make_backend(
    memory_cfg,
    *,
    device: str,
    role: str,
    offload_train: bool = False,
    weights_host_copy: bool = False,
) -> MemoryBackend:
    """The memory backend of one trainer rank or engine.

    ``role`` is ``"trainer"`` or ``"engine"``. ``offload_train`` means gradient buffers are never
    backed up; ``weights_host_copy`` means the caller keeps its own host copy of the weights, so
    the backend does not back them up a second time. ``memory_backend="auto"`` picks tms on CUDA
    when torch_memory_saver is installed and a driver loads, else portable (logged once).
    """
    from tidal.memory.base import engine_policy, trainer_policy
    from tidal.memory.preload import resolve_backend

    if role == "trainer":
        policy = trainer_policy(grads_backup=not offload_train, weights_backup=not weights_host_copy)
    elif role == "engine":
        policy = engine_policy()
    else:
        raise ValueError(f"role must be 'trainer' or 'engine', not {role!r}")
    kind, problem = resolve_backend(memory_cfg.memory_backend, device)
    if problem is not None:
        log.info("memory: portable backend for the %s (%s)", role, problem)
    # A config built in code and never resolved leaves the policy unset: release, the backends' own default.
    host_memory = memory_cfg.offload_host_memory or "release"
    common = dict(host_memory=host_memory, disk_dir=memory_cfg.offload_disk_dir, label=role)
    if kind == "tms":
        from tidal.memory.tms import TmsBackend

        # Engines are never started with LD_PRELOAD (only trainer actors get actor_env()), so they
        # hook allocations in process.
        hook_mode = memory_cfg.tms_hook_mode if role == "trainer" else "torch"
        return TmsBackend(policy, device=device, hook_mode=hook_mode, **common)
    from tidal.memory.portable import PortableBackend

    return PortableBackend(policy, device=device, **common)
