"""Checksums of raw tensor bytes, used to verify every sync and to compare trainer and engine weights.

Dtype-blind: a tensor is hashed as its contiguous bytes, so two tensors hash equal exactly when they
are bitwise equal (up to hash collisions of a 128-bit hash).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
import xxhash


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a CPU tensor's bytes (copies only when not contiguous or not on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def checksum_bytes(buf, algo: str = "xxh3-128") -> str:
    if algo == "xxh3-128":
        return xxhash.xxh3_128_hexdigest(buf)
    if algo == "adler32":
        return f"{zlib.adler32(buf) & 0xFFFFFFFF:08x}"
    if algo == "none":
        return ""
    raise ValueError(f"unknown checksum {algo!r}; use xxh3-128, adler32 or none")


def tensor_checksum(t: torch.Tensor, algo: str = "xxh3-128") -> str:
    return checksum_bytes(tensor_bytes(t), algo)
