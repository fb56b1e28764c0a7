"""The engine side of weight sync: receive a bucket, verify it, apply it to the engine's weights.

An engine actor holds one ``WeightReceiver(engine)``. ``engine`` provides ``load_weights(pairs)``
(copies tensors into parameters by name, in place) and ``device``. The actor's
``update_weights_*`` methods check residency, then call:

    from_tensor(payload)      colocated: a bucket from the object store (host) or a CUDA IPC handle
    from_distributed(meta)    a bucket broadcast over the group formed by ``init_group``
    from_disk(path)           a full folder: a version written in full mode, or the host-local checkpoint
    pull_weights(local, source, target, base)   bring the local checkpoint up to a version of the disk stream

Each returns a stats dict: ``apply_s``, ``bytes``, ``complete`` (True once the version is fully
applied: the engine should set its version only then) and ``version``.

Verification: a bucket whose checksum does not match is refused before anything is applied
(``WeightSyncError``; the trainer re-sends it in full). Delta entries are applied to the receiver's
host snapshot and each tensor's checksum is compared before any of the bucket reaches the engine.
On the last bucket of a version the receiver checks that every weight the trainer named was
applied (or, in delta mode, re-loads the unchanged ones from its snapshot).

Delta over tensor/broadcast needs the bytes the engine held after the previous sync, but a
colocated engine discards its weights while it sleeps. So in delta mode the receiver keeps its own
host snapshot of the last applied weights: host memory = one copy of the model in the engine dtype
per engine process, and after every delta the engine re-loads every weight from it (host -> device
copy of the whole model; the wire carries only the changes).
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from tidal.errors import WeightSyncError
from tidal.weight_sync import delta as codec
from tidal.weight_sync.bucket import BucketHeader, buffer_checksum, dtype_of, entry_views


class WeightReceiver:
    def __init__(self, engine, weight_sync=None):
        self.engine = engine
        self.cfg = weight_sync if weight_sync is not None else getattr(engine, "weight_sync_cfg", None)
        self.pg = None
        self.store = None
        self.device = torch.device(getattr(engine, "device", "cpu"))
        # Delta mode: host snapshot of the last applied bytes, name -> (uint8 array, dtype, shape).
        self.snapshot: dict[str, tuple[np.ndarray, str, list[int]]] = {}
        self.snapshot_version: int | None = None
        self._loaded: set[str] = set()
        self._loading_version: int | None = None

    # ------------------------------------------------------------------ transports

    def init_group(self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str) -> None:
        from tidal.weight_sync.group import make_group

        self.pg, self.store = make_group(None, master_addr, master_port, rank, world_size, backend)

    def destroy_group(self) -> None:
        self.pg = self.store = None  # the group's sockets close with it

    def from_tensor(self, payload: BucketHeader) -> dict:
        return self.apply_bucket(payload, bucket_buffer(payload))

    def from_distributed(self, meta: BucketHeader) -> dict:
        if self.pg is None:
            raise WeightSyncError("update_weights_from_distributed before init_weights_update_group")
        from tidal.weight_sync.group import broadcast

        on_device = self.device.type == "cuda" and type(self.pg).__name__ == "ProcessGroupNCCL"
        buf = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device if on_device else "cpu")
        broadcast(self.pg, buf)
        return self.apply_bucket(meta, buf)

    def from_disk(self, path: str) -> dict:
        from tidal.weight_sync.local_checkpoint import load_folder

        return load_folder(self, path)

    def pull_weights(self, local_checkpoint_dir: str, source_dir: str, target_version: int, base_dir: str | None):
        """Bring this host's local checkpoint up to ``target_version`` of the disk stream in ``source_dir``
        (``base_dir``: the engine's own checkpoint, version 0); returns a ``PullResult``."""
        from tidal.weight_sync.local_checkpoint import pull

        return pull(local_checkpoint_dir, source_dir, target_version, base_dir)

    # ------------------------------------------------------------------ applying

    def apply_bucket(self, header: BucketHeader, buf: torch.Tensor) -> dict:
        t0 = time.perf_counter()
        version = header.version
        if self._loading_version != version:
            self._loaded = set()
            self._loading_version = version
        got = buffer_checksum(buf)
        if got != header.checksum:
            raise WeightSyncError(
                f"weight sync v{version}: bucket {header.index} checksum mismatch ({got} != {header.checksum}); nothing applied"
            )
        entries = header.entries
        if header.mode == "full":
            pairs = [(e["name"], t) for e, t in zip(entries, entry_views(buf, entries))]
            self.load(pairs)
            if header.keep_snapshot:
                for name, t in pairs:
                    self._remember(name, t)
        else:
            self._apply_delta(header, buf)
        nbytes = sum(e["nbytes"] for e in entries)
        if header.last:
            self._finish(header)
        return {
            "apply_s": time.perf_counter() - t0,
            "bytes": nbytes,
            "complete": bool(header.last),
            "version": version,
        }

    def load(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        if pairs:
            self.engine.load_weights(pairs)
        self._loaded.update(n for n, _ in pairs)

    def _remember(self, name: str, t: torch.Tensor) -> None:
        host = t.detach().reshape(-1).view(torch.uint8)
        host = host.cpu() if host.device.type != "cpu" else host
        arr = self.snapshot.get(name)
        if arr is not None and arr[0].size == host.numel():
            np.copyto(arr[0], host.numpy())
            self.snapshot[name] = (arr[0], str(t.dtype).removeprefix("torch."), list(t.shape))
        else:
            # Pinned on GPU engines: after every delta all weights are re-loaded from here, at pinned H2D speed.
            pinned = self.device.type == "cuda"
            copy = torch.empty(host.numel(), dtype=torch.uint8, pin_memory=pinned)
            copy.copy_(host)
            self.snapshot[name] = (copy.numpy(), str(t.dtype).removeprefix("torch."), list(t.shape))

    def snapshot_tensor(self, name: str) -> torch.Tensor:
        arr, dtype, shape = self.snapshot[name]
        return torch.from_numpy(arr).view(dtype_of(dtype)).view(shape)

    def _apply_delta(self, header: BucketHeader, buf: torch.Tensor) -> None:
        base = header.base_version
        if self.snapshot_version != base:
            raise WeightSyncError(
                f"weight sync v{header.version}: delta against v{base} but this engine's snapshot is v{self.snapshot_version}"
            )
        host = buf if buf.device.type == "cpu" else buf.cpu()
        raw = host.numpy()
        entries = header.entries
        for e in entries:
            if e["name"] not in self.snapshot:
                raise WeightSyncError(f"weight sync v{header.version}: delta for {e['name']} but no base for it")
        items = [
            (
                self.snapshot[e["name"]][0],
                memoryview(raw[e["offset"] : e["offset"] + e["nbytes"]]),
                e["chunks"],
                e["digest_chunk"],
            )
            for e in entries
        ]
        algo = header.checksum_format
        try:
            sums = codec.apply_many(items, header.encoding, header.compression, algo)
        except Exception:
            # Snapshots of this bucket may be half-written: forget them so only a full re-send restores them.
            for e in entries:
                self.snapshot.pop(e["name"], None)
            raise
        bad = [e["name"] for e, got in zip(entries, sums) if e["checksum"] and got != e["checksum"]]
        if bad:
            for name in bad:
                del self.snapshot[name]
            raise WeightSyncError(
                f"weight sync v{header.version}: {len(bad)} tensors do not match their checksums after applying the delta, e.g. {bad[:3]}"
            )
        self.load([(e["name"], self.snapshot_tensor(e["name"])) for e in entries])

    def _finish(self, header: BucketHeader) -> None:
        names = header.all_names
        if header.keep_snapshot:
            rest = [n for n in names if n not in self._loaded]
            missing = [n for n in rest if n not in self.snapshot]
            if missing:
                raise WeightSyncError(
                    f"weight sync v{header.version}: no snapshot for {missing[:3]} (of {len(missing)})"
                )
            # Unchanged weights: the engine may have discarded them while asleep, so load them again.
            self.load([(n, self.snapshot_tensor(n)) for n in rest])
            self.snapshot_version = header.version
        missing = [n for n in names if n not in self._loaded]
        if missing:
            raise WeightSyncError(
                f"weight sync v{header.version}: {len(missing)} weights never arrived, e.g. {missing[:3]}"
            )
        self._loaded = set()
        self._loading_version = None


def bucket_buffer(payload: BucketHeader) -> torch.Tensor:
    """The flat bytes of a tensor-transport bucket: a CUDA IPC handle mapped, or the object-store array."""
    if payload.data is None:
        raise WeightSyncError(f"weight sync v{payload.version}: bucket {payload.index} carries no tensor payload")
    kind = payload.data[0]
    if kind == "cuda_ipc":
        _, rebuild, args = payload.data
        return rebuild(*args)
    if kind == "object":
        import ray

        arr = ray.get(payload.data[1])
        with warnings.catch_warnings():
            # The object store maps the bucket read-only; it is only ever read here.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    raise WeightSyncError(f"unknown tensor payload kind {kind!r}")
