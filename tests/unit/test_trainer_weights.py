"""The trainer's weight source (``tidal.trainer.weights``) on a one-rank mesh: the live shards are the full
tensors, read without DTensor's gather and, for a consumer that packs on the device, without a copy."""

import torch
import torch.distributed as dist

from tidal.trainer.weights import iter_full_tensors
from tidal.weight_sync.bucket import entry_view, pack


def _one_rank_params():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(0)
    shapes = {"embed.weight": (7, 5), "layer.bias": (3,), "head.weight": (2, 5)}
    return [
        (n, torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g), mesh, [Shard(0)])))
        for n, s in shapes.items()
    ]


def test_one_live_rank_yields_its_shards_as_the_full_tensors():
    """With one rank and a live (device-gathered) source, every yielded tensor equals the DTensor's
    ``full_tensor()`` in the asked dtype; a consumer that packs on the device gets the local shard itself
    (same storage, its own dtype), and packing it casts to the same bytes as the gathered path."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        named = _one_rank_params()
        kw = dict(rank=0, world_size=1, host_group=None, host_view=None, device_gather=True)
        host = list(iter_full_tensors(named, torch.bfloat16, **kw))
        assert [n for n, _ in host] == [n for n, _ in named]
        for (_, t), (_, p) in zip(host, named):
            assert t.dtype == torch.bfloat16 and type(t) is torch.Tensor
            assert torch.equal(t, p.full_tensor().to(torch.bfloat16))
        raw = list(iter_full_tensors(named, torch.bfloat16, on_device=True, **kw))
        for (_, t), (_, p) in zip(raw, named):
            assert t.data_ptr() == p.to_local().data_ptr() and t.dtype == torch.float32
        packed, entries = pack(raw, "cpu", torch.bfloat16)
        gathered, _ = pack(host, "cpu", torch.bfloat16)
        assert torch.equal(packed, gathered)
        assert torch.equal(entry_view(packed, entries[0]), named[0][1].full_tensor().to(torch.bfloat16))
    finally:
        if own:
            dist.destroy_process_group()
