"""The ``disk`` transport: a safetensors folder per version under ``--update-weight-disk-dir``.

Full mode: every sync writes ``weight_v{N:06d}/`` as a Hugging Face checkpoint (shards of at most
``--update-weight-buffer-size`` bytes, ``model.safetensors.index.json``, each shard's metadata holding
the checksum of every tensor in it) and every engine loads and verifies it; the folder is removed
afterwards unless ``--update-weight-disk-keep-files``.

Delta mode speaks slime's stream (``disk_format`` has the bytes, ``local_checkpoint`` the engine
host's side): stream version 0 is the engines' own base checkpoint (the model folder) and is never
written. The first sync seeds the trainer's host snapshot from that checkpoint's bytes and asks every
engine to materialise its local copy of version 0 (``pull_weights(local, disk_dir, 0)``); it
publishes nothing when the trainer's weights are those bytes (the usual start), else a first delta.
A preset (no checkpoint folder), or a checkpoint whose names, dtypes or sizes differ from the
engine weights, cannot be version 0: then the first sync writes the base once as the full version
1, and says so. Each later sync publishes the next version: a delta against the previous one with
only the changed tensors, each one zstd frame of its ``xor``/``overwrite`` diff, checksummed over
its new full bytes. Engines then ``pull_weights`` to that version and reload their local copy
(``update_weights_from_disk(local_checkpoint_dir, version)``).

The trainer's weight version (what engines report) and the stream's version are counted apart: the
stream starts at 0 with the strategy's first sync, whatever the trainer's version then.

Encoding (``disk_codec``) runs on a thread pool over tensors, pipelined with the trainer's stream
(numpy, zstd and the checksums release the GIL), each tensor in cache-sized spans; the shards
(about 32 MiB each) are serialised and written on a background thread while the next ones encode.

Atomic publication: a version is written into ``.tmp-weight_v...-<pid>`` (every file fsynced), then
renamed to its final name, so a killed writer leaves only a ``.tmp-`` folder that no reader ever
takes for a version (slime's writer fsyncs file by file into the final folder; the bytes are the
same). The first sync removes the versions of an earlier stream in the folder (they would apply to
the wrong base) and refuses folders an older tidal wrote.

A delta that would be larger than the weights (a dense change: ``overwrite`` spends 5 bytes per
changed byte) is written as a full version of the same number instead.

Retention: a fresh host replays the chain from the newest full version, so delta versions are kept.
Once the deltas since the last full version add up to ``CHAIN_FULLS`` (4) full versions' bytes, the
next version is written full and older versions are removed (unless ``--update-weight-disk-keep-files``):
the folder holds at most ~5 models' bytes, and the full version (written once, copied by every engine
host) is spread over the chain's syncs (at 10 % deltas: one full per 40 syncs).

Retry: a version an engine rejects is written again as a full version from the trainer's snapshot
(same number; receivers reset from it) and pulled once more; a second failure fails the sync loudly.
In full mode a folder cannot be rewritten (the stream is gone): it is re-checked on the trainer and
either re-loaded or fails loudly.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray
import torch
from safetensors.numpy import save as save_numpy
from safetensors.torch import save as save_torch

from tidal.atomic import publish_dir
from tidal.errors import ConfigError, WeightSyncError, last_line
from tidal.weight_sync import disk_codec as codec
from tidal.weight_sync import disk_format as fmt
from tidal.weight_sync.base import NamedTensors, SyncReport, WeightSyncStrategy
from tidal.weight_sync.bucket import dtype_name, plan_buckets
from tidal.weight_sync.checksum import as_numpy_u8
from tidal.weight_sync.stream import timed_stream

log = logging.getLogger(__name__)
INDEX = fmt.INDEX
version_dir = fmt.version_dir
_ST_CODE = {v: k for k, v in fmt.ST_DTYPES.items()}
CHAIN_FULLS = 4  # a chain of deltas weighing this many full versions is closed by a full version
_SHARD = 32 << 20  # delta shards of about this many bytes (at most --update-weight-buffer-size), so writes overlap


class VersionWriter:
    """Writes one version folder into a temporary folder, shard by shard, then publishes it by a rename.

    ``shard`` may hand the serialising and writing to a background thread (``background=True``), so
    the next shard encodes while the last one is written; ``publish`` waits for every write.
    """

    def __init__(
        self,
        disk_dir: str,
        version: int,
        hook: Callable[[int, str], None] | None = None,
        first: int = 1,
        background: bool = False,
    ):
        self.final = fmt.version_dir(disk_dir, version)
        self.tmp = os.path.join(disk_dir, f".tmp-weight_v{version:06d}-{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self.first = first  # 1: Hugging Face's numbering of full checkpoints; 0: slime's delta shards
        self.shards: list[list[str]] = []
        self.hook = hook
        self.bytes = 0
        self.write_s = 0.0  # time spent serialising, writing and fsyncing files (on any thread)
        self.blocked_s = 0.0  # of which the caller waited for (all of it without a background writer)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tidal-shard") if background else None
        self._pending: list = []

    def shard(self, blob: bytes | Callable[[], bytes], names: list[str]) -> None:
        """Write one shard: its bytes, or a function that makes them (called on the writer thread)."""
        index = len(self.shards)
        self.shards.append(names)
        t0 = time.perf_counter()
        if self._writer is None:
            self._write(index, blob)
        else:
            while len(self._pending) > 1:  # at most one shard written while the next one fills
                self._pending.pop(0).result()
            self._pending.append(self._writer.submit(self._write, index, blob))
        self.blocked_s += time.perf_counter() - t0

    def _write(self, index: int, blob) -> None:
        path = os.path.join(self.tmp, f"part-{index:05d}")
        t0 = time.perf_counter()
        data = blob() if callable(blob) else blob
        fmt.atomic_write(path, data)
        self.write_s += time.perf_counter() - t0
        self.bytes += len(data)
        if self.hook is not None:
            self.hook(index, path)

    def wait(self) -> None:
        """Every shard written (a write's error is raised here)."""
        t0 = time.perf_counter()
        try:
            for f in self._pending:
                f.result()
        finally:
            self._pending = []
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            self.blocked_s += time.perf_counter() - t0

    def discard(self) -> None:
        self.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def publish(self, metadata: dict) -> str:
        self.wait()
        n = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = fmt.shard_name(i + self.first, n - 1 + self.first if self.first else n)
            os.rename(os.path.join(self.tmp, f"part-{i:05d}"), os.path.join(self.tmp, final))
            weight_map.update(dict.fromkeys(names, final))
        t0 = time.perf_counter()
        fmt.write_index(self.tmp, {"metadata": metadata, "weight_map": weight_map})
        publish_dir(self.tmp, self.final)  # a retry replaces the folder whole
        self.write_s += time.perf_counter() - t0
        self.blocked_s += time.perf_counter() - t0
        return self.final


def write_full(
    disk_dir: str, version: int, tensors: Iterable[tuple[str, torch.Tensor]], limit: int, algo: str, hook=None
) -> tuple[str, VersionWriter]:
    """A full Hugging Face checkpoint as version ``version``; returns (folder, its writer's figures)."""
    w = VersionWriter(disk_dir, version, hook)
    total = 0
    for group in plan_buckets(tensors, limit):
        shard = {name: t.detach().contiguous() for name, t in group}
        meta = {name: fmt.checksum(algo, as_numpy_u8(t)) for name, t in shard.items()}
        total += sum(t.numel() * t.element_size() for t in shard.values())
        w.shard(save_torch(shard, metadata={"format": "pt", **meta}), list(shard))
    path = w.publish({"total_size": total, "checksum_format": algo})
    return path, w


class DiskStrategy(WeightSyncStrategy):
    transport = "disk"

    def __init__(self, cfg, engines: list, *, device: str = "cpu", colocated: bool = True, base_dir: str | None = None):
        if not cfg.update_weight_disk_dir:
            raise ConfigError(
                "--update-weight-transport disk needs --update-weight-disk-dir; pass a folder every engine can read"
            )
        self.cfg = cfg
        self.engines = list(engines)
        self.device = device
        self.mode = cfg.update_weight_mode
        self.disk_dir = os.path.abspath(cfg.update_weight_disk_dir)
        self.local_dir = os.path.abspath(
            cfg.update_weight_local_checkpoint_dir or os.path.join(self.disk_dir, ".local")
        )
        self.limit = int(cfg.update_weight_buffer_size)
        self.algo = cfg.update_weight_checksum if cfg.update_weight_checksum != "none" else "xxh3-128"
        self.encoding = cfg.update_weight_delta_encoding
        self.base_dir = os.path.abspath(base_dir) if base_dir else None
        self.snapshot: dict[str, np.ndarray] = {}  # delta: the bytes the engines hold, per tensor
        self.meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.stream_version: int | None = None  # newest version of the stream; None before the first sync
        self.full_version = 0  # newest full version of the stream (0: the base)
        self.chain_bytes = 0  # bytes of the deltas since it
        self.last_write_s = 0.0  # file-writing seconds of the last ``write`` (benchmarks)
        self.last_blocked_s = 0.0  # of which encoding waited for
        self.last_pull_s = self.last_load_s = 0.0  # engines' apply: patching their local copy, reloading it
        self.fault_hook: Callable[[int, int, object], None] | None = None
        self._attempt = 0

    def connect(self) -> None:
        os.makedirs(self.disk_dir, exist_ok=True)
        for entry in sorted(os.listdir(self.disk_dir)):
            path = os.path.join(self.disk_dir, entry)
            if entry.startswith(".tmp-weight_v"):  # killed writers' leftovers: never published, never read
                shutil.rmtree(path, ignore_errors=True)
            elif fmt.parse_version_dir(entry) is not None:
                fmt.check_not_old_tidal(path, fmt.index_metadata(path))

    def _hook(self) -> Callable[[int, str], None] | None:
        if self.fault_hook is None:
            return None
        attempt = self._attempt
        return lambda index, path: self.fault_hook(index, attempt, path)

    # ------------------------------------------------------------------ full mode

    def write(self, tensors: NamedTensors, version: int, report: SyncReport | None = None, dtype=None) -> str:
        """Publish ``tensors`` as version ``version``: a full folder, or (delta) the next version of the stream.

        Returns the folder written; in delta mode the stream version is ``self.stream_version``
        (a first sync that publishes nothing returns the base folder).
        """
        report = report if report is not None else SyncReport(mode=self.mode, transport=self.transport, version=version)
        os.makedirs(self.disk_dir, exist_ok=True)
        self.last_write_s = self.last_blocked_s = 0.0
        stream = timed_stream(tensors, report, dtype=dtype)
        if self.mode == "full":
            t0 = time.perf_counter()
            path, w = write_full(self.disk_dir, version, stream, self.limit, self.algo, self._hook())
            self._written(w, report, time.perf_counter() - t0 - report.gather_s)
            report.changed_bytes = report.bytes_total
            return path
        if self.stream_version is None:
            return self._first_version(stream, report)
        return self._next_version(stream, report)

    # ------------------------------------------------------------------ delta mode

    def _start_stream(self) -> None:
        """A new stream: earlier versions in the folder would apply to the wrong base; remove them."""
        self.connect()
        for entry in os.listdir(self.disk_dir):
            if fmt.parse_version_dir(entry) is not None:
                shutil.rmtree(os.path.join(self.disk_dir, entry))
        self.snapshot, self.meta = {}, {}
        self.full_version, self.chain_bytes = 0, 0

    def _base_locations(self) -> dict[str, fmt.TensorLocation] | None:
        if not self.base_dir or not any(f.endswith(".safetensors") for f in os.listdir(self.base_dir)):
            return None
        return fmt.tensor_locations(self.base_dir)

    def _first_version(self, stream: Iterator[tuple[str, torch.Tensor]], report: SyncReport) -> str:
        self._start_stream()
        base = self._base_locations()
        pulls = (
            [
                e.pull_weights.remote(self.disk_dir, local_checkpoint_dir=self.local_dir, target_version=0)
                for e in self.engines
            ]
            if base
            else []
        )
        held: list[tuple[str, torch.Tensor]] = []
        why = "the model is a preset: it has no checkpoint folder" if base is None else None
        t0 = time.perf_counter()
        for name, t in stream:
            held.append((name, t))
            self.meta[name] = (t.dtype, tuple(t.shape))
            loc = base.get(name) if base is not None else None
            if why is None and (loc is None or loc.nbytes != t.numel() * t.element_size()):
                why = f"{name} is not in {self.base_dir} with {t.numel() * t.element_size()} bytes"
            elif why is None and fmt.ST_DTYPES.get(loc.dtype) != dtype_name(t.dtype):
                why = f"{name} is {loc.dtype} in {self.base_dir}, {dtype_name(t.dtype)} in the engines"
        if pulls:
            self._gather(pulls)
        if why is None:
            self.snapshot = {name: fmt.read_bytes(base[name]) for name, _ in held}
            report.encode_s += time.perf_counter() - t0 - report.gather_s
            self.stream_version = 0
            if any(not np.array_equal(as_numpy_u8(t), self.snapshot[n]) for n, t in held):
                return self._next_version(iter(held), report)  # e.g. a resumed trainer: a first delta
            return self.base_dir
        log.info("delta over disk: the first sync writes the base once as the full version 1 (%s)", why)
        self.snapshot = {name: as_numpy_u8(t).copy() for name, t in held}
        self.stream_version = 1
        report.changed_bytes = report.bytes_total
        return self._write_full_version(1, report)

    def _write_full_version(self, version: int, report: SyncReport) -> str:
        t0 = time.perf_counter()
        path, w = write_full(self.disk_dir, version, self._snapshot_tensors(), self.limit, self.algo, self._hook())
        self._written(w, report, time.perf_counter() - t0)
        self.full_version, self.chain_bytes = version, 0
        return path

    def _snapshot_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, arr in self.snapshot.items():
            dtype, shape = self.meta[name]
            yield name, torch.from_numpy(arr).view(dtype).view(shape)

    def _next_version(self, stream: Iterator[tuple[str, torch.Tensor]], report: SyncReport) -> str:
        version = self.stream_version + 1
        if self.chain_bytes >= CHAIN_FULLS * sum(a.size for a in self.snapshot.values()):
            # The chain since the last full version weighs CHAIN_FULLS full versions: start a new chain.
            for name, t in stream:
                new, old = as_numpy_u8(t), self.snapshot[name]
                report.changed_bytes += int(np.count_nonzero(new != old))
                np.copyto(old, new)
            self.stream_version = version
            return self._write_full_version(version, report)
        w = VersionWriter(self.disk_dir, version, self._hook(), first=0, background=True)
        t_gather = report.gather_s
        t0 = time.perf_counter()
        try:
            self._encode_into(w, stream, report)
        except BaseException:
            w.discard()
            raise
        w.wait()
        if w.bytes >= report.bytes_total > 0:
            # Denser than the weights themselves (overwrite spends 5 bytes per changed byte): write it full.
            w.discard()
            self.stream_version = version
            return self._write_full_version(version, report)
        index = fmt.delta_index(version, self.encoding, self.algo, {})["metadata"]
        path = w.publish(index)
        self._written(w, report, time.perf_counter() - t0 - (report.gather_s - t_gather))
        self.stream_version = version
        self.chain_bytes += w.bytes
        return path

    def _encode_into(self, w: VersionWriter, stream: Iterator[tuple[str, torch.Tensor]], report: SyncReport) -> None:
        """Encode the stream's tensors on the pool, in order, into shards of about ``_SHARD`` bytes that
        the writer thread writes while the next ones encode."""
        from tidal.weight_sync.delta import pool

        shard: dict[str, np.ndarray] = {}
        sums: dict[str, str] = {}
        size = 0
        inflight: deque = deque()
        workers = pool()
        limit = min(self.limit, _SHARD)

        def flush() -> None:
            nonlocal shard, sums, size
            w.shard(lambda s=shard, m=sums: save_numpy(s, metadata=m), list(shard))
            shard, sums, size = {}, {}, 0

        def collect(fut) -> None:
            nonlocal size
            e = fut.result()
            report.changed_bytes += e.changed
            if e.blob is None:
                return
            shard[e.name], sums[e.name] = e.blob, e.digest
            size += e.blob.size
            if size >= limit:
                flush()

        for name, t in stream:
            if name not in self.snapshot:
                raise WeightSyncError(f"delta over disk: {name} was not in the first sync; restart the stream")
            inflight.append(
                codec.submit_encode(workers, name, as_numpy_u8(t), self.snapshot[name], self.encoding, self.algo)
            )
            while len(inflight) >= 2 * workers._max_workers:
                collect(inflight.popleft())
        while inflight:
            collect(inflight.popleft())
        if shard:
            flush()

    def _written(self, w: VersionWriter, report: SyncReport, seconds: float) -> None:
        """Account a written version: waiting for file writes is transport time (``send_s``), the rest
        encoding (writes on the background thread overlap encoding and are not counted twice)."""
        report.bytes_sent += w.bytes
        report.send_s += w.blocked_s
        report.encode_s += max(seconds - w.blocked_s, 0.0)
        self.last_write_s += w.write_s
        self.last_blocked_s += w.blocked_s

    # ------------------------------------------------------------------ engines

    def _gather(self, refs: list) -> list:
        ray.wait(refs, num_returns=len(refs))
        out, err = [], None
        for r in refs:
            try:
                out.append(ray.get(r))
            except Exception as e:  # noqa: BLE001 - the first engine error is re-raised below
                err = err or e
        if err is not None:
            raise WeightSyncError(last_line(err)) from None
        return out

    def _load(self, path: str, version: int, report: SyncReport) -> None:
        """Delta: every engine pulls the stream to its version, then reloads its local copy. Full: loads ``path``."""
        t0 = time.perf_counter()
        apply_s = 0.0
        if self.mode == "delta":
            pulled = self._gather(
                [
                    e.pull_weights.remote(
                        self.disk_dir, local_checkpoint_dir=self.local_dir, target_version=self.stream_version
                    )
                    for e in self.engines
                ]
            )
            apply_s += max((p.seconds for p in pulled), default=0.0)
            path = self.local_dir
        self.last_pull_s = apply_s
        stats = self._gather([e.update_weights_from_disk.remote(path, version) for e in self.engines])
        self.last_load_s = max((s.apply_s for s in stats), default=0.0)
        apply_s += self.last_load_s
        report.apply_s += apply_s
        report.send_s += max(time.perf_counter() - t0 - apply_s, 0.0)
        bad = [i for i, s in enumerate(stats) if s.engine_version != version]
        if bad:
            raise WeightSyncError(f"weight sync v{version}: engines {bad} report other versions after loading {path}")

    def sync(self, tensors: NamedTensors, version: int, dtype: torch.dtype | None = None) -> SyncReport:
        report = SyncReport(mode=self.mode, transport=self.transport, version=version)
        start = time.perf_counter()
        self._attempt = 0
        path = self.write(tensors, version, report, dtype)
        try:
            self._load(path, version, report)
        except WeightSyncError as first:
            report.retried = True
            self._attempt = 1
            try:
                if self.mode == "delta" and self.stream_version > 0:
                    path = self._write_full_version(self.stream_version, report)  # replaces the rejected folder
                elif self.mode == "delta":
                    pass  # version 0 is the engines' own checkpoint: nothing to rewrite, pull it again
                else:
                    self._verify_folder(path)
                self._load(path, version, report)
            except WeightSyncError as second:
                self.stream_version = None  # what the engines hold is unknown: the next sync starts a new stream
                raise WeightSyncError(
                    f"weight sync v{version} over disk failed after a retry: {last_line(second)} (first: {last_line(first)})"
                ) from None
        self._cleanup(path)
        report.seconds = time.perf_counter() - start
        return report

    def _verify_folder(self, path: str) -> None:
        """Trainer-side re-check of a full folder against the checksums it recorded while writing."""
        from tidal.weight_sync.local_checkpoint import _verify_full

        try:
            _verify_full(path, self.algo)
        except WeightSyncError as e:
            raise WeightSyncError(f"{last_line(e)}; the trainer no longer holds those weights") from None

    def _cleanup(self, path: str) -> None:
        if self.cfg.update_weight_disk_keep_files:
            return
        if self.mode == "full":
            shutil.rmtree(path, ignore_errors=True)
            return
        # Delta: versions before the newest full one are never needed again (a fresh host starts there).
        for entry in os.listdir(self.disk_dir):
            v = fmt.parse_version_dir(entry)
            if v is not None and v < self.full_version:
                shutil.rmtree(os.path.join(self.disk_dir, entry), ignore_errors=True)
