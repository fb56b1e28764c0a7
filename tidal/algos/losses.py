"""Pieces of the policy-gradient losses as pure tensor functions: masked means, KL estimators, aggregation.

Shapes: ``B`` sequences (rows of a micro-batch), ``T`` positions, ``V`` vocabulary. ``logprobs[b, t]``
is the log-probability of the token at position ``t`` of row ``b`` under the current policy;
``mask[b, t]`` is 1 for response tokens that are trained on and 0 for prompt and padding. Masked
positions contribute nothing to losses, metrics or gradients, even if they hold garbage (inf/nan):
inputs are zeroed there before any arithmetic, because ``inf * 0`` is nan in both directions.

Normalisation across micro-batches and ranks
--------------------------------------------
A "token-mean" loss must be the mean over the valid tokens of the whole *global* batch, not the mean
of per-micro-batch means (which over-weights short micro-batches). So the trainer's loss
(``tidal.algos.objectives.rl_loss``) accepts the normaliser from outside:

    norm = sum over the global batch of loss_normalizer(mask_mb, agg)     # all-reduced over ranks
    for each micro-batch:  loss, m = rl_loss(inputs_mb, cfg, normalizer=norm); loss.backward()

``loss_normalizer`` counts valid tokens ("token-mean") or sequences with at least one valid token
("seq-mean-token-mean"). When the data-parallel gradient reduction *averages* over ``world_size``
ranks (FSDP2's default), pass ``normalizer=norm / world_size`` so the averaged gradient equals the
gradient of ``sum / norm``. Without ``normalizer`` the loss is normalised within the given batch.

Log-probs and entropy
---------------------
``token_logprobs_and_entropy``, ``token_logprobs`` and ``entropy_from_logits`` live in
``tidal.algos.logprobs`` (a chunked kernel, compiled on CUDA: process state, not a pure function).
"""

from __future__ import annotations

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean")
KL_KINDS = ("k1", "k2", "k3")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over positions where mask is nonzero (all dims, or along ``dim``); 0 where none are."""
    m = mask.to(torch.bool)
    xs = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    mf = m.to(x.dtype if x.is_floating_point() else torch.float32)
    if dim is None:
        return xs.sum() / mf.sum().clamp(min=1)
    return xs.sum(dim) / mf.sum(dim).clamp(min=1)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate[B, T] of the policy from the reference, from sampled-token log-probs.

    k1 = logp - logp_ref (unbiased, can be negative); k2 = (logp - logp_ref)^2 / 2;
    k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1 (unbiased and non-negative).
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        # Clamped so one token far off the reference cannot overflow exp into inf.
        neg = (-log_ratio).clamp(min=-20.0, max=20.0)
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")


def loss_normalizer(mask: Tensor, agg: str = "token-mean") -> Tensor:
    """The count a summed loss is divided by: valid tokens (token-mean) or non-empty sequences."""
    m = mask.to(torch.bool)
    if agg == "token-mean":
        return m.sum().float()
    if agg == "seq-mean-token-mean":
        return m.any(dim=-1).sum().float()
    raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {AGG_MODES}")


def aggregate_sum(values: Tensor, mask: Tensor, agg: str = "token-mean") -> Tensor:
    """Sum of per-token values[B, T] under ``agg``; divide by ``loss_normalizer`` to get the mean.

    token-mean: sum of all valid tokens. seq-mean-token-mean: sum over sequences of each sequence's
    mean over its valid tokens (every sequence weighs the same, whatever its length).
    """
    m = mask.to(torch.bool)
    v = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if agg == "token-mean":
        return v.sum()
    if agg == "seq-mean-token-mean":
        return (v.sum(-1) / m.sum(-1).clamp(min=1).to(v.dtype)).sum()
    raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {AGG_MODES}")
