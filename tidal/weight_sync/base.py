"""The weight-sync interface: move the trainer's new weights into every engine.

A strategy runs on the trainer's source rank (rank 0) and holds handles of the engine actors; the
driver calls ``trainer.update_weights()`` and the trainer calls ``strategy.sync(...)``. Strategies
(one module each) differ in how bytes travel:

    tensor     colocated: buckets handed over in process (CUDA IPC on GPU, shared memory on CPU)
    broadcast  a process group of the trainer's source rank and every engine rank (NCCL / gloo)
    disk       a Hugging Face safetensors folder per version that engines reload

and in what they send (``full``: every byte; ``delta``: changed bytes against a host snapshot of
what the engines hold). Every sync bumps the weight version, which engines report back; every
bucket carries a checksum that the engine verifies before applying it.

The trainer feeds a strategy ``(name, tensor)`` pairs and names the engine dtype. Tensors are read
from the trainer's host backup when it is paused (never from paused device memory). Host tensors
are the rule; a strategy whose ``wants_device`` is true (full mode packed on a CUDA device: CUDA IPC,
NCCL) also takes the live device tensors of an active trainer and casts on the device, so a GPU
trainer's weights never cross PCIe to reach a colocated engine.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass
class SyncReport:
    """Telemetry of one sync, with the same names for every transport."""

    mode: str
    transport: str
    version: int
    bytes_total: int = 0  # bytes of all weights
    bytes_sent: int = 0  # bytes that crossed the transport
    changed_bytes: int = 0  # bytes that differ from the engines' previous weights (delta; = total for full)
    gather_s: float = 0.0
    encode_s: float = 0.0
    send_s: float = 0.0
    apply_s: float = 0.0
    seconds: float = 0.0
    retried: bool = False
    trainer_s: float = 0.0  # the trainer's whole update (gather + sync), set by the trainer
    from_backup: int = 0  # 1 when the trainer read its weights from host backups (paused)

    @property
    def density(self) -> float:
        return self.changed_bytes / self.bytes_total if self.bytes_total else 0.0

    @property
    def gbps(self) -> float:
        return self.bytes_total / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def metrics(self, prefix: str = "sync") -> dict[str, float | str]:
        out = {f"{prefix}/{k}": v for k, v in asdict(self).items()}
        out[f"{prefix}/density"] = self.density
        out[f"{prefix}/gbps"] = self.gbps
        return out


class WeightSyncStrategy(abc.ABC):
    """Moves named tensors from the trainer's source rank into every engine."""

    transport: str = "abstract"

    @abc.abstractmethod
    def connect(self) -> None:
        """One-time setup with the engines (form a process group, create a folder, ...)."""

    @abc.abstractmethod
    def sync(self, tensors: NamedTensors, version: int, dtype: torch.dtype | None = None) -> SyncReport:
        """Send ``tensors`` (cast to the engine ``dtype`` when given) as weight version ``version``;
        return when every engine applied and verified it."""

    @property
    def wants_device(self) -> bool:
        """Whether the trainer may feed device tensors (the strategy packs and casts on the device)."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release transport resources (process groups, temp files)."""
