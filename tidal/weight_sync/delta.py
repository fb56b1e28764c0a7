"""Delta encoding of weight bytes: ship only what changed against what the engines already hold.

Both sides keep a host snapshot of the bytes the engines hold (the trainer: ``DeltaState``; each
engine: ``tidal.weight_sync.receiver``). Encoding is dtype-blind, on raw bytes, per tensor, in
chunks of ``CHUNK`` bytes so large tensors encode and apply on every core (numpy comparisons and
zstd release the GIL):

    overwrite  a bitmap of changed byte positions (1 bit per byte, so it has no width limit: tensors
               over 4 GiB are fine) + the changed bytes, packed. Applying sets the marked bytes, so
               applying twice is harmless (a retried apply cannot corrupt).
    xor        ``new ^ old``; applying xors again. Smaller to compute, but applying twice reverts.

Each chunk's parts are zstd-compressed (level 1) unless compression is ``none``. Unchanged chunks
are omitted; unchanged tensors produce no entry. Every changed tensor carries a checksum of its full
new bytes (``--update-weight-checksum``), verified after applying.

A chunk record is ``[offset, length, ...]``: overwrite ``[.., bitmap_len, values_len, changed]``,
xor ``[.., diff_len]`` (compressed lengths); the encoded bytes of all chunks of a tensor are
concatenated in record order.

A tensor's checksum is computed per chunk while the bytes are in cache, and combined as a one-level
hash tree (the hash of the chunk digests; a single-chunk tensor's checksum is its plain digest), so
encode, apply and verification all run chunk-parallel.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zstandard

from tidal.errors import WeightSyncError
from tidal.weight_sync.checksum import checksum_bytes

# 1 MiB chunks: each job's temporaries stay in cache, and a 1 GB model makes ~1000 jobs for the pool.
CHUNK = 1024**2
_LEVEL = 1
_local = threading.local()
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """A process-wide worker pool, one thread per core (encode, apply and checksums share it)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="tidal-delta")
        return _pool


def _cctx() -> zstandard.ZstdCompressor:
    # Compressor objects are not thread safe: one per worker thread.
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(level=_LEVEL, write_checksum=True)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def _compress(buf: np.ndarray, compression: str) -> bytes:
    if compression == "zstd":
        return _cctx().compress(buf)
    return buf.tobytes()


def _decompress(blob, n: int, compression: str) -> np.ndarray:
    if compression == "zstd":
        try:
            out = _dctx().decompress(blob, max_output_size=n)
        except zstandard.ZstdError as e:
            raise WeightSyncError(f"delta chunk does not decompress ({e}); the payload is corrupt") from None
    else:
        out = bytes(blob)
    if len(out) != n:
        raise WeightSyncError(f"delta chunk decodes to {len(out)} bytes, expected {n}")
    return np.frombuffer(out, dtype=np.uint8)


def _scratch(name: str, n: int, dtype=np.uint8) -> np.ndarray:
    """A per-thread reusable buffer: fresh allocations per chunk cost more in page faults than the work itself."""
    buf = getattr(_local, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, CHUNK), dtype=dtype)
        setattr(_local, name, buf)
    return buf[:n]


def _encode_chunk(new: np.ndarray, old: np.ndarray, off: int, encoding: str, compression: str, algo: str):
    """Encode one chunk, update the snapshot chunk ``old`` to ``new``, and hash the new bytes while they are hot.

    Returns (changed bytes, record or None, parts, digest of the new chunk).
    """
    n = new.size
    digest = checksum_bytes(new, algo)
    if encoding == "xor":
        diff = np.bitwise_xor(new, old, out=_scratch("diff", n))
        changed = int(np.count_nonzero(diff))
        if changed == 0:
            return 0, None, [], digest
        np.copyto(old, new)
        part = _compress(diff, compression)
        return changed, [off, n, len(part)], [part], digest
    mask = np.not_equal(new, old, out=_scratch("mask", n, np.bool_))
    changed = int(np.count_nonzero(mask))
    if changed == 0:
        return 0, None, [], digest
    # Positions as a bitmap (sparse bits compress to little), then only the changed bytes, packed.
    values = np.compress(mask, new)
    np.copyto(old, new)
    bits = np.packbits(mask)
    p1, p2 = _compress(bits, compression), _compress(values, compression)
    return changed, [off, n, len(p1), len(p2), changed], [p1, p2], digest


