"""The sync loop shared by the in-memory transports (``tensor``, ``broadcast``).

``sync`` consumes the trainer's ``(name, tensor)`` stream once and turns it into buckets of at most
``--update-weight-buffer-size`` bytes. At most four exist at a time: the one being filled, one held
back (so that the final bucket can be marked ``last``) and two in flight (the next one travels while
engines apply the previous one). The last bucket is sent only after every other was acknowledged.
The stream's tensors must stay valid until their bucket was sent (they are not copied first). Each bucket carries a
checksum that every engine verifies before applying it. The transport subclass only says how one
bucket reaches the engines (``_send``).

Modes: ``full`` packs raw bytes. ``delta`` keeps a host snapshot of what the engines hold
(``DeltaState``): the first sync is a full baseline that both sides snapshot; later syncs pack only
the encoded changes, and the last bucket names every weight so each engine can re-load the
unchanged ones from its own snapshot (engine weights are discarded while it sleeps).

Failure handling: an engine that rejects a bucket (checksum mismatch, missing delta base) raises
``WeightSyncError``; the bucket is re-sent once as full bytes (re-packed from its source tensors, or
from the snapshot in delta mode), and a second rejection fails the sync loudly. After the last
bucket every engine must report the new version.

``fault_hook`` is a test-only seam: called as ``fault_hook(bucket_index, attempt, buffer)`` with the
outgoing buffer after its checksum was taken, so a test can corrupt a bucket in flight.
"""

from __future__ import annotations

import abc
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import ray
import torch

from tidal.config.schema import WeightSyncConfig
from tidal.errors import WeightSyncError, last_line
from tidal.weight_sync import delta as delta_codec
from tidal.weight_sync import packs_on_device
from tidal.weight_sync.base import NamedTensors, SyncReport, WeightSyncStrategy
from tidal.weight_sync.bucket import (
    ALIGN,
    BucketHeader,
    align,
    buffer_checksum,
    dtype_name,
    entry_view,
    nbytes_of,
    pack,
    plan_buckets,
)
from tidal.weight_sync.checksum import as_numpy_u8
from tidal.weight_sync.delta import DeltaState

if TYPE_CHECKING:  # the engines' result type; no runtime import of the rollout package
    from tidal.rollout.engine import WeightUpdateResult


