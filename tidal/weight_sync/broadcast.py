"""The ``broadcast`` transport: one process group of the trainer's source rank and every engine.

``connect`` hosts a TCPStore on the trainer, asks every engine to join (``init_weights_update_group``)
and forms the group (gloo on CPU, NCCL on GPU; ``tidal.weight_sync.group``). Per bucket the trainer
first tells the engines what is coming (``update_weights_from_distributed(meta, version)``: the
bucket header), then broadcasts the flat buffer; each engine receives into a buffer of its own,
verifies the checksum and applies. Delta buckets travel the same way (only the encoded bytes).
Engines whose ``health()`` names the ``sglang`` protocol (HTTP engines) get SGLang's layout instead:
the tensors' bytes back to back, with each tensor's checksum in the header (``tensor_checksums``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import ray
import torch

from tidal.errors import ConfigError
from tidal.weight_sync.bucket import BucketHeader
from tidal.weight_sync.checksum import checksum_bytes
from tidal.weight_sync.group import SGLANG_GROUP, broadcast, make_group, master_store
from tidal.weight_sync.stream import Bucket, StreamingStrategy

log = logging.getLogger(__name__)

_LEAVE_TIMEOUT_S = 10.0  # engines leaving the group on close


class BroadcastStrategy(StreamingStrategy):
    transport = "broadcast"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.backend = "nccl" if self.device == "cuda" else "gloo"
        self.sglang = False
        self.pg = None
        self.store = None

    def connect(self) -> None:
        if self.pg is not None:
            return
        if self.backend == "nccl" and self.colocated:
            raise ConfigError(
                "--update-weight-transport nccl with colocated engines: NCCL cannot put two ranks on one GPU; use tensor"
            )
        # Servers speaking SGLang's protocol receive a bucket as its tensors' bytes back to back.
        self.sglang = any(h.protocol == "sglang" for h in ray.get([e.health.remote() for e in self.engines]))
        store, addr, port = master_store()
        world = len(self.engines) + 1
        refs = [
            e.init_weights_update_group.remote(addr, port, i + 1, world, self.backend)
            for i, e in enumerate(self.engines)
        ]
        name = SGLANG_GROUP if self.sglang else None
        self.pg, self.store = make_group(store, addr, port, 0, world, self.backend, sglang_name=name)
        ray.get(refs)

    def _pack_device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def _send(self, bucket: Bucket, header: BucketHeader, attempt: int) -> list:
        if self.pg is None:
            self.connect()
        data = bucket.data
        if self.sglang:
            header = replace(header, tensor_checksums=entry_checksums(data, header.entries))
            data = compact(data, header.entries)
        refs = [e.update_weights_from_distributed.remote(header, header.version) for e in self.engines]
        if self.backend == "nccl" and data.device.type != "cuda":
            data = data.cuda()
        if data.numel():
            broadcast(self.pg, data)
        return refs

    def close(self) -> None:
        """Every engine that still answers leaves the group (as slime does before it reconnects the engines
        after a restart); dropping the group and the store closes the trainer's sockets. An engine that
        died or does not answer within ``_LEAVE_TIMEOUT_S`` is skipped: a new one holds no group."""
        if self.pg is None:
            return
        refs = [e.destroy_weights_update_group.remote() for e in self.engines]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_LEAVE_TIMEOUT_S)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead engine, or a server that forgot the group: nothing to leave
                log.debug("an engine did not leave the weight update group", exc_info=True)
        self.pg = None
        self.store = None


def compact(data: torch.Tensor, entries: list[dict]) -> torch.Tensor:
    """The entries' bytes back to back, without the 64-byte alignment gaps of a packed bucket
    (SGLang's ``flattened_bucket`` layout: each tensor's bytes in order)."""
    if not entries:
        return data[:0]
    parts = [data[e["offset"] : e["offset"] + e["nbytes"]] for e in entries]
    return torch.cat(parts)


def entry_checksums(data: torch.Tensor, entries: list[dict]) -> dict[str, str] | None:
    """xxh3-128 of each tensor's bytes (a server speaking the protocol may check them); host buckets only
    (NCCL buckets live on the device, where xxh3 does not run: they are checked by version and equality)."""
    if data.device.type != "cpu":
        return None
    raw = data.numpy()
    return {e["name"]: checksum_bytes(raw[e["offset"] : e["offset"] + e["nbytes"]]) for e in entries}
