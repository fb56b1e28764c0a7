"""slime's disk weight stream, byte for byte: version folders, index, shards, encodings, checksums.

The interchange format a trainer writes under ``--update-weight-disk-dir`` and every engine host
reads (slime's ``/pull_weights`` receiver for SGLang reads the same bytes):

    <source_dir>/weight_v{N:06d}/            one folder per version; version 0 is the engines' own
                                             base checkpoint and is never written
        model.safetensors.index.json         {"metadata": {...}, "weight_map": {hf_name: shard}}
        model-{i:05d}-of-{n:05d}.safetensors 0-based shard numbers

A version is a **delta iff** its index metadata has ``delta_encoding``; anything else is a full
Hugging Face checkpoint. A delta's index metadata is ``version`` and ``base_version`` (``%06d``
strings, base = version - 1), ``delta_encoding`` (``xor`` | ``overwrite``),
``compression_format`` (``zstd``) and ``checksum_format`` (``xxh3-128`` | ``blake3`` |
``adler32``). Each delta shard holds one 1-D ``uint8`` entry per changed tensor (unchanged tensors
are omitted; a version without changes has no shard and an empty ``weight_map``): one zstd frame,
with its content size, of the tensor's diff on its raw bytes (dtype-blind):

    xor        new ^ old, the tensor's length (applying twice reverts)
    overwrite  u32le count | count x u32le byte positions | count new byte values (idempotent;
               u32 positions: a tensor of 4 GiB or more cannot use it, and is refused here)

and the shard's ``__metadata__`` maps each entry's name to the hex checksum of the tensor's **new
full bytes**. Receivers read ``sorted(*.safetensors)`` of the folder, not the ``weight_map``.
Every file is written atomically (``.tmp``, fsync, ``os.replace``).

Older tidal versions wrote another layout (``format`` in the index metadata, ``tidal.chunks`` in
delta shards); ``check_not_old_tidal`` refuses those folders with one line on how to start over.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from tidal.atomic import write_bytes_atomic
from tidal.errors import UserError, WeightSyncError
from tidal.weight_sync.checksum import checksum_bytes

INDEX = "model.safetensors.index.json"
ENCODINGS = ("xor", "overwrite")
CHECKSUMS = ("xxh3-128", "blake3", "adler32")
COMPRESSION = "zstd"
OVERWRITE_LIMIT = 1 << 32  # u32 byte positions
_VERSION_DIR = re.compile(r"^weight_v(\d{6,})$")
ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def version_dir(source_dir: str, version: int) -> str:
    return os.path.join(source_dir, f"weight_v{version:06d}")


def parse_version_dir(name: str) -> int | None:
    m = _VERSION_DIR.match(name)
    return int(m.group(1)) if m else None


def shard_name(offset: int, total: int) -> str:
    return f"model-{offset:05d}-of-{total:05d}.safetensors"


# ------------------------------------------------------------------------------------------- files


atomic_write = write_bytes_atomic  # every file of the format is published this way (tidal.atomic)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def index_metadata(folder: str) -> dict | None:
    """The index metadata of a version folder; None when it has no index (a plain full checkpoint)."""
    try:
        return read_json(os.path.join(folder, INDEX)).get("metadata", {}) or {}
    except FileNotFoundError:
        return None


def is_delta(folder: str) -> bool:
    """slime's rule: a delta iff the index metadata declares an encoding; a missing folder is an error."""
    if not os.path.isdir(folder):
        raise WeightSyncError(f"published weight version missing: {folder}")
    meta = index_metadata(folder)
    check_not_old_tidal(folder, meta)
    return meta is not None and "delta_encoding" in meta


OLD_TIDAL = (
    "{where} was written by an older tidal (its own disk layout, not slime's); "
    "remove it (or point --update-weight-disk-dir / --update-weight-local-checkpoint-dir at a new folder) and start over"
)


def check_not_old_tidal(folder: str, meta: dict | None) -> None:
    """Refuse a version folder in the layout older tidal versions wrote (``format`` in the index metadata)."""
    if meta is not None and meta.get("format") in ("full", "delta"):
        raise UserError(OLD_TIDAL.format(where=folder))


def safetensors_header(path: str) -> tuple[int, dict]:
    """(data start, header) of a safetensors file: where each tensor's bytes sit."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes sit in a checkpoint folder."""

    path: str
    offset: int
    nbytes: int
    dtype: str  # safetensors dtype code (BF16, F32, ...)
    shape: tuple[int, ...]


def tensor_locations(folder: str) -> dict[str, TensorLocation]:
    """name -> location of every tensor in every ``*.safetensors`` file of ``folder`` (headers only)."""
    out: dict[str, TensorLocation] = {}
    for shard in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        path = os.path.join(folder, shard)
        start, header = safetensors_header(path)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            out[name] = TensorLocation(path, start + a, b - a, info["dtype"], tuple(info["shape"]))
    return out


def read_bytes(loc: TensorLocation) -> np.ndarray:
    return np.fromfile(loc.path, dtype=np.uint8, count=loc.nbytes, offset=loc.offset)


# --------------------------------------------------------------------------------------- checksums


def checksum(algo: str, buf) -> str:
    """The hex checksum slime's receivers compare: xxh3-128 (32 hex), blake3 (64 hex), adler32 (8 hex)."""
    if algo not in CHECKSUMS:
        raise WeightSyncError(f"checksum_format {algo!r} is not one of {', '.join(CHECKSUMS)}")
    return checksum_bytes(buf, algo)


# --------------------------------------------------------------------------------------- encodings


