"""The weight side of the embedded engine: taking weight syncs, loading weights by name, checksums.

``EmbeddedEngine`` (``tidal.rollout.embedded``) is built from this mixin and its generation and memory
half; this half is what ``tidal.weight_sync`` talks to. A sync over the tensor or broadcast transport
arrives as several buckets, one call each: the receiver (``tidal.weight_sync.receiver``) decodes and
applies them through ``load_weights``, and only the bucket that completes a version sets it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from tidal.errors import UserError, WeightSyncError
from tidal.weight_sync.checksum import tensor_checksum

if TYPE_CHECKING:
    from tidal.config.schema import WeightSyncConfig
    from tidal.memory.residency import EngineResidency
    from tidal.model import ModelSpec


class EngineWeights:
    """Weight syncs into ``self.model``. The engine sets what is declared here and has ``flush_cache``
    (called once per version, before its first bucket is applied)."""

    model: torch.nn.Module
    device: torch.device
    spec: ModelSpec
    residency: EngineResidency
    weight_sync_cfg: WeightSyncConfig
    _params: dict[str, torch.nn.Parameter]  # every name a sender may use, tied aliases included
    _version: int = -1
    _receiver: Any = None  # tidal.weight_sync.receiver.WeightReceiver, made on first use
    _flushed_version: int | None = None  # the version whose sync flushed the cache

    def _receiver_(self):
        if self._receiver is None:
            from tidal.weight_sync.receiver import WeightReceiver

            self._receiver = WeightReceiver(self, self.weight_sync_cfg)
        return self._receiver

    def _sync(self, method: str, arg: Any, version: int) -> dict:
        """Check residency, let the receiver decode and apply, then adopt the version once it is complete.

        A sync over tensor or broadcast arrives as several buckets (one call each); only the last one
        completes the version, so the version and ``mark_synced`` wait for it.
        """
        self.residency.require_sync()
        if self._flushed_version != version:  # once per version, not per bucket
            self.flush_cache()
            self._flushed_version = version
        stats = dict(getattr(self._receiver_(), method)(arg) or {})
        if stats.get("complete", True):
            self.residency.mark_synced()
            self._version = int(version)
        return {**stats, "engine_version": self._version}

    def update_weights_from_tensor(self, payload: Any, version: int) -> dict:
        return self._sync("from_tensor", payload, version)

    def update_weights_from_distributed(self, meta: Any, version: int) -> dict:
        return self._sync("from_distributed", meta, version)

    def update_weights_from_disk(self, path: str, version: int) -> dict:
        return self._sync("from_disk", path, version)

    def pull_weights(
        self, source_dir: str, local_checkpoint_dir: str | None = None, target_version: int | str | None = None
    ):
        """slime's ``/pull_weights``: bring this host's local checkpoint up to ``target_version`` (default:
        the newest published) of the disk stream in ``source_dir``; version 0 is this engine's model
        folder. Files only: the engine's weights change when it then loads the local checkpoint with
        ``update_weights_from_disk(local_checkpoint_dir, version)``. Returns a ``PullResult``."""
        from tidal.weight_sync.local_checkpoint import newest_version

        local = local_checkpoint_dir or getattr(self.weight_sync_cfg, "update_weight_local_checkpoint_dir", None)
        if not local:
            raise UserError("pull_weights needs local_checkpoint_dir (or --update-weight-local-checkpoint-dir)")
        target = newest_version(source_dir) if target_version is None else int(target_version)
        return self._receiver_().pull_weights(local, source_dir, target, self.spec.path)

    def init_weights_update_group(
        self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str
    ) -> None:
        self._receiver_().init_group(master_addr, master_port, rank, world_size, backend)

    def destroy_weights_update_group(self) -> None:
        self._receiver_().destroy_group()

    def get_weight_version(self) -> int:
        return self._version

    def set_weight_version(self, version: int) -> None:
        """Adopt a version given with weights loaded by name (an SGLang-protocol update), or a new label."""
        self._version = int(version)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the parameters of the same Hugging Face name, in place; returns bytes copied.

        Dtype and shape must match exactly: the sender casts to the engine dtype, and a silent cast
        here would break the bitwise equality that checksums verify.
        """
        self.residency.require_sync()
        total = 0
        copies: dict[tuple, tuple[list, list]] = {}  # one _foreach_copy_ per source device and pinning
        for name, tensor in named_tensors:
            param = self._params.get(name)
            if param is None:
                raise WeightSyncError(
                    f"weight {name!r} is not a parameter of the engine's model {self.spec.name!r}; trainer and engine must build the same --model"
                )
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightSyncError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, the engine's has {tuple(param.shape)}"
                )
            if tensor.dtype != param.dtype:
                raise WeightSyncError(
                    f"weight {name!r} arrived as {tensor.dtype}, the engine holds {param.dtype}; cast to the engine dtype before sending"
                )
            pinned = tensor.device.type == "cpu" and tensor.is_pinned()
            dsts, srcs = copies.setdefault((tensor.device, pinned), ([], []))
            dsts.append(param.data)
            srcs.append(tensor)
            total += tensor.numel() * tensor.element_size()
        for (_, pinned), (dsts, srcs) in copies.items():
            torch._foreach_copy_(dsts, srcs, non_blocking=pinned)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return total

    @torch.no_grad()
    def randomize_weights(self, seed: int) -> None:
        """Fill every parameter with random values (``--check-weight-update-equal``: a missed tensor shows)."""
        self.residency.require_sync()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for _, p in self.model.named_parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype))

    def weight_checksums(self, algo: str = "xxh3-128") -> dict[str, str]:
        """Name -> checksum of every parameter's bytes (tied weights once), for equality with the trainer."""
        self.residency.require_sync()
        return {name: tensor_checksum(p, algo) for name, p in self.model.named_parameters()}

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Host copies of every parameter (tied once), by Hugging Face name."""
        self.residency.require_sync()
        return {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()}

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())
