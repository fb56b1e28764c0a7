"""Buckets: the unit every transport moves, and the checksum that guards each one.

A bucket is one flat ``uint8`` buffer plus a list of entries, each naming a tensor and where its
bytes sit in the buffer. One flat byte buffer for all dtypes (rather than one per dtype) means one
IPC handle, one broadcast and one checksum per bucket; every entry starts at a 64-byte aligned
offset so a slice can be viewed as any dtype without a copy.

An entry is a plain dict (it travels through Ray and JSON unchanged)::

    name, dtype ("float32", "bfloat16", ...), shape, offset, nbytes, enc, checksum[, chunks]

``enc`` is ``raw`` (the tensor's bytes) or a delta encoding (``tidal.weight_sync.delta``), whose
encoded bytes sit at ``offset`` with per-chunk lengths in ``chunks``.

Checksums: host buffers are hashed with xxh3-128 in 1 MiB chunks on every core (a hash tree).
Device buffers (CUDA IPC, NCCL) are hashed on the device by ``device_checksum`` so a GPU bucket
never crosses PCIe just to be verified: two int64 sums (plain and position-weighted, wrapping modulo 2**64, so the reduction
order does not matter) over the buffer viewed as int64 words. It is not cryptographic; it catches
flipped, dropped and swapped words, which is what a transport fault produces.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from tidal.dtypes import dtype_name, dtype_of
from tidal.weight_sync.checksum import checksum_bytes


@dataclass
class BucketHeader:
    """One bucket's header, the message every transport sends with (or ahead of) the bucket's bytes.

    It travels between processes through Ray only; an HTTP engine turns it into SGLang's request
    bodies at its edge (``tidal.rollout.http_engine``)."""

    version: int  # the version this bucket belongs to
    index: int  # its position in the sync
    mode: str  # "full" (raw bytes) or "delta" (encoded against ``base_version``)
    entries: list[dict]  # one per tensor (see the module docstring)
    nbytes: int  # the flat buffer's length
    checksum: str  # ``buffer_checksum`` of the flat buffer
    keep_snapshot: bool  # the receiver keeps a host copy as the base of the next delta
    last: bool  # the last bucket of the version: the receiver completes the version
    all_names: list[str] = field(default_factory=list)  # on the last bucket: every weight of the version
    base_version: int | None = None  # delta mode: the version the deltas apply to
    encoding: str | None = None  # the delta encoding, compression and checksum algorithm of the sync
    compression: str | None = None
    checksum_format: str | None = None
    tensor_checksums: dict[str, str] | None = None  # broadcast to an SGLang server: xxh3-128 per tensor
    data: tuple | None = None  # tensor transport: ("cuda_ipc", rebuild, args) or ("object", ref)


ALIGN = 64


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def raw_entry(name: str, t: torch.Tensor, offset: int) -> dict:
    return {
        "name": name,
        "dtype": dtype_name(t.dtype),
        "shape": list(t.shape),
        "offset": offset,
        "nbytes": nbytes_of(t),
        "enc": "raw",
        "checksum": "",
    }


def host_checksum(buf) -> str:
    """xxh3-128 of a host byte buffer (numpy array, bytes, memoryview); GIL-free on large buffers."""
    return checksum_bytes(buf, "xxh3-128")


_WEIGHT_MOD = 65521  # largest prime below 2**16: position weights stay small, products stay in int64
_CHUNK_WORDS = _WEIGHT_MOD * 64  # a multiple of the modulus, so every chunk uses the same weights (32 MiB)
_weights: dict[torch.device, torch.Tensor] = {}


def _position_weights(device: torch.device) -> torch.Tensor:
    # Cached per device: building them per call would cost three more passes over memory.
    w = _weights.get(device)
    if w is None:
        w = _weights[device] = torch.arange(_CHUNK_WORDS, device=device, dtype=torch.int64) % _WEIGHT_MOD + 1
    return w


def device_checksum(buf: torch.Tensor) -> str:
    """Order-independent checksum of a uint8 buffer computed where it lives (length: multiple of 8)."""
    assert buf.dtype == torch.uint8 and buf.numel() % 8 == 0, "device buckets are padded to 8 bytes"
    words = buf.view(torch.int64)
    weights = _position_weights(buf.device)
    s1 = words.sum()
    s2 = torch.zeros((), dtype=torch.int64, device=buf.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start : start + _CHUNK_WORDS]
        s2 += (w * weights[: w.numel()]).sum()
    return f"dev:{int(s1) & (2**64 - 1):016x}{int(s2) & (2**64 - 1):016x}{buf.numel():x}"


_HOST_CHUNK = 1 << 20


def buffer_checksum(buf) -> str:
    """The bucket checksum: on the device for device tensors; for host memory, xxh3-128 of 1 MiB
    chunks hashed on every core and combined (a 512 MiB bucket at one core's ~6 GB/s would cost ~90 ms)."""
    from tidal.weight_sync.delta import digest

    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            return device_checksum(buf)
        buf = buf.numpy()
    if not isinstance(buf, np.ndarray):
        buf = np.frombuffer(buf, dtype=np.uint8)
    return digest(buf.reshape(-1).view(np.uint8), "xxh3-128", _HOST_CHUNK)


def plan_buckets(tensors: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of tensors into lists whose aligned size stays within ``limit`` bytes.

    Consumes the stream lazily, so at most one bucket of tensors is held at a time; a tensor larger
    than the limit travels alone.
    """
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in tensors:
        n = align(nbytes_of(t))
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append((name, t))
        size += n
    if group:
        yield group


def pack(
    group: list[tuple[str, torch.Tensor]], device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, list[dict]]:
    """Copy tensors into one fresh flat uint8 buffer on ``device``, cast to ``dtype`` when given; return it and its entries.

    On a CUDA buffer every cast runs on the device: a host source in another dtype (the paused
    trainer's fp32 backup) is copied host -> device in its own dtype first (asynchronously when it
    is pinned), so PCIe carries the source bytes once and the CPU never converts. The copies go out
    as one ``_foreach_copy_`` per pair of dtypes (and source device) and the alignment gaps are zeroed by one
    ``_foreach_zero_``: a bucket of a model's ~300 tensors is a few kernel launches, not ~600.
    """
    entries, off = [], 0
    for name, t in group:
        e = raw_entry(name, t, off)
        if dtype is not None and dtype != t.dtype:
            e["dtype"] = dtype_name(dtype)
            e["nbytes"] = t.numel() * dtype.itemsize
        entries.append(e)
        off += align(e["nbytes"])
    flat = torch.empty(max(off, ALIGN), dtype=torch.uint8, device=device)
    views, gaps = _views_and_gaps(flat, entries)
    copies: dict[tuple, tuple[list, list]] = {}  # (source dtype, target dtype, source device) -> (targets, sources)
    for (_, t), dst in zip(group, views):
        src = t.detach()
        if dst.numel() == 0:
            continue
        if src.dtype != dst.dtype and src.device != flat.device:
            if flat.device.type == "cuda":
                src = src.to(flat.device, non_blocking=True)  # H2D in the source dtype; cast below on the device
            else:
                src = src.to(dst.dtype)  # to the host first (cast on the device it lives on), then copy
        dsts, srcs = copies.setdefault((src.dtype, dst.dtype, src.device), ([], []))
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in copies.values():
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
    # Zero the alignment gaps so the checksum of a bucket depends only on its tensors.
    if gaps:
        torch._foreach_zero_(gaps)
    if off == 0:
        flat.zero_()
    if flat.device.type == "cuda":
        torch.cuda.current_stream(flat.device).synchronize()
    return flat, entries


def _views_and_gaps(flat: torch.Tensor, entries: list[dict]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each entry's tensor as a view into ``flat`` and the non-empty alignment gaps after them, as byte views.

    Where every entry has one dtype and the entries tile the buffer in order (as ``pack`` lays them out), the
    views come from one ``split`` of the buffer viewed in that dtype; otherwise each is sliced on its own."""
    ends = [e["offset"] + e["nbytes"] for e in entries]
    gap_spans = [(a, align(a)) for a in ends if align(a) > a]
    dtypes = {e["dtype"] for e in entries}
    tiled = all(e["offset"] == (align(ends[i - 1]) if i else 0) for i, e in enumerate(entries))
    if len(dtypes) != 1 or not tiled:  # (no entries: no dtype)
        views = [entry_view(flat, e) for e in entries]
        return views, [flat[a:b] for a, b in gap_spans]
    want = dtype_of(dtypes.pop())
    size = want.itemsize
    sizes: list[int] = []
    for e, end in zip(entries, ends):
        sizes += [e["nbytes"] // size, (align(end) - end) // size]
    used = align(ends[-1]) // size
    parts = flat[: used * size].view(want).split(sizes)
    views = [parts[2 * i].view(e["shape"]) for i, e in enumerate(entries)]
    gaps = [parts[2 * i + 1].view(torch.uint8) for i in range(len(entries)) if sizes[2 * i + 1]]
    return views, gaps


def entry_view(flat: torch.Tensor, e: dict) -> torch.Tensor:
    """The tensor an entry describes, as a view into the flat uint8 buffer (no copy)."""
    raw = flat[e["offset"] : e["offset"] + e["nbytes"]]
    dtype = dtype_of(e["dtype"])
    if raw.numel() == 0:
        return torch.empty(e["shape"], dtype=dtype, device=flat.device)
    return raw.view(dtype).view(e["shape"])


def entry_views(flat: torch.Tensor, entries: list[dict]) -> list[torch.Tensor]:
    """``entry_view`` of every entry of a bucket, in one ``split`` of the buffer where ``pack`` laid them out."""
    return _views_and_gaps(flat, entries)[0]


def bytes_total(entries: list[dict]) -> int:
    return sum(math.prod(e["shape"]) * dtype_of(e["dtype"]).itemsize for e in entries)