def check_overwrite_size(name: str, nbytes: int) -> None:
    """``overwrite`` stores u32 byte positions: refuse tensors of 4 GiB or more instead of wrapping."""
    if nbytes >= OVERWRITE_LIMIT:
        raise UserError(
            f"{name}: {nbytes} bytes is 4 GiB or more, past the u32 byte positions of the overwrite delta encoding; "
            "use --update-weight-delta-encoding xor"
        )


def diff(new: np.ndarray, old: np.ndarray, encoding: str, name: str = "tensor") -> tuple[int, np.ndarray | None]:
    """(changed bytes, uncompressed diff or None when nothing changed) of one tensor's raw bytes."""
    if new.size != old.size:
        raise WeightSyncError(f"{name}: {new.size} bytes now, {old.size} in the previous version")
    if encoding == "xor":
        d = np.bitwise_xor(new, old)
        changed = int(np.count_nonzero(d))
        return changed, (d if changed else None)
    if encoding == "overwrite":
        check_overwrite_size(name, new.size)
        pos, vals = changed_bytes(new, old)
        if not pos.size:
            return 0, None
        return int(pos.size), overwrite_bytes(pos, vals)
    raise WeightSyncError(f"delta_encoding {encoding!r} is not one of {', '.join(ENCODINGS)}")


def overwrite_bytes(pos: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """The ``overwrite`` layout: u32le count, the u32le positions, the new byte values."""
    head = np.array([pos.size], dtype="<u4")
    return np.concatenate([head.view(np.uint8), pos.astype("<u4", copy=False).view(np.uint8), vals])


def changed_bytes(new: np.ndarray, old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(u32le positions in increasing order, new values) of the bytes that differ.

    Compared as 8-byte words first: an RL update changes ~23 % of the words of bf16 weights, so the
    byte-level work runs on those only (the bytes on the wire are the same as a byte-wise compare's).
    ``flatnonzero`` runs on boolean masks, where numpy has a fast path (4x a uint8 array's).
    """
    words = new.size // 8
    nw, ow = new[: words * 8].view("<u8"), old[: words * 8].view("<u8")
    idx = np.flatnonzero(nw != ow)
    changed = np.take(nw, idx)
    j = np.flatnonzero((changed ^ np.take(ow, idx)).view(np.uint8) != 0)  # changed bytes within those words
    vals = changed.view(np.uint8)[j]
    pos = np.take(idx, j >> 3)
    pos <<= 3
    j &= 7
    pos |= j
    pos = pos.astype("<u4")  # tensors < 4 GiB (check_overwrite_size): positions fit u32
    tail = np.flatnonzero(new[words * 8 :] != old[words * 8 :])
    if tail.size:
        pos = np.concatenate([pos, (tail + words * 8).astype("<u4")])
        vals = np.concatenate([vals, new[words * 8 :][tail]])
    return pos, vals


def compress(d: np.ndarray, threads: int = 0) -> np.ndarray:
    """One zstd level-1 frame with its content size (multi-threaded compression still writes one frame)."""
    cctx = zstandard.ZstdCompressor(level=1, threads=threads, write_content_size=True)
    return np.frombuffer(cctx.compress(memoryview(d)), dtype=np.uint8)


def decompress(blob, name: str) -> np.ndarray:
    """The frame's bytes; the frame must name its content size (the ``overwrite`` decoder relies on it)."""
    try:
        size = zstandard.frame_content_size(bytes(blob[:18]))
        if size < 0:
            raise WeightSyncError(f"{name}: the zstd frame does not record its content size")
        out = zstandard.ZstdDecompressor().decompress(memoryview(blob), max_output_size=size)
    except zstandard.ZstdError as e:
        raise WeightSyncError(f"{name}: corrupt zstd frame ({e})") from None
    return np.frombuffer(out, dtype=np.uint8)


def overwrite_parts(d: np.ndarray, size: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(positions, new values) of a decompressed ``overwrite`` diff, checked against a tensor of ``size`` bytes."""
    if d.size < 4:
        raise WeightSyncError(f"{name}: overwrite diff of {d.size} bytes has no count")
    count = int(d[:4].view("<u4")[0])
    if d.size != 4 + 5 * count:
        raise WeightSyncError(f"{name}: overwrite diff of {d.size} bytes for {count} positions")
    pos = d[4 : 4 + 4 * count].view("<u4")
    if count and int(pos.max()) >= size:
        raise WeightSyncError(f"{name}: overwrite position past the tensor's {size} bytes")
    return pos, d[4 + 4 * count :]


def apply(old: np.ndarray, blob, encoding: str, name: str = "tensor", inplace: bool = False) -> np.ndarray:
    """The new bytes of a tensor: ``old`` with one decoded diff applied (in ``old`` itself when ``inplace``)."""
    d = decompress(blob, name)
    if encoding == "xor":
        if d.size != old.size:
            raise WeightSyncError(f"{name}: xor diff of {d.size} bytes for a tensor of {old.size}")
        return np.bitwise_xor(old, d, out=old if inplace else None)
    if encoding == "overwrite":
        pos, vals = overwrite_parts(d, old.size, name)
        new = old if inplace else old.copy()
        new[pos] = vals
        return new
    raise WeightSyncError(f"delta_encoding {encoding!r} is not one of {', '.join(ENCODINGS)}")


# ------------------------------------------------------------------------------------------- index


def delta_index(version: int, encoding: str, checksum_format: str, weight_map: dict[str, str]) -> dict:
    return {
        "metadata": {
            "version": f"{version:06d}",
            "base_version": f"{version - 1:06d}",
            "delta_encoding": encoding,
            "compression_format": COMPRESSION,
            "checksum_format": checksum_format,
        },
        "weight_map": weight_map,
    }


def write_index(folder: str, index: dict) -> None:
    atomic_write(os.path.join(folder, INDEX), json.dumps(index).encode())
