"""The ``disk`` transport: a safetensors folder per version that engines reload, full or delta.

Full version (``<disk_dir>/weight_v{v:06d}/``): Hugging Face sharded safetensors
(``model-XXXXX-of-YYYYY.safetensors``, one shard per bucket of ``--update-weight-buffer-size``
bytes, plus ``model.safetensors.index.json``). Each shard's metadata holds the checksum of every
tensor in it; engines verify a shard before applying it.

Delta version (the layout slime documents): shards of ``{name: uint8 encoded bytes}`` whose
metadata holds ``{name: checksum}`` (and, under ``tidal.chunks``, each tensor's dtype, shape and
chunk records), and an index whose metadata holds ``version``, ``base_version``,
``delta_encoding``, ``compression_format`` and ``checksum_format``. The first delta-mode sync writes
a full version, the baseline, which is kept (a fresh host starts from it).

Atomic publication: a version is written into ``.tmp-weight_v...-<pid>`` (every file fsynced),
then renamed to its final name; a killed writer leaves only a ``.tmp-`` folder, which engines never
load and the next ``connect`` removes. Folders are removed after every engine loaded them unless
``--update-weight-disk-keep-files`` (delta mode keeps the newest baseline).

Applying a delta on an engine host (``LocalCheckpoint``): the host keeps a local copy of the full
weights (``--update-weight-local-checkpoint-dir``) with ``state.json`` naming its version, guarded
by a file lock so engines sharing the host apply each delta once. A delta whose ``base_version``
is not the local version is refused (out of order); a fresh host, or one behind a newer full
version, first resets from the newest full version. Every changed tensor is decoded and checked
against its checksum in memory before anything is written, so a mismatch leaves the local copy
and its state untouched; the new bytes are then written in place (idempotent: a crash while
writing is repaired by applying again) and the state advanced last.

Retry: a rejected delta is replaced by a full version written from the trainer's snapshot. A full
version cannot be rewritten (the trainer no longer holds the stream): the engines are asked to load
it once more, and a folder that is corrupt on disk fails the sync loudly.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np
import ray
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tidal.errors import ConfigError, WeightSyncError
from tidal.weight_sync import delta as codec
from tidal.weight_sync.base import NamedTensors, SyncReport, WeightSyncStrategy
from tidal.weight_sync.bucket import as_numpy_u8, dtype_name, dtype_of, host_checksum, nbytes_of, plan_buckets
from tidal.weight_sync.delta import DeltaState
from tidal.weight_sync.stream import timed_stream

INDEX = "model.safetensors.index.json"
_VERSION_DIR = re.compile(r"^weight_v(\d{6,})$")
_ST_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def version_dir(disk_dir: str, version: int) -> str:
    return os.path.join(disk_dir, f"weight_v{version:06d}")


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        _fsync_file(path)


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _publish(tmp: str, final: str) -> None:
    """Rename a finished folder into place (replacing an older folder of that name atomically enough:
    the old one is moved aside first, so a reader sees either the old or the new, never a mix)."""
    _fsync_dir(tmp)
    if os.path.exists(final):
        trash = f"{final}.old-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))


class _Writer:
    """Writes one version folder shard by shard into a temporary folder, then publishes it."""

    def __init__(self, disk_dir: str, version: int, hook: Callable[[int, str], None] | None = None):
        self.final = version_dir(disk_dir, version)
        self.tmp = os.path.join(disk_dir, f".tmp-weight_v{version:06d}-{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self.shards: list[tuple[str, list[str]]] = []
        self.hook = hook
        self.bytes = 0

    def shard(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        name = f"model-{len(self.shards) + 1:05d}.safetensors"
        path = os.path.join(self.tmp, name)
        save_file(tensors, path, metadata={"format": "pt", **metadata})
        _fsync_file(path)
        self.bytes += os.path.getsize(path)
        if self.hook is not None:
            self.hook(len(self.shards), path)
        self.shards.append((name, list(tensors)))

    def publish(self, index_metadata: dict) -> str:
        n = len(self.shards)
        weight_map = {}
        for i, (name, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(self.tmp, name), os.path.join(self.tmp, final))
            weight_map.update(dict.fromkeys(names, final))
        meta = {k: str(v) for k, v in index_metadata.items()}
        _write_json(os.path.join(self.tmp, INDEX), {"metadata": meta, "weight_map": weight_map})
        _publish(self.tmp, self.final)
        return self.final


def read_index(path: str) -> dict:
    """The index of a published version folder; refuses partial or temporary folders."""
    base = os.path.basename(os.path.normpath(path))
    if not _VERSION_DIR.match(base):
        raise WeightSyncError(f"{path}: not a published weight version folder (weight_vNNNNNN)")
    try:
        with open(os.path.join(path, INDEX)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise WeightSyncError(f"{path}: no {INDEX}; the version folder is incomplete") from None


def shard_layout(path: str) -> tuple[int, dict]:
    """(data start, header) of a safetensors file: where each tensor's bytes sit, for in-place access."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n, header


