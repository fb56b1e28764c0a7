"""Weight sync: move the trainer's new weights into every rollout engine, verified, full or delta.

``make_strategy`` picks the transport module from the (already resolved) config; see ``base.py``
for the interface and ``docs/weight-sync.md`` for how each transport and mode works.
"""

from __future__ import annotations

from tidal.weight_sync.base import NamedTensors, SyncReport, WeightSyncStrategy

__all__ = ["NamedTensors", "SyncReport", "WeightSyncStrategy", "make_strategy"]


def make_strategy(cfg, engines: list, *, device: str, colocated: bool) -> WeightSyncStrategy:
    """The strategy for ``cfg.update_weight_transport`` (tensor | broadcast | nccl | disk) over ``engines``."""
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

        return DiskStrategy(cfg, engines, device=device, colocated=colocated)
    raise ConfigError(f"--update-weight-transport {transport}: unknown; use tensor, broadcast, nccl or disk")
