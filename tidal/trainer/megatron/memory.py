"""The seed's memory policy inside Megatron-core, without patching it: gradient buffers in their own region.

slime's seed PR adds ``disable_grad_buffers_cpu_backup`` to Megatron's ``_ParamAndGradBuffer``: the
gradient buffers are allocated inside a torch_memory_saver region *without* a host backup, because
they are zeroed at the start of every step anyway, so a paused trainer keeps only parameters and
optimizer state on the host. tidal gets the same result from outside Megatron:

1. the model is built inside the WEIGHTS region (parameters backed up);
2. Megatron's ``DistributedDataParallel`` is built inside the GRADS region, so the gradient
   buffers it allocates there are paused without a backup under ``--offload-train``;
3. with the distributed optimizer DDP also allocates parameter buffers (and re-points every
   parameter into them); ``tidal.memory.home.rehome`` gives those storages a new memory block
   allocated inside the WEIGHTS region, re-points every tensor on them (the buffer, the buckets'
   views, the parameters: ``param_buffer_holders``; each storage's use count checks that none was
   missed) and frees the old one. Nothing in Megatron is replaced or subclassed;
4. the optimizer steps outside any region and its state (created by the first step) is moved into
   OPTIMIZER afterwards (``tidal.memory.home.Adopter``), so the step's temporaries are not backed up.
   (The other way round, building DDP in WEIGHTS and moving the grads out, would leave the freed
   gradient block cached in the WEIGHTS pool, where torch_memory_saver would back it up.)

NCCL user buffers (``--use-nccl-ub``) must come from NCCL's own memory pool, so they cannot live in a
paused region; the config rule refuses the pair (``tidal.config.memory_rules.grad_buffers``).
"""

from __future__ import annotations

import torch


def grad_buffers(ddp) -> list[torch.Tensor]:
    """The flat gradient buffers of a Megatron ``DistributedDataParallel`` (dense and expert-parallel)."""
    bufs = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    return [b.grad_data for b in bufs]


def param_buffer_holders(ddp) -> list[torch.Tensor]:
    """Every tensor on DDP's flat parameter buffers right after DDP is built (the buffers, the buckets' views,
    the parameters re-pointed into them, views its bucket groups cached), for ``tidal.memory.home.rehome``,
    which re-points them all onto the new block and refuses if the storages have users not listed here."""
    bufs = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    groups = list(getattr(ddp, "bucket_groups", [])) + list(getattr(ddp, "expert_parallel_bucket_groups", []))
    out = []
    for b in bufs:
        if getattr(b, "param_data", None) is None:
            continue
        shared = getattr(b, "shared_buffer", None)
        out += [b.param_data] + ([shared] if torch.is_tensor(shared) else [])
        out += [k.param_data for k in getattr(b, "buckets", []) if getattr(k, "param_data", None) is not None]
        out += list(b.params)
    for g in groups:
        for views in getattr(g, "cached_param_buffer_shard_list", []):
            out += list(views or [])
    return out


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Device tensors of a Megatron optimizer's inner optimizers' state (AdamW moments; ``step`` is a host scalar)."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            out += [v for k, v in state.items() if k != "step" and torch.is_tensor(v)]
    return out
