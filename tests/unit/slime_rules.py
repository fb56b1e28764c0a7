"""slime's disk-delta stream, written out from its published rules alone, for tests of tidal's two halves.

Rules (slime ``slime/utils/disk_delta.py``, ``update_weight_from_disk_delta.py`` and the receiver of
``docker/patch/latest/sglang-pull_weights.patch``): version folders ``weight_v{N:06d}``; a version is a
delta iff its index metadata has ``delta_encoding``; the metadata is ``version``/``base_version`` as
``%06d`` strings, ``delta_encoding`` (xor | overwrite), ``compression_format`` zstd and
``checksum_format`` (xxh3-128 | blake3 | adler32); shards are read in sorted order, each entry a 1-D
uint8 zstd frame (with its content size) of ``new ^ old`` or ``u32le count | u32le positions | new
bytes``; each shard's ``__metadata__`` holds the checksum of each tensor's new full bytes. Nothing
here imports tidal.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import zlib

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from safetensors.torch import save_file


def _hash(algo: str, buf) -> str:
    if algo == "xxh3-128":
        h = xxhash.xxh3_128()
    elif algo == "blake3":
        blake3 = pytest.importorskip("blake3")
        h = blake3.blake3()
    else:
        return f"{zlib.adler32(bytes(buf), 1):08x}"
    h.update(bytes(buf))
    return h.hexdigest()


def _header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _locations(folder: str) -> dict:
    out = {}
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        start, header = _header(path)
        for name, info in header.items():
            if name != "__metadata__":
                a, b = info["data_offsets"]
                out[name] = (path, start + a, b - a)
    return out


def slime_apply(local: str, version_folder: str) -> None:
    """Apply one version as slime's receiver does: full -> copy, delta -> patch in place and verify."""
    index_path = os.path.join(version_folder, "model.safetensors.index.json")
    meta = json.load(open(index_path))["metadata"] if os.path.exists(index_path) else {}
    if "delta_encoding" not in meta:
        for f in os.listdir(local):
            os.remove(os.path.join(local, f))
        for f in os.listdir(version_folder):
            shutil.copy(os.path.join(version_folder, f), local)
        return
    assert meta["version"] == f"{int(meta['version']):06d}" and int(meta["base_version"]) == int(meta["version"]) - 1
    assert meta["compression_format"] == "zstd"
    locs = _locations(local)
    for delta_file in sorted(glob.glob(os.path.join(version_folder, "*.safetensors"))):
        blob = open(delta_file, "rb").read()
        start, header = _header(delta_file)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            assert info["dtype"] == "U8" and len(info["shape"]) == 1
            a, b = info["data_offsets"]
            frame = blob[start + a : start + b]
            diff = np.frombuffer(zstandard.ZstdDecompressor().decompress(frame), dtype=np.uint8)  # needs content size
            path, off, n = locs[name]
            region = np.memmap(path, dtype=np.uint8, mode="r+", offset=off, shape=(n,))
            if meta["delta_encoding"] == "xor":
                region ^= diff
            else:
                count = int(np.frombuffer(diff[:4].tobytes(), "<u4")[0])
                region[np.frombuffer(diff[4 : 4 + 4 * count].tobytes(), "<u4")] = diff[4 + 4 * count :]
            assert _hash(meta["checksum_format"], region) == header["__metadata__"][name], name
            region.flush()


def slime_publish(disk: str, version: int, old: dict, new: dict, encoding: str, algo: str) -> None:
    """Write one delta version as slime's trainer does (one shard, changed tensors only)."""
    folder = os.path.join(disk, f"weight_v{version:06d}")
    os.makedirs(folder)
    tensors, sums = {}, {}
    for name in new:
        n, o = _raw(new[name]), _raw(old[name])
        if encoding == "xor":
            d = n ^ o
            if not d.any():
                continue
        else:
            mask = n != o
            if not mask.any():
                continue
            pos = np.flatnonzero(mask).astype("<u4")
            d = np.concatenate([np.array([pos.size], "<u4").view(np.uint8), pos.view(np.uint8), n[mask]])
        tensors[name] = torch.frombuffer(
            bytearray(zstandard.ZstdCompressor(level=1).compress(d.tobytes())), dtype=torch.uint8
        )
        sums[name] = _hash(algo, n)
    shard = "model-00000-of-00001.safetensors"
    if tensors:
        save_file(tensors, os.path.join(folder, shard), metadata=sums)
    index = {
        "metadata": {
            "version": f"{version:06d}",
            "base_version": f"{version - 1:06d}",
            "delta_encoding": encoding,
            "compression_format": "zstd",
            "checksum_format": algo,
        },
        "weight_map": dict.fromkeys(tensors, shard),
    }
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write(json.dumps(index))


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().copy()