def combine(digests: list[str], algo: str) -> str:
    """A tensor's checksum from its chunks' (a one-level hash tree, so chunks hash in parallel)."""
    if algo == "none":
        return ""
    if len(digests) == 1:
        return digests[0]
    return checksum_bytes("".join(digests).encode(), algo)


def spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, n)) for a in range(0, n, chunk)] or [(0, 0)]


class Pending:
    """A tensor being encoded on the pool; ``result()`` -> (changed, records, parts, checksum)."""

    def __init__(self, futures: list, algo: str, keep: object = None):
        self.futures = futures
        self.algo = algo
        self.keep = keep  # the source tensor, alive until its chunks are encoded

    def result(self) -> tuple[int, list, list[bytes], str]:
        changed, records, parts, digests = 0, [], [], []
        for f in self.futures:
            c, rec, p, d = f.result()
            changed += c
            digests.append(d)
            if rec is not None:
                records.append(rec)
                parts.extend(p)
        self.keep = None
        return changed, records, parts, combine(digests, self.algo) if changed else ""


def submit_encode(
    new: np.ndarray, old: np.ndarray, encoding: str, compression: str, algo: str, keep: object = None
) -> Pending:
    """Start encoding ``new`` against ``old`` (updated in place) on the pool, one job per chunk."""
    if new.size != old.size:
        raise WeightSyncError(f"tensor changed size between syncs ({old.size} -> {new.size} bytes)")
    jobs = [
        pool().submit(_encode_chunk, new[a:b], old[a:b], a, encoding, compression, algo)
        for a, b in spans(new.size, CHUNK)
    ]
    return Pending(jobs, algo, keep)


def encode(new: np.ndarray, old: np.ndarray, encoding: str, compression: str) -> tuple[int, list, list[bytes]]:
    """Encode ``new`` against the snapshot ``old`` (updated in place to ``new``).

    Returns (changed bytes, chunk records, encoded parts); no records when nothing changed.
    """
    changed, records, parts, _ = submit_encode(new, old, encoding, compression, "none").result()
    return changed, records, parts


