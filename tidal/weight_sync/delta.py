"""Delta encoding of weight bytes: ship only what changed against what the engines already hold.

Both sides keep a host snapshot of the bytes the engines hold (the trainer: ``DeltaState``; each
engine: ``tidal.weight_sync.receiver``). Encoding is dtype-blind, on raw bytes, per tensor, in
chunks of ``CHUNK`` bytes so large tensors encode and apply on every core (numpy comparisons and
zstd release the GIL):

    overwrite  a bitmap of changed byte positions (1 bit per byte, so it has no width limit: tensors
               over 4 GiB are fine) + the new bytes, dense with zeros elsewhere. Applying sets the
               marked bytes, so applying twice is harmless (a retried apply cannot corrupt).
    xor        ``new ^ old``; applying xors again. Smaller to compute, but applying twice reverts.

Each chunk's parts are zstd-compressed (level 1) unless compression is ``none``. Unchanged chunks
are omitted; unchanged tensors produce no entry. Every changed tensor carries a checksum of its full
new bytes (``--update-weight-checksum``), verified after applying.

A chunk record is ``[offset, length, parts...]`` where parts are the compressed lengths in order:
overwrite ``(mask_len, values_len)``, xor ``(diff_len,)``; the encoded bytes of all chunks of a
tensor are concatenated in the same order.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zstandard

from tidal.errors import WeightSyncError
from tidal.weight_sync.checksum import checksum_bytes

CHUNK = 16 * 1024**2
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


def _encode_chunk(new: np.ndarray, old: np.ndarray, off: int, encoding: str, compression: str):
    """Encode one chunk and update the snapshot chunk ``old`` to ``new``; None when unchanged."""
    n = new.size
    if encoding == "xor":
        diff = np.bitwise_xor(new, old, out=_scratch("diff", n))
        changed = int(np.count_nonzero(diff))
        if changed == 0:
            return None
        np.copyto(old, new)
        part = _compress(diff, compression)
        return changed, [off, n, len(part)], [part]
    mask = np.not_equal(new, old, out=_scratch("mask", n, np.bool_))
    changed = int(np.count_nonzero(mask))
    if changed == 0:
        return None
    # The new bytes where they changed, zero elsewhere (long zero runs compress to almost nothing).
    values = np.multiply(new, mask, out=_scratch("values", n))
    np.copyto(old, new)
    bits = np.packbits(mask)
    p1, p2 = _compress(bits, compression), _compress(values, compression)
    return changed, [off, n, len(p1), len(p2)], [p1, p2]


def encode(new: np.ndarray, old: np.ndarray, encoding: str, compression: str) -> tuple[int, list, list[bytes]]:
    """Encode ``new`` against the snapshot ``old`` (updated in place to ``new``).

    Returns (changed bytes, chunk records, encoded parts); no records when nothing changed.
    """
    if new.size != old.size:
        raise WeightSyncError(f"tensor changed size between syncs ({old.size} -> {new.size} bytes)")
    spans = [(a, min(a + CHUNK, new.size)) for a in range(0, new.size, CHUNK)]
    if len(spans) <= 1:
        results = [_encode_chunk(new, old, 0, encoding, compression)] if new.size else []
    else:
        futs = [pool().submit(_encode_chunk, new[a:b], old[a:b], a, encoding, compression) for a, b in spans]
        results = [f.result() for f in futs]
    changed, records, parts = 0, [], []
    for r in results:
        if r is None:
            continue
        changed += r[0]
        records.append(r[1])
        parts.extend(r[2])
    return changed, records, parts


def _apply_chunk(target: np.ndarray, blob: memoryview, rec: list, encoding: str, compression: str) -> None:
    off, n = rec[0], rec[1]
    dst = target[off : off + n]
    if encoding == "xor":
        diff = _decompress(blob, n, compression)
        np.bitwise_xor(dst, diff, out=dst)
        return
    mlen = rec[2]
    bits = _decompress(blob[:mlen], (n + 7) // 8, compression)
    values = _decompress(blob[mlen:], n, compression)
    mask = np.unpackbits(bits, count=n).view(np.bool_)
    np.copyto(dst, values, where=mask)


def apply(target: np.ndarray, blob, records: list, encoding: str, compression: str) -> None:
    """Apply an encoded tensor (``blob``: its concatenated chunk parts) to ``target`` in place."""
    mv = memoryview(blob).cast("B") if not isinstance(blob, memoryview) else blob
    jobs, pos = [], 0
    for rec in records:
        size = sum(rec[2:])
        jobs.append((mv[pos : pos + size], rec))
        pos += size
    if pos != len(mv):
        raise WeightSyncError(f"delta entry holds {len(mv)} bytes but its chunks need {pos}")
    if len(jobs) <= 1:
        for b, rec in jobs:
            _apply_chunk(target, b, rec, encoding, compression)
        return
    for f in [pool().submit(_apply_chunk, target, b, rec, encoding, compression) for b, rec in jobs]:
        f.result()


def tensor_checksum(buf: np.ndarray, algo: str) -> str:
    return checksum_bytes(buf, algo)


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

    def encode(self, name: str, new: np.ndarray, dtype: str, shape: list[int]):
        """(changed bytes, records, parts, checksum) of ``new`` against the snapshot; snapshot becomes ``new``."""
        old = self.snapshot.get(name)
        if old is None:
            raise WeightSyncError(f"delta sync: {name} is not in the baseline; the model's parameter set changed")
        changed, records, parts = encode(new, old, self.encoding, self.compression)
        self.meta[name] = (dtype, shape)
        csum = checksum_bytes(old, self.checksum) if changed else ""
        return changed, records, parts, csum
