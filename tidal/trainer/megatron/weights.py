"""The Megatron backend's weight source: full tensors by Hugging Face name out of TP shards and PP stages.

Every rank walks the same global list of entries (stage by stage, ``mapping.entries``). For each
entry the ranks that hold it (its stage's TP ranks of data-parallel replica 0) send their shard to
global rank 0 over the host (gloo) group, which rebuilds the HF tensors with ``mapping.to_hf``
(un-fusing QKV and the gated MLP, dropping vocabulary padding). The others yield ``(name, None)``.
Pieces cross gloo as raw bytes, so any dtype travels unchanged; the host group also works while
the trainer is paused (``read`` then returns the memory backend's zero-copy host views).

With one rank nothing travels: each HF tensor is a view of the live parameter (or of its host
backup), cast to the requested dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tidal.trainer.megatron.mapping import Arch, Entry, entries, to_hf


@dataclass(frozen=True)
class Topology:
    """This rank's place in Megatron's default order (tp fastest, then cp, dp, pp)."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def coords(self, rank: int | None = None) -> tuple[int, int, int, int]:
        """(tp_rank, cp_rank, dp_rank, pp_rank) of ``rank`` (default: this one)."""
        r = self.rank if rank is None else rank
        return (
            r % self.tp,
            (r // self.tp) % self.cp,
            (r // (self.tp * self.cp)) % self.dp,
            r // (self.tp * self.cp * self.dp),
        )

    def global_rank(self, *, tp_rank: int, pp_rank: int, cp_rank: int = 0, dp_rank: int = 0) -> int:
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def iter_hf_weights(
    local: dict[str, torch.Tensor],
    arch: Arch,
    topo: Topology,
    *,
    shapes: dict[tuple[int, str], tuple[tuple[int, ...], torch.dtype]],
    dtype: torch.dtype | None,
    read: Callable[[torch.Tensor], torch.Tensor],
    host: Callable[[torch.Tensor, torch.dtype | None], torch.Tensor],
    group=None,
    te: bool = False,
    on_device: bool = False,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(HF name, full tensor)`` on global rank 0, ``(name, None)`` elsewhere; every rank iterates fully.

    ``local``: this rank's parameters by Megatron name; ``shapes[(pp_rank, megatron name)]``: the
    (shape, dtype) of every stage's shard (the same on its TP ranks, gathered once at init);
    ``read(param)``: the tensor to read (live, or the host view of its backup); ``host(t, dtype)``:
    a host copy in ``dtype``. With ``on_device`` (one rank only) live tensors stay where they are.
    """
    tp_rank, cp_rank, dp_rank, pp_rank = topo.coords()
    for stage in range(topo.pp):
        for e in entries(arch, pp_rank=stage, pp_size=topo.pp, te=te):
            if topo.world == 1:
                yield from _single(e, read(local[e.megatron]), arch, dtype, host, on_device)
                continue
            shards = _collect(e, stage, local, topo, shapes, read, host, group, (tp_rank, cp_rank, dp_rank, pp_rank))
            if shards is None:
                for name in e.hf:
                    yield name, None
                continue
            for name, full in to_hf(e, shards, arch):
                yield name, full.to(dtype or full.dtype).contiguous()


def _single(e: Entry, t: torch.Tensor, arch: Arch, dtype, host, on_device: bool):
    for name, full in to_hf(e, [t.detach()], arch):
        want = dtype or full.dtype
        if on_device:
            if full.device.type == "cpu":
                yield name, full.contiguous()  # a host backup in its own dtype: the consumer casts on the device
            else:
                yield name, full.to(want).contiguous()
        else:
            yield name, host(full.contiguous(), want)


def _collect(e: Entry, stage: int, local, topo: Topology, shapes, read, host, group, coords):
    """Rank 0: every TP shard of ``e`` (stage ``stage``, replica 0) in TP order; owners send theirs; others None."""
    tp_rank, cp_rank, dp_rank, pp_rank = coords
    owner = pp_rank == stage and cp_rank == 0 and dp_rank == 0
    if owner and topo.rank != 0:
        piece = host(read(local[e.megatron]).detach(), None)
        dist.send(_bytes(piece), dst=0, group=group)
        return None
    if topo.rank != 0:
        return None
    shape, dt = shapes[(stage, e.megatron)]
    out = []
    for r in range(topo.tp):
        src = topo.global_rank(tp_rank=r, pp_rank=stage)
        if src == 0:
            out.append(host(read(local[e.megatron]).detach(), None))
            continue
        buf = torch.empty(shape, dtype=dt)
        dist.recv(_bytes(buf) if buf.numel() else buf, src=src, group=group)
        out.append(buf)
    return out


def shard_shapes(
    local: dict[str, torch.Tensor], topo: Topology, group=None
) -> dict[tuple[int, str], tuple[tuple[int, ...], torch.dtype]]:
    """``(pp_rank, megatron name) -> (shape, dtype)`` of every stage's shards, on every rank (collective)."""
    pp_rank = topo.coords()[3]
    mine = {(pp_rank, n): (tuple(t.shape), t.dtype) for n, t in local.items()}
    if topo.world == 1:
        return mine
    every: list = [None] * topo.world
    dist.all_gather_object(every, mine, group=group)
    out: dict = {}
    for d in every:
        out.update(d)
    return out
