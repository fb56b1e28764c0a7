"""Log-probs and entropy of vocabulary-sharded logits, without gathering the vocabulary on one rank.

Under tensor parallelism the output layer is column-parallel: TP rank ``r`` holds the logits of
vocabulary ids ``[start_r, start_r + V/tp)``. The log-softmax and the entropy need only three sums
over the whole vocabulary, so each rank reduces its own columns and the ranks all-reduce a few
numbers per token instead of the ``[tokens, V]`` logits:

    m      = max_j z_j                                  (all-reduce MAX; a constant shift, no gradient)
    S      = sum_j exp(z_j - m)                         (all-reduce SUM)
    z_t    = the target's logit (0 on ranks that do not hold it)   (all-reduce SUM)
    W      = sum_j exp(z_j - m) z_j                     (all-reduce SUM)

    log p_t = z_t - m - log S                           (log-softmax of the target)
    H       = m + log S - W / S                         (entropy: log Z - E_p[z])

Columns at or past ``vocab_size`` (the zero rows that pad the vocabulary to a multiple of the TP
size) are masked out of every sum. The functions are pure: ``shard_max`` / ``shard_sums`` work on one
shard, ``finish`` on the reduced sums, so a CPU test runs every shard of a simulated TP group in one
process and compares with the full-vocabulary log-softmax. ``vocab_parallel_stats`` composes them
with all-reduces over a real TP group. As in Megatron's own TP regions, the loss is replicated on
the TP ranks and each rank back-propagates its copy, so the sum's backward is the identity
(``_ReduceSum``): every rank's shard gets exactly its part of the gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _masked(logits: Tensor, vocab_start: int, vocab_size: int | None) -> tuple[Tensor, Tensor | None]:
    z = logits if logits.dtype == torch.float64 else logits.float()  # at least fp32
    if vocab_size is None or vocab_start + z.shape[-1] <= vocab_size:
        return z, None
    pad = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device) >= vocab_size
    return z.masked_fill(pad, float("-inf")), pad


def shard_max(logits: Tensor, vocab_start: int = 0, vocab_size: int | None = None) -> Tensor:
    """Per-token max over this shard's real columns, [..] (no gradient)."""
    z, _ = _masked(logits.detach(), vocab_start, vocab_size)
    return z.amax(dim=-1)


def shard_sums(
    logits: Tensor, targets: Tensor, m: Tensor, vocab_start: int = 0, vocab_size: int | None = None
) -> Tensor:
    """``[S, z_t, W]`` of this shard, stacked on the last dim: [.., 3]. ``targets`` are global ids,
    ``m`` the global max from ``shard_max`` reduced over the shards."""
    z, pad = _masked(logits, vocab_start, vocab_size)
    e = torch.exp(z - m.unsqueeze(-1))
    s = e.sum(dim=-1)
    zz = z if pad is None else z.masked_fill(pad, 0.0)  # -inf * 0 would be nan
    w = (e * zz).sum(dim=-1)
    local = targets - vocab_start
    mine = (local >= 0) & (local < z.shape[-1])
    zt = torch.gather(zz, -1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    zt = torch.where(mine, zt, torch.zeros_like(zt))
    return torch.stack([s, zt, w], dim=-1)


def finish(sums: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    """``(log p_t, entropy)`` from the reduced ``[S, z_t, W]`` and the global max ``m``."""
    s, zt, w = sums.unbind(-1)
    log_z = m + torch.log(s)
    return zt - log_z, log_z - w / s


class _ReduceSum(torch.autograd.Function):
    """All-reduce SUM in forward, identity in backward (the loss downstream is replicated on every TP rank)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def vocab_parallel_stats(
    logits: Tensor, targets: Tensor, *, vocab_start: int, vocab_size: int, group
) -> tuple[Tensor, Tensor]:
    """``(log-probs, entropy)`` [..] of ``targets`` under vocabulary-sharded ``logits`` [.., V/tp] over
    the TP process group ``group``; the gradient flows to this rank's shard."""
    import torch.distributed as dist

    m = shard_max(logits, vocab_start, vocab_size)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sums = _ReduceSum.apply(shard_sums(logits, targets, m, vocab_start, vocab_size), group)
    return finish(sums, m)


def chunked_vocab_parallel_stats(
    logits: Tensor, targets: Tensor, *, vocab_start: int, vocab_size: int, group, rows: int = 2048
) -> tuple[Tensor, Tensor]:
    """``vocab_parallel_stats`` over [B, T, V/tp] in chunks of ``rows`` tokens, each recomputed in backward
    (``torch.utils.checkpoint``), so the fp32 work stays one chunk's size. The collectives of a
    chunk run again in its backward on every rank alike."""
    from torch.utils.checkpoint import checkpoint

    flat, tgt = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    lps, ents = [], []
    for i in range(0, flat.shape[0], rows):

        def run(x, t):
            return vocab_parallel_stats(x, t, vocab_start=vocab_start, vocab_size=vocab_size, group=group)

        if flat.requires_grad:
            lp, ent = checkpoint(run, flat[i : i + rows], tgt[i : i + rows], use_reentrant=False)
        else:
            lp, ent = run(flat[i : i + rows], tgt[i : i + rows])
        lps.append(lp)
        ents.append(ent)
    shape = targets.shape
    return torch.cat(lps).reshape(shape), torch.cat(ents).reshape(shape)
