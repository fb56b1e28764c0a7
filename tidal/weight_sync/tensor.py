"""The ``tensor`` transport: colocated engines receive buckets in process, without a serialising copy.

On GPU, a full bucket is copied host -> device into a fresh flat buffer (a fresh one per send: the
engine may still read the previous one) and handed over as a CUDA IPC handle
(``torch.multiprocessing.reductions.reduce_tensor``); the engine maps it and copies device to
device. The trainer keeps the buffer alive until every engine acknowledged.

On CPU (and for delta buckets, which are small host buffers), the bucket goes into the Ray object
store once as a numpy array; every engine on the node maps it zero-copy (``ray.get`` of a numpy
array does not copy) and reads it straight into its parameters.

Payload (``engine.update_weights_from_tensor(payload, version)``): the bucket's
``BucketHeader`` (``stream.Bucket.header``) with ``data``: ``("object", ObjectRef)`` or ``("cuda_ipc", rebuild, args)``.
"""

from __future__ import annotations

from dataclasses import replace

import ray

from tidal.weight_sync.bucket import BucketHeader
from tidal.weight_sync.stream import Bucket, StreamingStrategy


class TensorStrategy(StreamingStrategy):
    transport = "tensor"

    def connect(self) -> None:
        # Nothing to form: the object store and CUDA IPC need no group. Fail early on an empty engine list.
        if not self.engines:
            raise ValueError("tensor weight sync needs at least one engine")

    def _pack_device(self) -> str:
        return "cuda" if self.device == "cuda" else "cpu"

    def _send(self, bucket: Bucket, header: BucketHeader, attempt: int) -> list:
        data = bucket.data
        if data.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            rebuild, args = reduce_tensor(data)
            payload = replace(header, data=("cuda_ipc", rebuild, args))
        else:
            ref = ray.put(data.numpy())
            payload = replace(header, data=("object", ref))
        refs = [e.update_weights_from_tensor.remote(payload, header.version) for e in self.engines]
        # The bucket (device buffer or object) stays referenced by the in-flight record until every engine acknowledged.
        return refs
