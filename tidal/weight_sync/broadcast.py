"""The ``broadcast`` transport: one process group of the trainer's source rank and every engine.

``connect`` hosts a TCPStore on the trainer, asks every engine to join (``init_weights_update_group``)
and forms the group (gloo on CPU, NCCL on GPU; ``tidal.weight_sync.group``). Per bucket the trainer
first tells the engines what is coming (``update_weights_from_distributed(meta, version)``: the
bucket header), then broadcasts the flat buffer; each engine receives into a buffer of its own,
verifies the checksum and applies. Delta buckets travel the same way (only the encoded bytes).
"""

from __future__ import annotations

import ray

from tidal.errors import ConfigError
from tidal.weight_sync.group import broadcast, make_group, master_store
from tidal.weight_sync.stream import Bucket, StreamingStrategy


class BroadcastStrategy(StreamingStrategy):
    transport = "broadcast"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.backend = "nccl" if self.device == "cuda" else "gloo"
        self.pg = None
        self.store = None

    def connect(self) -> None:
        if self.pg is not None:
            return
        if self.backend == "nccl" and self.colocated:
            raise ConfigError(
                "--update-weight-transport nccl with colocated engines: NCCL cannot put two ranks on one GPU; use tensor"
            )
        store, addr, port = master_store()
        world = len(self.engines) + 1
        refs = [
            e.init_weights_update_group.remote(addr, port, i + 1, world, self.backend)
            for i, e in enumerate(self.engines)
        ]
        self.pg, self.store = make_group(store, addr, port, 0, world, self.backend)
        ray.get(refs)

    def _pack_device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def _send(self, bucket: Bucket, header: dict, attempt: int) -> list:
        if self.pg is None:
            self.connect()
        refs = [e.update_weights_from_distributed.remote(header, header["version"]) for e in self.engines]
        data = bucket.data
        if self.backend == "nccl" and data.device.type != "cuda":
            data = data.cuda()
        broadcast(self.pg, data)
        return refs

    def close(self) -> None:
        # Dropping the group and the store closes their sockets; engines drop theirs on their next join.
        self.pg = None
        self.store = None
