"""The engine host's side of the disk stream: bring a host-local checkpoint up to a published version.

``pull(local_checkpoint_dir, source_dir, target_version, base_dir)`` follows the rules of slime's
``/pull_weights`` receiver (``disk_format`` describes the stream):

- Per host, ``<local_checkpoint_dir>/.weight_sync/lock`` (``fcntl.flock``, exclusive) serialises every
  engine process of the host, and ``.weight_sync/state.json`` = ``{"version": "%06d"}`` names the
  version the local copy holds, so engines sharing a host apply each version once.
- ``applied == target``: nothing to do. A fresh host (no state) scans back from the target to the
  newest full version (or version 0: ``base_dir``, the engine's own checkpoint), copies it in (files
  it lacks are pruned, sizes checked), then replays the deltas after it; a host behind a newer full
  version resets from it the same way.
- A delta applies only when ``applied == base_version`` (else: out of order, refused);
  ``compression_format`` must be ``zstd``; every changed tensor's new bytes must match their
  checksum, else nothing is applied and the state is not advanced.

Where this goes beyond slime's receiver, for safety: on a checksum mismatch every tensor already
patched is reverted, so nothing is applied (slime leaves a half-patched copy); the state file is
removed while files are being copied or patched, so a process killed half-way leaves a fresh host
that resets on the next pull; and a local
copy *ahead* of the target (left by an earlier stream in the same folder) is reset instead of
silently kept. Older tidal's local layout (``state.json`` at the root) is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tidal.errors import UserError, WeightSyncError
from tidal.weight_sync import disk_codec as codec
from tidal.weight_sync import disk_format as fmt

if TYPE_CHECKING:
    import torch

SYNC_DIR = ".weight_sync"


@dataclass
class PullResult:
    """What ``pull`` did: the version the local checkpoint holds now and how it got there."""

    version: int
    seeded_from: int | None = None  # full version (0: the base checkpoint) it was reset from; None: kept
    applied: list[int] = field(default_factory=list)  # deltas applied, in order
    changed_tensors: int = 0
    seconds: float = 0.0

    @property
    def message(self) -> str:
        how = f"reset from v{self.seeded_from}, " if self.seeded_from is not None else ""
        return f"local checkpoint at v{self.version} ({how}{len(self.applied)} deltas, {self.changed_tensors} tensors)"


@contextlib.contextmanager
def _lock(local_dir: str):
    sync = os.path.join(local_dir, SYNC_DIR)
    os.makedirs(sync, exist_ok=True)
    with open(os.path.join(sync, "lock"), "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _state_path(local_dir: str) -> str:
    return os.path.join(local_dir, SYNC_DIR, "state.json")


def read_applied(local_dir: str) -> int | None:
    """The version the local checkpoint holds (None: a fresh host)."""
    try:
        return int(fmt.read_json(_state_path(local_dir))["version"])
    except FileNotFoundError:
        return None


def _write_applied(local_dir: str, version: int) -> None:
    path = _state_path(local_dir)
    fmt.atomic_write(path, json.dumps({"version": f"{version:06d}"}).encode())


def _forget_applied(local_dir: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(_state_path(local_dir))


def _check_local_layout(local_dir: str) -> None:
    if os.path.exists(os.path.join(local_dir, "state.json")) or os.path.isdir(os.path.join(local_dir, "weights")):
        raise UserError(fmt.OLD_TIDAL.format(where=f"the local checkpoint {local_dir}"))


def pull(local_checkpoint_dir: str, source_dir: str, target_version: int, base_dir: str | None = None) -> PullResult:
    """Bring ``local_checkpoint_dir`` up to ``target_version`` of the stream in ``source_dir``."""
    t0 = time.perf_counter()
    local = os.path.abspath(local_checkpoint_dir)
    os.makedirs(local, exist_ok=True)
    _check_local_layout(local)
    result = PullResult(version=target_version)
    with _lock(local):
        applied = read_applied(local)
        if applied is not None and applied > target_version:
            applied = None  # a copy from an earlier stream: no delta leads back from it
        floor = applied if applied is not None else 0
        start = target_version
        while start > floor and fmt.is_delta(fmt.version_dir(source_dir, start)):
            start -= 1
        if applied is None or start > applied:
            seed = base_dir if start == 0 else fmt.version_dir(source_dir, start)
            if seed is None:
                raise WeightSyncError(
                    f"{source_dir}: no full version at or below v{target_version} and this engine has no base "
                    "checkpoint folder (a preset); the stream must start with a full version"
                )
            _reset(seed, local, start)
            result.seeded_from = start
        else:
            start = applied
        for version in range(start + 1, target_version + 1):
            result.changed_tensors += _apply_delta(local, fmt.version_dir(source_dir, version))
            result.applied.append(version)
    result.seconds = time.perf_counter() - t0
    return result


def _reset(src: str, local: str, version: int) -> None:
    """Make ``local`` an exact copy of the full checkpoint ``src`` (files it lacks pruned), then mark it ``version``."""
    meta = fmt.index_metadata(src)
    fmt.check_not_old_tidal(src, meta)
    _forget_applied(local)  # a copy killed half-way leaves a fresh host
    files = sorted(e.name for e in os.scandir(src) if e.is_file() and not e.name.endswith(".tmp"))
    if not any(f.endswith(".safetensors") for f in files):
        raise WeightSyncError(f"{src}: a full version without safetensors files")
    for name in files:
        shutil.copyfile(os.path.join(src, name), os.path.join(local, name))
    for e in os.scandir(local):
        if e.is_file() and e.name not in files:
            os.remove(e.path)
    for name in files:
        a, b = os.path.getsize(os.path.join(src, name)), os.path.getsize(os.path.join(local, name))
        if a != b:
            raise WeightSyncError(f"size mismatch copying {src}/{name}: {a} bytes there, {b} here")
    if meta is not None and meta.get("checksum_format") in fmt.CHECKSUMS:
        _verify_full(local, meta["checksum_format"])
    _write_applied(local, version)


def _verify_full(folder: str, algo: str) -> None:
    """Check the tensors of a full version against the checksums its shards carry (where they carry them),
    tensors hashed in parallel on the pool."""
    from tidal.weight_sync.delta import pool

    want: dict[str, str] = {}
    for shard in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        want.update(fmt.safetensors_header(os.path.join(folder, shard))[1].get("__metadata__") or {})
    locs = [(n, loc) for n, loc in fmt.tensor_locations(folder).items() if n in want]
    sums = pool().map(lambda item: fmt.checksum(algo, fmt.read_bytes(item[1])), locs)
    bad = sorted(n for (n, _), got in zip(locs, sums) if got != want[n])
    if bad:
        raise WeightSyncError(f"{folder}: checksum mismatch for {len(bad)} tensors: {bad[:5]}")


def _delta_entries(version_dir: str, locations: dict[str, fmt.TensorLocation], maps: dict) -> list[tuple]:
    """(name, encoded bytes, local location, wanted checksum) of every entry, shards in sorted order.

    The encoded bytes are views of the shard files mapped read-only into ``maps`` (path -> (file, map)):
    nothing is read until a worker decodes it."""
    items = []
    for shard in sorted(f for f in os.listdir(version_dir) if f.endswith(".safetensors")):
        path = os.path.join(version_dir, shard)
        start, header = fmt.safetensors_header(path)
        want = header.get("__metadata__") or {}
        f = open(path, "rb")  # noqa: SIM115 - closed with its map by the caller
        maps[path] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        data = memoryview(maps[path][1])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name not in locations:
                raise WeightSyncError(f"{path}: a delta for {name}, which the local checkpoint does not hold")
            if info["dtype"] != "U8" or len(info["shape"]) != 1:
                raise WeightSyncError(f"{path}: {name} is {info['dtype']}{info['shape']}, not a 1-D uint8 diff")
            a, b = info["data_offsets"]
            items.append((name, data[start + a : start + b], locations[name], want.get(name)))
    return items


def _check_delta_meta(local: str, version_dir: str) -> tuple[int, int, str, str] | None:
    """(version, applied, encoding, checksum format) of a delta that applies next; None if it is applied."""
    meta = fmt.index_metadata(version_dir) or {}
    fmt.check_not_old_tidal(version_dir, meta)
    version, base = int(meta["version"]), int(meta["base_version"])
    applied = read_applied(local)
    if applied == version:
        return None
    if applied != base:
        raise WeightSyncError(f"out-of-order delta {version_dir}: local at {applied}, the delta builds on {base}")
    if meta["compression_format"] != fmt.COMPRESSION:
        raise WeightSyncError(f"{version_dir}: compression {meta['compression_format']!r} not supported (zstd only)")
    encoding, algo = meta["delta_encoding"], meta["checksum_format"]
    if encoding not in fmt.ENCODINGS:
        raise WeightSyncError(f"{version_dir}: delta_encoding {encoding!r} is not one of {', '.join(fmt.ENCODINGS)}")
    return version, applied, encoding, algo


def _close_maps(maps: dict) -> None:
    for f, m in maps.values():
        with contextlib.suppress(BufferError):  # a view still held by a traceback: the map closes when freed
            m.close()
        f.close()


def _apply_delta(local: str, version_dir: str) -> int:
    """Apply one delta version to the local copy in place; returns the number of changed tensors.

    Every tensor is patched through a shared memory map on the pool (``disk_codec.patch``, largest
    first) and checked against its checksum; if any fails, every patched tensor is reverted
    (``overwrite``: its old bytes, kept while patching; ``xor``: the same diff once more), so nothing
    is applied and the state stays.
    """
    from tidal.weight_sync.delta import pool

    checked = _check_delta_meta(local, version_dir)
    if checked is None:
        return 0
    version, applied, encoding, algo = checked
    maps: dict[str, tuple] = {}
    try:
        items = _delta_entries(version_dir, fmt.tensor_locations(local), maps)
        for _, _, loc, _ in items:
            if loc.path not in maps:
                f = open(loc.path, "r+b")  # noqa: SIM115 - closed below, with its map
                maps[loc.path] = (f, mmap.mmap(f.fileno(), 0))

        def region(loc: fmt.TensorLocation) -> np.ndarray:
            return np.ndarray((loc.nbytes,), dtype=np.uint8, buffer=maps[loc.path][1], offset=loc.offset)

        def patch(item) -> tuple[bool, object, bool]:
            name, blob, loc, want = item
            try:
                undo, got = codec.patch(region(loc), blob, encoding, name, algo)
            except WeightSyncError:
                return False, None, False  # refused, nothing written
            return True, undo, got == want

        _forget_applied(local)  # while patching: a killed process leaves a fresh host, which resets
        sizes = [loc.nbytes for _, _, loc, _ in items]
        order = sorted(range(len(items)), key=lambda i: -sizes[i])  # the longest jobs first
        done = dict(zip(order, pool().map(patch, [items[i] for i in order])))
        results = [done[i] for i in range(len(items))]
        bad = sorted(item[0] for item, (_, _, ok) in zip(items, results) if not ok)
        if bad:
            for item, (patched, undo, _) in zip(items, results):
                if patched:
                    codec.unpatch(region(item[2]), item[1], encoding, item[0], undo)
            _write_applied(local, applied)
            raise WeightSyncError(
                f"checksum mismatch for {len(bad)} tensors after applying {version_dir}: {bad[:20]}; "
                f"nothing applied, the local checkpoint stays at v{applied}"
            )
        n_items = len(items)
        del items, results, done
    finally:
        _close_maps(maps)
    _write_applied(local, version)
    return n_items


def newest_version(source_dir: str) -> int:
    """The newest published version in ``source_dir`` (0 when none is: the base)."""
    try:
        entries = os.listdir(source_dir)
    except FileNotFoundError:
        raise WeightSyncError(f"{source_dir}: no such weight stream folder") from None
    return max((v for v in map(fmt.parse_version_dir, entries) if v is not None), default=0)


def is_local_checkpoint(path: str) -> bool:
    return os.path.isdir(os.path.join(path, SYNC_DIR))


def load_folder(receiver, path: str) -> dict:
    """``WeightReceiver.from_disk``: load every tensor of a full folder into the engine.

    ``path`` is a host-local checkpoint that ``pull`` brought up to date (verified there), or a full
    version folder (its shards' checksums are verified before each shard is applied). A delta
    folder cannot be loaded as it is: engines pull it into their local checkpoint first.
    """
    t0 = time.perf_counter()
    path = os.path.abspath(path)
    if is_local_checkpoint(path):
        _check_local_layout(path)
        if read_applied(path) is None:
            raise WeightSyncError(f"{path}: the local checkpoint is incomplete (no state); pull_weights again")
        algo = None
    else:
        meta = fmt.index_metadata(path)
        fmt.check_not_old_tidal(path, meta)
        if meta is not None and "delta_encoding" in meta:
            raise WeightSyncError(f"{path} is a delta; pull_weights it into a local checkpoint and load that")
        if not os.path.isdir(path) or not any(f.endswith(".safetensors") for f in os.listdir(path)):
            raise WeightSyncError(f"{path}: not a published weight folder (no safetensors files)")
        algo = (meta or {}).get("checksum_format")
    total = 0
    for shard in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        want, pairs = shard_views(os.path.join(path, shard))
        if algo in fmt.CHECKSUMS:
            from tidal.weight_sync.checksum import tensor_checksum

            bad = [n for n, t in pairs if tensor_checksum(t, algo) != want.get(n)]
            if bad:
                raise WeightSyncError(
                    f"{path}/{shard}: {len(bad)} tensors do not match their checksums, e.g. {bad[:3]}; nothing of this shard applied"
                )
        receiver.load(pairs)
        total += sum(t.numel() * t.element_size() for _, t in pairs)
        del pairs  # the views go before the next shard is mapped
    receiver._loaded = set()
    return {"apply_s": time.perf_counter() - t0, "bytes": total, "complete": True}


def shard_views(path: str) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """(``__metadata__``, (name, tensor) pairs) of a safetensors file, the tensors viewing a private
    memory map of it: the engine copies them into its weights straight from the page cache, with no
    intermediate copy (the file's pages are shared, never written)."""
    import torch

    start, header = fmt.safetensors_header(path)
    if any(k != "__metadata__" and v["dtype"] not in fmt.ST_DTYPES for k, v in header.items()):
        from safetensors import safe_open  # a dtype outside the table: safetensors reads it (a copy)

        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}, [(name, f.get_tensor(name)) for name in f.keys()]
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if os.fstat(f.fileno()).st_size else None
    raw = np.frombuffer(m, dtype=np.uint8) if m is not None else np.empty(0, np.uint8)
    pairs = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dtype = getattr(torch, fmt.ST_DTYPES[info["dtype"]])
        t = torch.from_numpy(raw[start + a : start + b]) if b > a else torch.empty(0, dtype=torch.uint8)
        pairs.append((name, t.view(dtype).view(info["shape"])))
    return header.get("__metadata__") or {}, pairs