def timed_stream(
    tensors: NamedTensors,
    report: SyncReport,
    names: list[str] | None = None,
    *,
    dtype: torch.dtype | None = None,
    on_device: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the trainer's stream through, timing its gather (``gather_s``), counting ``bytes_total``
    (in ``dtype`` when given) and, when ``names`` is given, recording every name.

    ``on_device``: the consumer packs on the device and casts there, so tensors pass as they are
    (device or host, any dtype). Otherwise every tensor is brought to the host in ``dtype``.
    """
    it = iter(tensors)
    while True:
        t0 = time.perf_counter()
        try:
            name, t = next(it)
        except StopIteration:
            return
        if not on_device:
            t = to_host(t, dtype)
        report.gather_s += time.perf_counter() - t0
        report.bytes_total += t.numel() * (dtype or t.dtype).itemsize
        if names is not None:
            names.append(name)
        yield name, t


def to_host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on the host in ``dtype``: cast where it lives first (a device cast halves the bytes that
    cross PCIe for fp32 -> bf16), then copy through pinned memory rather than a pageable transfer.

    A pinned host tensor (a paused trainer's backup) in another dtype makes a round trip through the
    GPU when there is one: PCIe moves 50+ GB/s, while the host converts fp32 -> bf16 at ~1.5 GB/s.
    """
    if dtype is not None and t.dtype != dtype:
        if t.device.type == "cpu" and t.is_pinned() and torch.cuda.is_available():
            t = t.to("cuda", non_blocking=True)
        t = t.to(dtype)
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return out


@dataclass
class Bucket:
    """One message: a header (entries, checksum, flags) and its flat byte buffer."""

    index: int
    mode: str  # "full" (raw bytes) or "delta" (encoded)
    entries: list[dict]
    data: torch.Tensor  # flat uint8, host or device
    names: list[str]
    group: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # full: the source tensors, for a re-send
    last: bool = False
    all_names: list[str] = field(default_factory=list)

    def header(self, version: int, base_version: int | None, keep_snapshot: bool, encoding: dict) -> BucketHeader:
        """``encoding``: the sync's ``encoding``, ``compression`` and ``checksum_format`` (empty for full syncs)."""
        return BucketHeader(
            version=version,
            base_version=base_version,
            index=self.index,
            mode=self.mode,
            entries=self.entries,
            nbytes=self.data.numel(),
            checksum=buffer_checksum(self.data),
            keep_snapshot=keep_snapshot,
            last=self.last,
            all_names=self.all_names if self.last else [],
            **encoding,
        )


@dataclass
class InFlight:
    bucket: Bucket
    header: BucketHeader
    refs: list
    attempt: int
    t0: float


class StreamingStrategy(WeightSyncStrategy):
    """Bucketed sync with per-bucket verification and a one-shot full re-send; transports implement ``_send``."""

    transport = "abstract"

    def __init__(self, cfg: WeightSyncConfig, engines: list, *, device: str = "cpu", colocated: bool = True):
        self.cfg = cfg
        self.engines = list(engines)
        self.device = device
        self.colocated = colocated
        self.mode = cfg.update_weight_mode
        self.limit = int(cfg.update_weight_buffer_size)
        self.delta = (
            DeltaState(cfg.update_weight_delta_encoding, cfg.update_weight_compression, cfg.update_weight_checksum)
            if self.mode == "delta"
            else None
        )
        self.fault_hook: Callable[[int, int, object], None] | None = None
        self.version: int | None = None  # the version every engine holds
        self._dtype: torch.dtype | None = None  # the engine dtype of the running sync (None: as fed)
        self.depth = 2  # buckets in flight: the next one travels while engines apply the previous one
        self._inflight: deque[InFlight] = deque()

    # -- transport ---------------------------------------------------------------------------------

    def _pack_device(self) -> str:
        """Where full buckets are packed: on the device for CUDA IPC / NCCL, else host memory."""
        return "cpu"

    @property
    def wants_device(self) -> bool:
        """True when full buckets are packed on the device: the trainer may then feed device tensors
        (and host tensors in another dtype), and every cast runs on the device. Delta mode encodes
        on the host, so it always takes host tensors."""
        return packs_on_device(self.cfg, self.device)

    @abc.abstractmethod
    def _send(self, bucket: Bucket, header: BucketHeader, attempt: int) -> list:
        """Start delivering one bucket to every engine; return the engines' result refs (``WeightUpdateResult``)."""

    # -- the loop ----------------------------------------------------------------------------------

    def sync(self, tensors: NamedTensors, version: int, dtype: torch.dtype | None = None) -> SyncReport:
        report = SyncReport(mode=self.mode, transport=self.transport, version=version)
        self._dtype = dtype
        start = time.perf_counter()
        delta = self.delta is not None and self.delta.has_base and self.version is not None
        all_names: list[str] = []
        pending: Bucket | None = None
        try:
            for bucket in self._buckets(self._timed(tensors, report, all_names), delta, report):
                if pending is not None:
                    self._deliver(pending, version, delta, report)
                pending = bucket
            if pending is None:  # nothing changed (delta) or nothing to send: still commit the version
                empty = torch.zeros(ALIGN, dtype=torch.uint8)
                pending = Bucket(index=0, mode="delta" if delta else "full", entries=[], data=empty, names=[])
            pending.last = True
            pending.all_names = all_names
            self._deliver(pending, version, delta, report)
        except BaseException:
            # The engines may hold a mix of versions now: the next sync must be a full baseline.
            self.version = None
            if self.delta is not None:
                self.delta.version = None
            raise
        self.version = version
        if self.delta is not None:
            self.delta.version = version
        report.seconds = time.perf_counter() - start
        if not delta:
            report.changed_bytes = report.bytes_total
        return report

    def _timed(self, tensors: NamedTensors, report: SyncReport, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        return timed_stream(tensors, report, names, dtype=self._dtype, on_device=self.wants_device)

    def _buckets(self, stream, delta: bool, report: SyncReport) -> Iterator[Bucket]:
        index = 0
        if not delta:
            for group in plan_buckets(stream, self.limit):
                t0 = time.perf_counter()
                if self.delta is not None:  # baseline: remember what the engines will hold
                    for name, t in group:
                        self.delta.record(name, as_numpy_u8(t), dtype_name(t.dtype), list(t.shape))
                data, entries = pack(group, self._pack_device(), self._dtype)
                report.encode_s += time.perf_counter() - t0
                yield Bucket(index, "full", entries, data, [n for n, _ in group], group=group)
                index += 1
            return
        entries: list[dict] = []
        parts: list[bytes] = []
        size = 0
        # Tensors are encoded on the pool while the stream keeps coming; results are taken in order.
        window: deque = deque()
        window_bytes = 0
        chunk = delta_codec.CHUNK

        def take():
            nonlocal size, window_bytes
            name, t, job = window.popleft()
            window_bytes -= nbytes_of(t)
            t0 = time.perf_counter()
            changed, records, tparts, csum = job.result()
            report.encode_s += time.perf_counter() - t0
            report.changed_bytes += changed
            if not changed:
                return
            n = sum(len(p) for p in tparts)
            entries.append(
                {
                    "name": name,
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "offset": size,
                    "nbytes": n,
                    "enc": self.delta.encoding,
                    "chunks": records,
                    "digest_chunk": chunk,
                    "checksum": csum,
                }
            )
            parts.extend(tparts)
            if align(n) > n:  # keep every entry 64-byte aligned, like raw buckets
                parts.append(b"\0" * (align(n) - n))
            size += align(n)

        def take_full_bucket() -> Bucket | None:
            """Take the oldest encoded tensor; return a bucket once the taken ones fill one."""
            nonlocal index, entries, parts, size
            take()
            if size < self.limit:
                return None
            bucket = self._delta_bucket(index, entries, parts, report)
            index += 1
            entries, parts, size = [], [], 0
            return bucket

        for name, t in stream:
            t0 = time.perf_counter()
            job = self.delta.submit(name, as_numpy_u8(t), dtype_name(t.dtype), list(t.shape), keep=t)
            report.encode_s += time.perf_counter() - t0
            window.append((name, t, job))
            window_bytes += nbytes_of(t)
            while window and (window_bytes > self.limit or len(window) > 256):
                if (bucket := take_full_bucket()) is not None:
                    yield bucket
        while window:
            if (bucket := take_full_bucket()) is not None:
                yield bucket
        if entries:
            yield self._delta_bucket(index, entries, parts, report)

    def _delta_bucket(self, index: int, entries: list[dict], parts: list[bytes], report: SyncReport) -> Bucket:
        t0 = time.perf_counter()
        buf = np.empty(max(sum(len(p) for p in parts), ALIGN), dtype=np.uint8)
        pos = 0
        for p in parts:
            buf[pos : pos + len(p)] = np.frombuffer(p, dtype=np.uint8)
            pos += len(p)
        buf[pos:] = 0
        report.encode_s += time.perf_counter() - t0
        return Bucket(index, "delta", entries, torch.from_numpy(buf), [e["name"] for e in entries])

    def _full_again(self, b: Bucket) -> Bucket:
        """The same tensors as full raw bytes in a fresh buffer (from the source tensors, or the snapshot)."""
        if b.group:
            group = b.group
        else:
            group = []
            for name in b.names:
                dtype, shape = self.delta.meta[name]
                flat = torch.from_numpy(self.delta.snapshot[name])
                group.append(
                    (name, entry_view(flat, {"offset": 0, "nbytes": flat.numel(), "dtype": dtype, "shape": shape}))
                )
        data, entries = pack(group, self._pack_device(), self._dtype)
        return Bucket(b.index, "full", entries, data, b.names, group=group, last=b.last, all_names=b.all_names)

    def _encoding(self) -> dict:
        return {
            "encoding": self.cfg.update_weight_delta_encoding,
            "compression": self.cfg.update_weight_compression,
            "checksum_format": self.cfg.update_weight_checksum,
        }

    def _submit(self, b: Bucket, version: int, delta: bool, attempt: int, report: SyncReport) -> InFlight:
        t0 = time.perf_counter()
        header = b.header(
            version, self.version if delta and b.mode == "delta" else None, self.delta is not None, self._encoding()
        )
        report.encode_s += time.perf_counter() - t0
        if self.fault_hook is not None:
            self.fault_hook(b.index, attempt, b.data)
        t0 = time.perf_counter()
        refs = self._send(b, header, attempt)
        report.send_s += time.perf_counter() - t0
        return InFlight(b, header, refs, attempt, time.perf_counter())

    def _complete(self, f: InFlight, version: int, delta: bool, report: SyncReport) -> list[WeightUpdateResult]:
        """Wait for one bucket; on rejection re-send it once in full (synchronously), then give up loudly."""
        while True:
            t0 = time.perf_counter()
            try:
                stats = gather_results(f.refs)
            except WeightSyncError as e:
                if f.attempt == 1:
                    raise WeightSyncError(
                        f"weight sync v{version}: bucket {f.bucket.index} rejected again after a full re-send: {last_line(e)}"
                    ) from None
                report.retried = True
                f = self._submit(self._full_again(f.bucket), version, delta, 1, report)
                continue
            apply_s = max((s.apply_s for s in stats), default=0.0)
            report.apply_s += apply_s
            report.send_s += max(time.perf_counter() - t0 - apply_s, 0.0)
            report.bytes_sent += f.header.nbytes if f.bucket.entries else 0
            return stats

    def _drain(self, version: int, delta: bool, report: SyncReport, keep: int = 0) -> None:
        try:
            while len(self._inflight) > keep:
                self._complete(self._inflight.popleft(), version, delta, report)
        except BaseException:
            # Leave no engine mid-bucket: wait for the rest before the error propagates.
            rest = [r for f in self._inflight for r in f.refs]
            self._inflight.clear()
            if rest:
                ray.wait(rest, num_returns=len(rest))
            raise

    def _deliver(self, b: Bucket, version: int, delta: bool, report: SyncReport) -> None:
        """Send a bucket with up to ``depth`` in flight; the last one only after all others were applied."""
        if b.last:
            self._drain(version, delta, report)
            stats = self._complete(self._submit(b, version, delta, 0, report), version, delta, report)
            bad = [i for i, s in enumerate(stats) if s.version != version or not s.complete]
            if bad:
                raise WeightSyncError(
                    f"weight sync v{version}: engines {bad} did not complete the version: {[stats[i] for i in bad]}"
                )
            return
        self._inflight.append(self._submit(b, version, delta, 0, report))
        self._drain(version, delta, report, keep=self.depth - 1)


def gather_results(refs: list) -> list[WeightUpdateResult]:
    """Wait for every engine (so none is left mid-bucket), then raise the first rejection."""
    ray.wait(refs, num_returns=len(refs))
    out, err = [], None
    for r in refs:
        try:
            out.append(ray.get(r))
        except WeightSyncError as e:
            err = err or e
    if err is not None:
        raise err
    return out
