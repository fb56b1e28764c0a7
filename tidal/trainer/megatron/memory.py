"""The seed's memory policy inside Megatron-core, without patching it: gradient buffers in their own region.

slime's seed PR adds ``disable_grad_buffers_cpu_backup`` to Megatron's ``_ParamAndGradBuffer``: the
gradient buffers are allocated inside a torch_memory_saver region *without* a host backup, because
they are zeroed at the start of every step anyway, so a paused trainer keeps only parameters and
optimizer state on the host. tidal gets the same result from outside Megatron:

1. the model and its ``DistributedDataParallel`` wrapper are built inside the WEIGHTS region (so
   parameters, and with the distributed optimizer the parameter buffers, are backed up);
2. ``rehome_grad_buffers`` then gives every gradient buffer's storage a new memory block allocated
   inside the GRADS region (no backup under ``--offload-train``) and frees the old block. The
   storage object is the same, so every view Megatron made of it (``param.main_grad``, the buckets'
   ``grad_data``) now points at the new block; nothing in Megatron is replaced or subclassed.

NCCL user buffers (``--use-nccl-ub``) must come from NCCL's own memory pool, so they cannot live in a
paused region; the config rule refuses the pair (``tidal.config.memory_rules.grad_buffers``).
"""

from __future__ import annotations

import contextlib

import torch


def grad_buffers(ddp) -> list[torch.Tensor]:
    """The flat gradient buffers of a Megatron ``DistributedDataParallel`` (dense and expert-parallel)."""
    bufs = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    return [b.grad_data for b in bufs]


def rehome_grad_buffers(ddp, region: contextlib.AbstractContextManager) -> int:
    """Move every gradient buffer's memory into ``region`` in place (views stay valid); returns the bytes moved."""
    moved = 0
    for grad in grad_buffers(ddp):
        storage = grad.untyped_storage()
        nbytes = storage.nbytes()
        with region:
            fresh = torch.UntypedStorage(nbytes, device=grad.device)
        storage._swap_data_ptr_(fresh)  # ``storage`` now owns the region's block; ``fresh`` the old one
        del fresh  # frees the old block
        grad.zero_()
        moved += nbytes
    return moved


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Device tensors of a Megatron optimizer's inner optimizers' state (AdamW moments; ``step`` is a host scalar)."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            out += [v for k, v in state.items() if k != "step" and torch.is_tensor(v) and v.device.type != "cpu"]
    return out
