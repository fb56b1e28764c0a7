"""The rollout-engine interface, modelled on SGLang's engine API.

An engine owns a copy of the policy and generates responses. The calls are named as SGLang names
them so that an SGLang adapter can sit behind the same interface later:

    generate(samples, sampling)              fill response ids, per-token log-probs, text, status
    release_memory(tags) / resume_memory(tags)   tags: "weights", "kv_cache"
    update_weights_from_tensor(payload, version)
    update_weights_from_distributed(meta, version)
    update_weights_from_disk(path, version)
    get_weight_version()
    flush_cache()

Residency is an explicit state machine (AWAKE / WEIGHTS_ONLY / ASLEEP, ``tidal.memory.residency``):
generating while any memory is released, or syncing into released weights, raises a clear error.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from tidal.rollout.types import Sample, SamplingParams

TAGS = ("weights", "kv_cache")


class RolloutEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        """Generate one response per sample (prompt_ids filled); return the samples completed."""

    @abc.abstractmethod
    def release_memory(self, tags: Sequence[str] = TAGS) -> dict:
        """Release device memory of these tags; returns memory telemetry."""

    @abc.abstractmethod
    def resume_memory(self, tags: Sequence[str] = TAGS) -> dict:
        """Re-materialise memory of these tags (weights contents are undefined until a sync)."""

    @abc.abstractmethod
    def update_weights_from_tensor(self, payload: Any, version: int) -> dict:
        """Apply weights handed over in process (colocated)."""

    @abc.abstractmethod
    def update_weights_from_distributed(self, meta: Any, version: int) -> dict:
        """Receive weights over the broadcast group and apply them."""

    @abc.abstractmethod
    def update_weights_from_disk(self, path: str, version: int) -> dict:
        """Load weights from a safetensors folder written by the trainer."""

    @abc.abstractmethod
    def get_weight_version(self) -> int:
        """Version of the weights the engine serves now (-1 before the first sync)."""

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Drop cached KV/prefix state; required before releasing memory and before a sync."""
