"""Full tensors from FSDP2 shards: the trainer's weight source, and the gather checkpoints reuse.

FSDP2 shards every parameter along dim 0 with ``torch.chunk`` semantics: rank ``r`` holds rows
``[r * c, min(n, (r + 1) * c))`` with ``c = ceil(n / world_size)`` (possibly none). Rank 0 rebuilds
the full tensor from the ranks' pieces.

Where the pieces are read from depends on residency:

- ACTIVE: the live local shards. On NCCL the gather is a DTensor ``full_tensor()`` (device to
  device), and with one rank the local shard itself; on CPU a gloo gather of the pieces.
- PAUSED: the memory backend's zero-copy host view of each local shard (device memory is released;
  reading it would return undefined bytes or fault). The gather runs over the host (gloo) group, so
  it works while the NCCL group is destroyed.

Pieces travel as raw bytes (``uint8`` views), so any dtype crosses gloo unchanged. With one rank no
gather happens at all: the host view (or live tensor) itself is yielded, zero-copy when it already
has the requested dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist


def _is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor. ``torch.distributed.tensor`` is imported here, not by the module: it
    pulls in sympy (over a second on a small host), and the driver imports the trainer class only to
    create its Ray actors; a tensor that is not a torch subclass cannot be one."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a (possibly DTensor) tensor, without copying."""
    with torch.no_grad():
        return t.to_local() if _is_dtensor(t) else t


def shard_rows(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Row range ``[start, end)`` of dim 0 that ``rank`` holds under FSDP2's ``torch.chunk`` sharding."""
    c = -(-n // world_size)
    start = min(n, rank * c)
    return start, min(n, start + c)


def gather_to_rank0(
    piece: torch.Tensor, full_shape: torch.Size, *, rank: int, world_size: int, group
) -> torch.Tensor | None:
    """Concatenate every rank's dim-0 piece (CPU) on rank 0; other ranks get None. Collective."""
    if world_size == 1:
        return piece
    n = full_shape[0]
    rows = -(-n // world_size)
    padded = torch.zeros((rows, *full_shape[1:]), dtype=piece.dtype)
    if piece.shape[0]:
        padded[: piece.shape[0]].copy_(piece)
    # Byte views: gloo then moves bf16 (or any dtype) without caring what it is.
    send = padded.view(torch.uint8) if padded.numel() else padded
    if rank == 0:
        bufs = [torch.empty_like(send) for _ in range(world_size)]
        dist.gather(send, bufs, dst=0, group=group)
        return torch.cat([b.view(piece.dtype) for b in bufs])[:n]
    dist.gather(send, None, dst=0, group=group)
    return None


def scatter_rows(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of a full tensor (the inverse of ``gather_to_rank0``, used when loading)."""
    start, end = shard_rows(full.shape[0], rank, world_size)
    return full[start:end]


def iter_full_tensors(
    named: list[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None,
    *,
    rank: int,
    world_size: int,
    host_group,
    host_view: Callable[[torch.Tensor], torch.Tensor] | None,
    device_gather: bool,
    on_device: bool = False,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield ``(name, full tensor)`` on rank 0 and ``(name, None)`` elsewhere; every rank must iterate fully.

    ``host_view``: set while paused (read backups); ``device_gather``: use DTensor ``full_tensor()``
    on the live shards (NCCL), else gather host copies over ``host_group``.

    Tensors are on the host in ``dtype``, except with ``on_device`` (the consumer packs and casts on
    the device): live gathered tensors then stay on the device, and a single rank's host backup is
    yielded in its stored dtype (the consumer copies it to the device and casts there).
    """
    from tidal.weight_sync.stream import to_host

    for name, t in named:
        want = dtype or t.dtype
        if host_view is None and device_gather and world_size == 1:
            # One rank holds every row: its live shard is the full tensor. No DTensor dispatch and no
            # one-rank all-gather (the 0.5B preset's sync spent 0.07 s of host time there on an H100).
            full = local_shard(t).detach()
            yield name, (full if on_device else to_host(full, want))
            continue
        if host_view is None and device_gather and _is_dtensor(t):
            with torch.no_grad():
                full = t.detach().to(want).full_tensor()
            yield name, (None if rank != 0 else full if on_device else to_host(full))
            del full
            continue
        piece = local_shard(t).detach()
        # An empty shard (a tensor with fewer rows than ranks, e.g. a 1-output head's bias) has nothing
        # to back up, so the memory backend never paused it: read it as it is.
        if host_view is not None and piece.numel():
            piece = host_view(piece)
            if on_device and world_size == 1:
                yield name, piece
                continue
        piece = to_host(piece, want)
        full_shape = t.shape
        yield name, gather_to_rank0(piece, full_shape, rank=rank, world_size=world_size, group=host_group)
