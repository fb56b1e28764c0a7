"""Fast encode and apply of slime's disk delta (``disk_format`` has the bytes; this module the speed).

What lands on disk is ``disk_format``'s layout exactly: one zstd frame with its content size per
changed tensor, of the ``xor`` diff or the ``overwrite`` ``count | positions | values`` bytes, and
the checksum of the tensor's new full bytes. How it gets there:

- **One pool job per tensor** (``delta.pool``, one thread per core): numpy, zstd and the checksums
  release the GIL, so tensors encode on every core at once.
- **In spans of ``SPAN`` bytes**, in cache: each span is diffed into a per-thread scratch buffer,
  fed to a streaming zstd compressor (a ``chunker``) told the tensor's diff size up front (so the frame
  still records its content size), hashed, and copied into the snapshot while hot. No tensor-sized
  temporary is allocated (fresh allocations cost more in page faults than the diff itself), and the
  ``overwrite`` layout is streamed part by part instead of being concatenated first.
- **Large tensors** (``LARGE`` bytes and up, e.g. an embedding) are diffed span by span on the pool
  in parallel, then one job compresses the whole diff on several zstd threads, which still writes
  one frame.
- **Apply** runs one job per tensor too, largest first (a single frame decodes on one thread, so
  the largest tensor is the critical path): ``xor`` is decompressed span by span into scratch and
  xored into the memory-mapped tensor, ``overwrite`` decoded whole (5 bytes per changed byte) and
  scattered. Each patch hashes the new bytes while they are hot and keeps what is needed to revert
  it (``overwrite``: the old bytes; ``xor``: the frame itself, applied once more).

``python -m tidal.bench.delta_codec --format disk`` measures both directions next to memcpy and
zstd's own speed on the same diffs.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import zstandard

from tidal.errors import WeightSyncError
from tidal.weight_sync import disk_format as fmt
from tidal.weight_sync.checksum import Hasher
from tidal.weight_sync.delta import thread_decompressor

SPAN = 4 << 20  # bytes diffed, compressed and hashed at a time (stays in cache)
LARGE = 64 << 20  # tensors this large are diffed span by span across the pool
_OUT_CHUNK = 1 << 20  # compressed output comes back in pieces of this size (joined once per tensor)
_local = threading.local()


@dataclass
class Encoded:
    """One tensor's entry of a delta shard: its compressed diff and the checksum of its new bytes."""

    name: str
    changed: int  # changed bytes
    blob: np.ndarray | None  # one zstd frame (uint8); None when nothing changed
    digest: str | None


def _cctx(threads: int = 0) -> zstandard.ZstdCompressor:
    """This thread's level-1 compressor (compressors are not thread safe); ``threads``: zstd workers."""
    cache = _local.__dict__.setdefault("cctx", {})
    c = cache.get(threads)
    if c is None:
        c = cache[threads] = zstandard.ZstdCompressor(level=1, threads=threads, write_content_size=True)
    return c


def _scratch(n: int) -> np.ndarray:
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.size < n:
        buf = _local.scratch = np.empty(max(n, SPAN), np.uint8)
    return buf[:n]


def _spans(n: int, span: int | None = None) -> list[tuple[int, int]]:
    span = span or SPAN
    return [(a, min(a + span, n)) for a in range(0, n, span)]


# ------------------------------------------------------------------------------------------ encode


def _encode_xor(name: str, new: np.ndarray, old: np.ndarray, algo: str) -> Encoded:
    chunker = _cctx().chunker(size=new.size, chunk_size=_OUT_CHUNK)
    h = Hasher(algo)
    parts, changed = [], 0
    for a, b in _spans(new.size):
        d = np.bitwise_xor(new[a:b], old[a:b], out=_scratch(b - a))
        c = int(np.count_nonzero(d))
        parts.extend(chunker.compress(d))
        h.update(new[a:b])
        if c:
            np.copyto(old[a:b], new[a:b])
            changed += c
    parts.extend(chunker.finish())
    if not changed:
        return Encoded(name, 0, None, None)
    return Encoded(name, changed, np.frombuffer(b"".join(parts), np.uint8), h.hexdigest())


def _overwrite_frame(pos: list[np.ndarray], vals: list[np.ndarray], threads: int = 0) -> np.ndarray:
    """``u32le count | positions | values`` compressed as one frame, fed part by part (no concatenation)."""
    count = sum(p.size for p in pos)
    chunker = _cctx(threads).chunker(size=4 + 5 * count, chunk_size=_OUT_CHUNK)
    parts = list(chunker.compress(np.array([count], "<u4").tobytes()))
    for piece in [p.view(np.uint8) for p in pos] + vals:
        if piece.size:
            parts.extend(chunker.compress(piece))
    parts.extend(chunker.finish())
    return np.frombuffer(b"".join(parts), np.uint8)


def _encode_overwrite(name: str, new: np.ndarray, old: np.ndarray, algo: str) -> Encoded:
    fmt.check_overwrite_size(name, new.size)
    h = Hasher(algo)
    pos, vals = [], []
    for a, b in _spans(new.size):
        p, v = fmt.changed_bytes(new[a:b], old[a:b])
        if p.size:
            p += np.uint32(a)
            pos.append(p)
            vals.append(v)
            np.copyto(old[a:b], new[a:b])
        h.update(new[a:b])
    changed = sum(p.size for p in pos)
    if not changed:
        return Encoded(name, 0, None, None)
    return Encoded(name, changed, _overwrite_frame(pos, vals), h.hexdigest())


