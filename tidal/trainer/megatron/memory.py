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
   allocated inside the WEIGHTS region and frees the old one. The storage object stays, so every view
   Megatron made of it (``param.data``, the buckets' views) follows; nothing in Megatron is replaced
   or subclassed;
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


def param_buffers(ddp) -> list[torch.Tensor]:
    """DDP's flat parameter buffers (only with the distributed optimizer; else empty)."""
    bufs = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    return [b.param_data for b in bufs if getattr(b, "param_data", None) is not None]


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
