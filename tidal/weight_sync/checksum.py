"""Checksums of raw tensor bytes, used to verify every sync and to compare trainer and engine weights.

xxh3-128 (default), blake3 (optional package ``blake3``: the ``blake3`` extra) or adler32.

Dtype-blind: a tensor is hashed as its contiguous bytes, so two tensors hash equal exactly when they
are bitwise equal (up to hash collisions of a 128-bit hash).

xxh3-128 of a buffer over 64 KiB goes through a hasher object's ``update``, which releases the GIL
(python-xxhash's one-shot functions hold it), so chunks hash on every core at once; the digest is
the same as the one-shot's.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import torch
import xxhash


def as_numpy_u8(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a CPU tensor's bytes (copies only if it is not contiguous).

    Not ``Tensor.numpy()``: that marks the tensor's storage as never resizable again, and on a torch
    without the in-place block swap (``tidal.memory.home.CAN_SWAP``, e.g. 2.11) the portable memory
    backend frees a paused storage by resizing it, so a checksum of the live weights would make the
    next pause fail. The array is a view of the same memory through ``ctypes`` and keeps the tensor
    alive (its ``base``)."""
    t = t.detach().contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    raw = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    raw.owner = t  # the view's lifetime holds the tensor (and a contiguous copy, when one was made)
    return np.frombuffer(raw, dtype=np.uint8)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a tensor's bytes, on the host (copies only when not contiguous or not on CPU;
    the storage stays resizable: ``as_numpy_u8``)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return as_numpy_u8(t)


# Above this size xxhash's ``update`` runs without the GIL (python-xxhash releases it past 64 KiB).
_GIL_FREE_BYTES = 1 << 16


def checksum_bytes(buf, algo: str = "xxh3-128") -> str:
    if algo == "xxh3-128":
        if memoryview(buf).nbytes > _GIL_FREE_BYTES:
            h = xxhash.xxh3_128()
            h.update(buf)
            return h.hexdigest()
        return xxhash.xxh3_128_hexdigest(buf)
    if algo == "adler32":
        return f"{zlib.adler32(buf, 1) & 0xFFFFFFFF:08x}"
    if algo == "blake3":
        return _blake3(buf)
    if algo == "none":
        return ""
    raise ValueError(f"unknown checksum {algo!r}; use xxh3-128, blake3, adler32 or none")


def _blake3(buf) -> str:
    try:
        import blake3
    except ImportError:
        from tidal.errors import UserError

        raise UserError(
            "checksum blake3 needs the blake3 package: pip install 'tidal[blake3]', or use xxh3-128"
        ) from None
    # max_threads: blake3 hashes one large buffer on several threads (same digest as one thread).
    h = (
        blake3.blake3(max_threads=blake3.blake3.AUTO)
        if memoryview(buf).nbytes > _GIL_FREE_BYTES << 4
        else blake3.blake3()
    )
    h.update(buf)
    return h.hexdigest()


class Hasher:
    """A checksum fed piece by piece; ``hexdigest()`` equals ``checksum_bytes`` of the pieces joined."""

    def __init__(self, algo: str = "xxh3-128"):
        self.algo = algo
        if algo == "xxh3-128":
            self._h = xxhash.xxh3_128()
        elif algo == "blake3":
            checksum_bytes(b"", "blake3")  # the clear error when the package is missing
            import blake3

            self._h = blake3.blake3()
        elif algo == "adler32":
            self._adler = 1
        elif algo != "none":
            raise ValueError(f"unknown checksum {algo!r}; use xxh3-128, blake3, adler32 or none")

    def update(self, buf) -> None:
        if self.algo == "adler32":
            self._adler = zlib.adler32(buf, self._adler)
        elif self.algo != "none":
            self._h.update(buf)

    def hexdigest(self) -> str:
        if self.algo == "adler32":
            return f"{self._adler & 0xFFFFFFFF:08x}"
        return self._h.hexdigest() if self.algo != "none" else ""


def tensor_checksum(t: torch.Tensor, algo: str = "xxh3-128") -> str:
    return checksum_bytes(tensor_bytes(t), algo)