def newest_full(disk_dir: str, at_most: int | None = None) -> tuple[int, str] | None:
    """The newest published full version in ``disk_dir`` (optionally not newer than ``at_most``)."""
    best = None
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(disk_dir):
            m = _VERSION_DIR.match(entry)
            if not m:
                continue
            v = int(m.group(1))
            if at_most is not None and v > at_most:
                continue
            path = os.path.join(disk_dir, entry)
            try:
                meta = read_index(path)["metadata"]
            except (WeightSyncError, OSError, ValueError):
                continue
            if meta.get("format") == "full" and (best is None or v > best[0]):
                best = (v, path)
    return best


# --------------------------------------------------------------------------------------------- trainer


class DiskStrategy(WeightSyncStrategy):
    transport = "disk"

    def __init__(self, cfg, engines: list, *, device: str = "cpu", colocated: bool = True):
        if not cfg.update_weight_disk_dir:
            raise ConfigError(
                "--update-weight-transport disk needs --update-weight-disk-dir; pass a folder every engine can read"
            )
        self.cfg = cfg
        self.engines = list(engines)
        self.device = device
        self.mode = cfg.update_weight_mode
        self.disk_dir = os.path.abspath(cfg.update_weight_disk_dir)
        self.limit = int(cfg.update_weight_buffer_size)
        self.algo = cfg.update_weight_checksum if cfg.update_weight_checksum != "none" else "xxh3-128"
        self.delta = (
            DeltaState(cfg.update_weight_delta_encoding, cfg.update_weight_compression, self.algo)
            if self.mode == "delta"
            else None
        )
        self.version: int | None = None
        self.baseline: str | None = None
        self.fault_hook: Callable[[int, int, object], None] | None = None
        self._attempt = 0

    def connect(self) -> None:
        os.makedirs(self.disk_dir, exist_ok=True)
        # Leftovers of killed writers: never published, never loaded; remove them.
        for entry in os.listdir(self.disk_dir):
            if entry.startswith(".tmp-weight_v"):
                shutil.rmtree(os.path.join(self.disk_dir, entry), ignore_errors=True)

    def _hook(self) -> Callable[[int, str], None] | None:
        if self.fault_hook is None:
            return None
        attempt = self._attempt
        return lambda index, path: self.fault_hook(index, attempt, path)

    def _common_meta(self) -> dict:
        meta = {"checksum_format": self.algo}
        if self.cfg.update_weight_local_checkpoint_dir:
            meta["local_checkpoint_dir"] = os.path.abspath(self.cfg.update_weight_local_checkpoint_dir)
        return meta

    def _write_full(self, stream: Iterator[tuple[str, torch.Tensor]], version: int, report: SyncReport) -> str:
        w = _Writer(self.disk_dir, version, self._hook())
        t_enc = 0.0
        for group in plan_buckets(stream, self.limit):
            t0 = time.perf_counter()
            tensors, meta = {}, {}
            for name, t in group:
                t = t.detach().contiguous()
                tensors[name] = t
                meta[name] = codec.digest(as_numpy_u8(t), self.algo)
                if self.delta is not None:
                    self.delta.record(name, as_numpy_u8(t), dtype_name(t.dtype), list(t.shape))
            w.shard(tensors, {**meta, "tidal.digest_chunk": str(codec.CHUNK)})
            t_enc += time.perf_counter() - t0
        report.encode_s += t_enc
        path = w.publish(
            {
                **self._common_meta(),
                "format": "full",
                "version": version,
                "delta_baseline": self.delta is not None,
                "total_size": report.bytes_total,
            }
        )
        report.bytes_sent += w.bytes
        return path

    def _write_delta(self, stream, version: int, report: SyncReport) -> str:
        w = _Writer(self.disk_dir, version, self._hook())
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, str] = {}
        chunks: dict[str, dict] = {}
        size = 0

        def flush():
            nonlocal tensors, meta, chunks, size
            if tensors:
                w.shard(tensors, {**meta, "tidal.chunks": json.dumps(chunks)})
            tensors, meta, chunks, size = {}, {}, {}, 0

        for name, t in stream:
            t0 = time.perf_counter()
            changed, records, parts, csum = self.delta.encode(name, as_numpy_u8(t), dtype_name(t.dtype), list(t.shape))
            report.changed_bytes += changed
            if changed:
                blob = b"".join(parts)
                tensors[name] = (
                    torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
                )
                meta[name] = csum
                # The encoded bytes' own checksum: a flipped byte is caught even where it would not change the result.
                chunks[name] = {
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "chunks": records,
                    "digest_chunk": codec.CHUNK,
                    "blob": host_checksum(blob),
                }
                size += len(blob)
                if size >= self.limit:
                    flush()
            report.encode_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        flush()
        report.encode_s += time.perf_counter() - t0
        path = w.publish(
            {
                **self._common_meta(),
                "format": "delta",
                "version": version,
                "base_version": self.version,
                "delta_encoding": self.delta.encoding,
                "compression_format": self.delta.compression,
                "total_size": report.bytes_total,
            }
        )
        report.bytes_sent += w.bytes
        return path

    def _write_full_from_snapshot(self, version: int, report: SyncReport) -> str:
        def stream():
            for name, arr in self.delta.snapshot.items():
                dtype, shape = self.delta.meta[name]
                yield name, torch.from_numpy(arr).view(dtype_of(dtype)).view(shape)

        return self._write_full(stream(), version, report)

    def _load(self, path: str, version: int, report: SyncReport) -> None:
        t0 = time.perf_counter()
        refs = [e.update_weights_from_disk.remote(path, version) for e in self.engines]
        ray.wait(refs, num_returns=len(refs))
        stats, err = [], None
        for r in refs:
            try:
                stats.append(ray.get(r))
            except WeightSyncError as e:
                err = err or e
        if err is not None:
            raise err
        apply_s = max((s.apply_s for s in stats), default=0.0)
        report.apply_s += apply_s
        report.send_s += max(time.perf_counter() - t0 - apply_s, 0.0)
        bad = [i for i, s in enumerate(stats) if s.engine_version != version]
        if bad:
            raise WeightSyncError(f"weight sync v{version}: engines {bad} report other versions after loading {path}")

    def write(
        self, tensors: NamedTensors, version: int, report: SyncReport | None = None, dtype: torch.dtype | None = None
    ) -> str:
        """Publish ``tensors`` (cast to ``dtype`` when given) as version ``version`` (full, or delta
        against the previous one); return its folder."""
        report = report if report is not None else SyncReport(mode=self.mode, transport=self.transport, version=version)
        os.makedirs(self.disk_dir, exist_ok=True)

        if self.delta is not None and self.version is not None:
            path = self._write_delta(timed_stream(tensors, report, dtype=dtype), version, report)
        else:
            path = self._write_full(timed_stream(tensors, report, dtype=dtype), version, report)
            report.changed_bytes = report.bytes_total
        self.version = version
        if self.delta is not None:
            self.delta.version = version
        return path

    def sync(self, tensors: NamedTensors, version: int, dtype: torch.dtype | None = None) -> SyncReport:
        report = SyncReport(mode=self.mode, transport=self.transport, version=version)
        start = time.perf_counter()
        self._attempt = 0
        path = self.write(tensors, version, report, dtype)
        full = read_index(path)["metadata"]["format"] == "full"
        try:
            self._load(path, version, report)
        except WeightSyncError as first:
            report.retried = True
            self._attempt = 1
            try:
                if self.delta is not None:
                    path = self._write_full_from_snapshot(version, report)  # replaces the rejected folder
                    full = True
                else:
                    self._verify_folder(path)
                self._load(path, version, report)
            except WeightSyncError as second:
                # What the engines hold is unknown now: the next sync must be a full version.
                self.version = None
                if self.delta is not None:
                    self.delta.version = None
                raise WeightSyncError(
                    f"weight sync v{version} over disk failed after a retry: {_last_line(second)} (first: {_last_line(first)})"
                ) from None
        self._cleanup(path, full=full)
        report.seconds = time.perf_counter() - start
        return report

    def _verify_folder(self, path: str) -> None:
        """Trainer-side re-check of a full folder against the checksums it recorded while writing."""
        index = read_index(path)
        for shard in sorted(set(index["weight_map"].values())):
            with safe_open(os.path.join(path, shard), framework="pt") as f:
                meta = f.metadata() or {}
                chunk = int(meta.get("tidal.digest_chunk", codec.CHUNK))
                for name in f.keys():
                    if codec.digest(as_numpy_u8(f.get_tensor(name)), self.algo, chunk) != meta.get(name):
                        raise WeightSyncError(
                            f"{path}/{shard}: {name} is corrupt on disk and the trainer no longer holds it"
                        )

    def _cleanup(self, path: str, full: bool) -> None:
        if self.cfg.update_weight_disk_keep_files:
            return
        if self.delta is not None and full:
            # The newest baseline stays (a fresh host starts from it); the previous one goes.
            if self.baseline and self.baseline != path:
                shutil.rmtree(self.baseline, ignore_errors=True)
            self.baseline = path
            return
        shutil.rmtree(path, ignore_errors=True)