def encode_tensor(name: str, new: np.ndarray, old: np.ndarray, encoding: str, algo: str) -> Encoded:
    """Encode ``new`` against the snapshot ``old`` (which becomes ``new``), on this thread."""
    if new.size != old.size:
        raise WeightSyncError(f"{name}: {new.size} bytes now, {old.size} in the previous version")
    if encoding == "xor":
        return _encode_xor(name, new, old, algo)
    if encoding == "overwrite":
        return _encode_overwrite(name, new, old, algo)
    raise WeightSyncError(f"delta_encoding {encoding!r} is not one of {', '.join(fmt.ENCODINGS)}")


def _diff_span(new: np.ndarray, old: np.ndarray, encoding: str, a: int, b: int, out: np.ndarray | None):
    """One span of a large tensor: (changed bytes, None (xor: written into ``out``) | (positions, values))."""
    if encoding == "xor":
        d = np.bitwise_xor(new[a:b], old[a:b], out=out[a:b])
        np.copyto(old[a:b], new[a:b])
        return int(np.count_nonzero(d)), None
    p, v = fmt.changed_bytes(new[a:b], old[a:b])
    if p.size:
        p += np.uint32(a)
        np.copyto(old[a:b], new[a:b])
    return int(p.size), (p, v)


def _join_large(name: str, new: np.ndarray, encoding: str, algo: str, parts: list[Future], out, threads: int):
    """A large tensor's entry from its spans' diffs: one frame compressed on ``threads`` zstd workers."""
    done = [f.result() for f in parts]  # queued before this job, so never waiting behind it
    changed = sum(c for c, _ in done)
    if not changed:
        return Encoded(name, 0, None, None)
    if encoding == "xor":
        blob = np.frombuffer(_cctx(threads).compress(out), np.uint8)
    else:
        blob = _overwrite_frame([p for _, (p, _) in done], [v for _, (_, v) in done], threads)
    return Encoded(name, changed, blob, fmt.checksum(algo, new))


def submit_encode(workers, name: str, new: np.ndarray, old: np.ndarray, encoding: str, algo: str) -> Future:
    """Encode one tensor on ``workers``: one job, or (``LARGE`` and up) one job per span and a join."""
    if new.size < LARGE or new.size != old.size or encoding not in fmt.ENCODINGS:
        return workers.submit(encode_tensor, name, new, old, encoding, algo)
    if encoding == "overwrite":
        fmt.check_overwrite_size(name, new.size)
    out = np.empty(new.size, np.uint8) if encoding == "xor" else None
    parts = [workers.submit(_diff_span, new, old, encoding, a, b, out) for a, b in _spans(new.size, SPAN)]
    threads = max(2, workers._max_workers)
    return workers.submit(_join_large, name, new, encoding, algo, parts, out, threads)


# ------------------------------------------------------------------------------------------- apply


def _frame_size(blob, name: str) -> int:
    try:
        size = zstandard.frame_content_size(bytes(blob[:18]))
    except zstandard.ZstdError as e:
        raise WeightSyncError(f"{name}: corrupt zstd frame ({e})") from None
    if size < 0:
        raise WeightSyncError(f"{name}: the zstd frame does not record its content size")
    return size


def _xor_stream(region: np.ndarray, blob, name: str, algo: str | None, upto: int | None = None) -> str | None:
    """XOR the frame's bytes into ``region`` span by span (the first ``upto`` bytes only, when given);
    returns the checksum of the patched region when ``algo`` is given. On a decode error after some
    spans were applied, those are xored back before the error is raised, so nothing is changed."""
    h = Hasher(algo) if algo else None
    end = region.size if upto is None else upto
    done = 0
    try:
        with thread_decompressor().stream_reader(memoryview(blob), read_across_frames=False) as reader:
            while done < end:
                buf = _scratch(min(SPAN, end - done))
                k = reader.readinto(buf)
                if k == 0:
                    break
                dst = region[done : done + k]
                np.bitwise_xor(dst, buf[:k], out=dst)
                if h is not None:
                    h.update(dst)
                done += k
    except zstandard.ZstdError as e:
        if upto is None and done:
            _xor_stream(region, blob, name, None, upto=done)
        raise WeightSyncError(f"{name}: corrupt zstd frame ({e})") from None
    if done != end:
        if upto is None and done:
            _xor_stream(region, blob, name, None, upto=done)
        raise WeightSyncError(f"{name}: xor diff of {done} bytes for a tensor of {region.size}")
    return h.hexdigest() if h is not None else None


def patch(region: np.ndarray, blob, encoding: str, name: str, algo: str) -> tuple[np.ndarray | None, str]:
    """Apply one entry in place; returns (what ``unpatch`` needs, checksum of the new bytes).

    A malformed entry raises ``WeightSyncError`` with ``region`` unchanged."""
    size = _frame_size(blob, name)
    if encoding == "xor":
        if size != region.size:
            raise WeightSyncError(f"{name}: xor diff of {size} bytes for a tensor of {region.size}")
        return None, _xor_stream(region, blob, name, algo)
    if encoding == "overwrite":
        pos, vals = fmt.overwrite_parts(fmt.decompress(blob, name), region.size, name)
        old = region[pos]
        region[pos] = vals
        return old, fmt.checksum(algo, region)
    raise WeightSyncError(f"delta_encoding {encoding!r} is not one of {', '.join(fmt.ENCODINGS)}")


def unpatch(region: np.ndarray, blob, encoding: str, name: str, undo: np.ndarray | None) -> None:
    """Revert a ``patch``: the old bytes back (``overwrite``), or the same diff once more (``xor``)."""
    if encoding == "overwrite":
        pos, _ = fmt.overwrite_parts(fmt.decompress(blob, name), region.size, name)
        region[pos] = undo
    else:
        _xor_stream(region, blob, name, None)