def _apply_chunk(
    target: np.ndarray, blob, rec: list | None, a: int, b: int, encoding: str, compression: str, algo: str
) -> str:
    dst = target[a:b]
    if rec is not None:
        n = rec[1]
        if rec[0] != a or n != b - a:
            raise WeightSyncError(f"delta chunk [{rec[0]}, +{n}) does not match the tensor's chunking [{a}, {b})")
        if encoding == "xor":
            np.bitwise_xor(dst, _decompress(blob, n, compression), out=dst)
        else:
            mlen, count = rec[2], rec[4]
            bits = _decompress(blob[:mlen], (n + 7) // 8, compression)
            values = _decompress(blob[mlen:], count, compression)
            mask = np.unpackbits(bits, count=n).view(np.bool_)
            if int(np.count_nonzero(mask)) != count:
                raise WeightSyncError(
                    f"delta chunk at {a}: {count} changed bytes listed, its bitmap marks another number"
                )
            dst[mask] = values
    return checksum_bytes(dst, algo)


def apply_many(
    items: list[tuple[np.ndarray, object, list, int]], encoding: str, compression: str, algo: str
) -> list[str]:
    """Apply several encoded tensors in place, all chunks on the pool at once; returns each tensor's checksum.

    ``items``: (target bytes, concatenated encoded parts, chunk records, chunk size used when encoding).
    """
    per_item = []
    for target, blob, records, chunk in items:
        mv = blob if isinstance(blob, memoryview) else memoryview(blob).cast("B")
        by_off, pos = {}, 0
        for rec in records:
            size = rec[2] if encoding == "xor" else rec[2] + rec[3]
            by_off[rec[0]] = (rec, mv[pos : pos + size])
            pos += size
        if pos != len(mv):
            raise WeightSyncError(f"delta entry holds {len(mv)} bytes but its chunks need {pos}")
        if len(by_off) != len(records):
            raise WeightSyncError("delta entry lists a chunk twice")
        futs = []
        for a, b in spans(target.size, chunk):
            rec, part = by_off.pop(a, (None, None))
            futs.append(pool().submit(_apply_chunk, target, part, rec, a, b, encoding, compression, algo))
        if by_off:
            raise WeightSyncError(f"delta chunks at offsets {sorted(by_off)[:3]} lie outside the tensor")
        per_item.append(futs)
    out, err = [], None
    for futs in per_item:
        digests = []
        for f in futs:
            try:
                digests.append(f.result())
            except Exception as e:  # noqa: BLE001 - wait for every job before raising, they write into targets
                err = err or e
        out.append(combine(digests, algo) if err is None else "")
    if err is not None:
        raise err if isinstance(err, WeightSyncError) else WeightSyncError(f"delta does not apply: {err}")
    return out


def apply(target: np.ndarray, blob, records: list, encoding: str, compression: str, chunk: int | None = None) -> None:
    """Apply one encoded tensor (``blob``: its concatenated chunk parts) to ``target`` in place."""
    apply_many([(target, blob, records, chunk or CHUNK)], encoding, compression, "none")


def digest(buf: np.ndarray, algo: str, chunk: int | None = None) -> str:
    """A tensor's checksum as the delta codec defines it (chunk digests combined), hashed on the pool."""
    chunk = chunk or CHUNK
    parts = spans(buf.size, chunk)
    if len(parts) == 1:
        return combine([checksum_bytes(buf, algo)], algo)
    return combine([f.result() for f in [pool().submit(checksum_bytes, buf[a:b], algo) for a, b in parts]], algo)


class DeltaState:
    """The trainer's host snapshot of what the engines hold, and the encoder against it.

    Host memory: one copy of every weight in the engine dtype (the model's size in bytes).
    """

    def __init__(self, encoding: str, compression: str, checksum: str):
        self.encoding = encoding
        self.compression = compression
        self.checksum = checksum
        self.snapshot: dict[str, np.ndarray] = {}
        self.meta: dict[str, tuple[str, list[int]]] = {}
        self.version: int | None = None  # the version the engines hold, when they hold a snapshot's bytes

    @property
    def has_base(self) -> bool:
        return self.version is not None

    def record(self, name: str, new: np.ndarray, dtype: str, shape: list[int]) -> None:
        """Baseline: remember ``new`` as what the engines will hold."""
        snap = self.snapshot.get(name)
        if snap is None or snap.size != new.size:
            self.snapshot[name] = new.copy()
        else:
            np.copyto(snap, new)
        self.meta[name] = (dtype, shape)

    def submit(self, name: str, new: np.ndarray, dtype: str, shape: list[int], keep: object = None) -> Pending:
        """Start encoding ``new`` against the snapshot (which becomes ``new``); ``keep`` stays alive until done."""
        old = self.snapshot.get(name)
        if old is None:
            raise WeightSyncError(f"delta sync: {name} is not in the baseline; the model's parameter set changed")
        self.meta[name] = (dtype, shape)
        return submit_encode(new, old, self.encoding, self.compression, self.checksum, keep)

    def encode(self, name: str, new: np.ndarray, dtype: str, shape: list[int]):
        """(changed bytes, records, parts, checksum) of ``new`` against the snapshot; snapshot becomes ``new``."""
        return self.submit(name, new, dtype, shape).result()
