"""Weight sync: move the trainer's new weights into every rollout engine, verified, full or delta.

``make_strategy`` picks the transport module from the (already resolved) config; see ``base.py``
for the interface and ``docs/weight-sync.md`` for how each transport and mode works.
"""

from __future__ import annotations

from tidal.weight_sync.base import NamedTensors, SyncReport, WeightSyncStrategy

__all__ = ["NamedTensors", "SyncReport", "WeightSyncStrategy", "make_strategy", "packs_on_device"]


def packs_on_device(cfg, device: str) -> bool:
    """Whether a sync packs its buckets on the GPU and so takes device tensors (``wants_device``).

    Full mode over tensor (CUDA IPC) or broadcast (NCCL) on CUDA; delta encodes on the host and disk
    writes host files. A pure function of the config, so every trainer rank decides alike (the
    gather that feeds the sync is collective) while only rank 0 holds the strategy.
    """
    return device == "cuda" and cfg.update_weight_mode == "full" and cfg.update_weight_transport != "disk"


def make_strategy(
    cfg, engines: list, *, device: str, colocated: bool, base_dir: str | None = None
) -> WeightSyncStrategy:
    """The strategy for ``cfg.update_weight_transport`` (tensor | broadcast | nccl | disk) over ``engines``.

    ``base_dir``: the engines' own checkpoint folder (None for a preset), version 0 of a delta-over-disk stream.
    """
    from tidal.errors import ConfigError

    transport = cfg.update_weight_transport
    if transport is None:
        transport = "tensor" if colocated else "broadcast"
    if transport == "tensor":
        from tidal.weight_sync.tensor import TensorStrategy

        return TensorStrategy(cfg, engines, device=device, colocated=colocated)
    if transport in ("broadcast", "nccl"):
        from tidal.weight_sync.broadcast import BroadcastStrategy

        return BroadcastStrategy(cfg, engines, device=device, colocated=colocated)
    if transport == "disk":
        from tidal.weight_sync.disk import DiskStrategy

        return DiskStrategy(cfg, engines, device=device, colocated=colocated, base_dir=base_dir)
    raise ConfigError(f"--update-weight-transport {transport}: unknown; use tensor, broadcast, nccl or disk")