def _last_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[-1] if lines else type(e).__name__


# ---------------------------------------------------------------------------------------------- engine


def _load_full(receiver, path: str, index: dict) -> int:
    """Verify each shard's tensors against their checksums, then apply the shard."""
    algo = index["metadata"].get("checksum_format", "xxh3-128")
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(path, shard), framework="pt") as f:
            meta = f.metadata() or {}
            pairs = [(name, f.get_tensor(name)) for name in f.keys()]
        chunk = int(meta.get("tidal.digest_chunk", codec.CHUNK))
        for name, t in pairs:
            if codec.digest(as_numpy_u8(t), algo, chunk) != meta.get(name):
                raise WeightSyncError(
                    f"{path}/{shard}: {name} does not match its checksum; nothing of this shard applied"
                )
        receiver.load(pairs)
        total += sum(nbytes_of(t) for _, t in pairs)
    return total


def default_local_dir(disk_dir: str) -> str:
    tag = hashlib.sha1(os.path.abspath(disk_dir).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"tidal-local-ckpt-{tag}")


def load_folder(receiver, path: str) -> dict:
    """``WeightReceiver.from_disk``: apply a published version folder (full or delta) to the engine."""
    t0 = time.perf_counter()
    path = os.path.abspath(path)
    index = read_index(path)
    meta = index["metadata"]
    version = int(meta["version"])
    cfg_dir = getattr(receiver.cfg, "update_weight_local_checkpoint_dir", None) if receiver.cfg is not None else None
    local_dir = cfg_dir or meta.get("local_checkpoint_dir") or default_local_dir(os.path.dirname(path))
    expected = set(index["weight_map"])
    receiver._loaded = set()
    if meta["format"] == "full":
        nbytes = _load_full(receiver, path, index)
        if meta.get("delta_baseline") == "True":
            LocalCheckpoint(local_dir).reset_from(path, version)
    elif meta["format"] == "delta":
        ckpt = LocalCheckpoint(local_dir)
        ckpt.apply(path, index)
        # Every weight, changed or not: a colocated engine discarded its weights while asleep.
        nbytes = ckpt.load_into(receiver)
        expected = set(ckpt.names())
    else:
        raise WeightSyncError(f"{path}: unknown version format {meta['format']!r}")
    missing = expected - receiver._loaded
    receiver._loaded = set()
    if missing:
        raise WeightSyncError(f"{path}: {len(missing)} weights not applied, e.g. {sorted(missing)[:3]}")
    return {"apply_s": time.perf_counter() - t0, "bytes": nbytes, "complete": True, "version": version}


class LocalCheckpoint:
    """A host-local full copy of the weights that deltas are applied to, with a lock and a state file."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.weights = os.path.join(self.root, "weights")
        self.state_path = os.path.join(self.root, "state.json")
        self.pending = os.path.join(self.root, "pending")
        os.makedirs(self.root, exist_ok=True)

    @contextlib.contextmanager
    def lock(self):
        with open(os.path.join(self.root, ".lock"), "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def state(self) -> dict | None:
        try:
            with open(self.state_path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def _reset(self, full_path: str, version: int) -> None:
        tmp = f"{self.weights}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(full_path, tmp)
        for name in os.listdir(tmp):
            _fsync_file(os.path.join(tmp, name))
        if os.path.exists(self.pending):
            os.remove(self.pending)
        _publish(tmp, self.weights)
        _write_json(self.state_path, {"version": version, "full_version": version})

    def reset_from(self, full_path: str, version: int) -> None:
        with self.lock():
            st = self.state()
            if st is None or st["version"] != version or os.path.exists(self.pending):
                self._reset(full_path, version)

    def _layout(self) -> dict[str, tuple[str, int, int, str, list[int]]]:
        """name -> (shard path, start, end, dtype, shape) of every tensor in the local copy."""
        out = {}
        for shard in sorted(os.listdir(self.weights)):
            if not shard.endswith(".safetensors"):
                continue
            p = os.path.join(self.weights, shard)
            start, header = shard_layout(p)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                a, b = info["data_offsets"]
                out[name] = (p, start + a, start + b, _ST_DTYPES[info["dtype"]], info["shape"])
        return out

    def names(self) -> list[str]:
        return list(self._layout())

    def apply(self, delta_path: str, index: dict) -> None:
        meta = index["metadata"]
        version, base = int(meta["version"]), int(meta["base_version"])
        disk_dir = os.path.dirname(delta_path)
        with self.lock():
            st = self.state()
            full = newest_full(disk_dir, at_most=base)
            stale = (
                st is None
                or os.path.exists(self.pending)
                or (full is not None and full[0] > st["full_version"] and full[0] <= base and st["version"] < full[0])
            )
            if stale and full is not None:
                self._reset(full[1], full[0])
                st = self.state()
            if st is not None and st["version"] == version and not os.path.exists(self.pending):
                return  # another engine of this host applied it already
            if st is None:
                raise WeightSyncError(
                    f"{delta_path}: this host has no local checkpoint and {disk_dir} holds no full version to start from"
                )
            if st["version"] != base:
                raise WeightSyncError(
                    f"{delta_path}: out of order: the local checkpoint is v{st['version']}, this delta (v{version}) applies to v{base}"
                )
            self._apply_locked(delta_path, index)
            _write_json(self.state_path, {**st, "version": version})
            os.remove(self.pending)

    def _apply_locked(self, delta_path: str, index: dict) -> None:
        meta = index["metadata"]
        enc, comp, algo = meta["delta_encoding"], meta["compression_format"], meta["checksum_format"]
        layout = self._layout()
        staged: list[tuple[str, np.ndarray]] = []
        # Phase 1: decode every changed tensor against the local bytes, in memory, and check it.
        for shard in sorted(set(index["weight_map"].values())):
            with safe_open(os.path.join(delta_path, shard), framework="pt") as f:
                smeta = f.metadata() or {}
                chunks = json.loads(smeta.get("tidal.chunks", "{}"))
                items, names = [], []
                for name in f.keys():
                    if name not in layout:
                        raise WeightSyncError(
                            f"{delta_path}: delta for {name}, which the local checkpoint does not hold"
                        )
                    p, a, b, _, _ = layout[name]
                    blob = f.get_tensor(name).numpy()
                    if host_checksum(blob) != chunks[name]["blob"]:
                        raise WeightSyncError(
                            f"{delta_path}/{shard}: the encoded bytes of {name} are corrupt; nothing applied, state not advanced"
                        )
                    new = np.fromfile(p, dtype=np.uint8, count=b - a, offset=a)
                    items.append((new, memoryview(blob), chunks[name]["chunks"], chunks[name]["digest_chunk"]))
                    names.append(name)
            sums = codec.apply_many(items, enc, comp, algo)
            for name, got, item in zip(names, sums, items):
                if got != smeta.get(name):
                    raise WeightSyncError(
                        f"{delta_path}/{shard}: {name} does not match its checksum; nothing applied, state not advanced"
                    )
                staged.append((name, item[0]))
        # Phase 2: write the new bytes in place. Marked pending, so an interrupted write is redone from a full version.
        with open(self.pending, "w"):
            pass
        for name, new in staged:
            p, a, b, _, _ = layout[name]
            mm = np.memmap(p, dtype=np.uint8, mode="r+", offset=a, shape=(b - a,))
            mm[:] = new
            mm.flush()
            del mm

    def load_into(self, receiver) -> int:
        total = 0
        for p, pairs in self._by_shard().items():
            with safe_open(p, framework="pt") as f:
                tensors = [(name, f.get_tensor(name)) for name in pairs]
            receiver.load(tensors)
            total += sum(nbytes_of(t) for _, t in tensors)
        return total

    def _by_shard(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, (p, *_rest) in self._layout().items():
            out.setdefault(p, []).append(name)
        return out

    def tensor(self, name: str) -> torch.Tensor:
        p, a, b, dtype, shape = self._layout()[name]
        arr = np.fromfile(p, dtype=np.uint8, count=b - a, offset=a)
        return torch.from_numpy(arr).view(dtype_of(dtype)).view(shape)
