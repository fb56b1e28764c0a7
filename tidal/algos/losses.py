"""Policy-gradient losses as pure tensor functions: PPO-clip, KL estimators, entropy, log-probs.

Shapes: ``B`` sequences (rows of a micro-batch), ``T`` positions, ``V`` vocabulary. ``logprobs[b, t]``
is the log-probability of the token at position ``t`` of row ``b`` under the current policy;
``mask[b, t]`` is 1 for response tokens that are trained on and 0 for prompt and padding. Masked
positions contribute nothing to losses, metrics or gradients, even if they hold garbage (inf/nan):
inputs are zeroed there before any arithmetic, because ``inf * 0`` is nan in both directions.

Normalisation across micro-batches and ranks
--------------------------------------------
A "token-mean" loss must be the mean over the valid tokens of the whole *global* batch, not the mean
of per-micro-batch means (which over-weights short micro-batches). So ``grpo_loss`` accepts the
normaliser from outside:

    norm = sum over the global batch of loss_normalizer(mask_mb, agg)     # all-reduced over ranks
    for each micro-batch:  loss, m = grpo_loss(inputs_mb, cfg, normalizer=norm); loss.backward()

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

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean")
KL_KINDS = ("k1", "k2", "k3")


# Transient memory budget of one row chunk. The fused forward holds two [rows, V] buffers in the
# compute dtype (shifted logits and their exponentials), so rows = budget / (2 * V * itemsize). On
# CUDA a large chunk keeps the launches per micro-batch few (at a 152k vocabulary 441 rows of fp32:
# 19 chunks for 8192 tokens, each chunk's kernels far longer than their launch); on the host a small
# chunk (2**24 fp32 elements per buffer) keeps the transient at tens of MB.
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


def _clean(x: Tensor, m: Tensor) -> Tensor:
    """x with masked positions set to 0, so inf/nan there cannot reach the loss or its gradient."""
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _policy_terms(logprobs, old_logprobs, advantages, mask, eps_clip, eps_clip_high):
    """Per-token PPO-clip loss[B, T], clipped[B, T] (bool), ratio[B, T], log(old/new)[B, T]; all masked."""
    m = mask.to(torch.bool)
    logp = _clean(logprobs.float(), m)
    old = _clean(old_logprobs.float(), m)
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # one advantage per sequence, broadcast over its tokens
    adv = _clean(adv.expand_as(logp), m)
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(logp - old)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    # The pessimistic (larger) loss of the two; "clipped" marks tokens whose gradient the clip removed.
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped) & m
    return loss, was_clipped, ratio, old - logp, m


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    agg: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip loss (scalar, normalised within this batch) and metrics (detached scalars).

    logprobs, old_logprobs, mask: [B, T]; advantages: [B] (per sequence) or [B, T].
    Per token: ``max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_high))`` with
    ``r = exp(logp - old_logp)``, aggregated by ``agg``. Metrics: ``clipfrac`` (fraction of valid
    tokens where the clip was active), ``approx_kl`` (mean of old_logp - logp), ``ratio_mean``.
    """
    loss_tok, was_clipped, ratio, log_old_over_new, m = _policy_terms(
        logprobs, old_logprobs, advantages, mask, eps_clip, eps_clip_high
    )
    loss = aggregate_sum(loss_tok, m, agg) / loss_normalizer(m, agg).clamp(min=1)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean(was_clipped.float(), m),
            "approx_kl": masked_mean(log_old_over_new, m),
            "ratio_mean": masked_mean(ratio, m),
        }
    return loss, metrics


@dataclass
class LossInputs:
    """One micro-batch for ``grpo_loss``. All [B, T] tensors share the same positions.

    logprobs:      [B, T] float, current policy, requires grad (from ``token_logprobs``)
    old_logprobs:  [B, T] float, policy that generated the samples (no grad)
    advantages:    [B] or [B, T] float
    mask:          [B, T] bool/0-1, response tokens to train on
    ref_logprobs:  [B, T] float or None, frozen reference policy (needed when use_kl_loss)
    entropy:       [B, T] float or None, from ``entropy_from_logits`` (with grad for a bonus)
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    ref_logprobs: Tensor | None = None
    entropy: Tensor | None = None


def grpo_loss(
    inputs: LossInputs, cfg: Any, normalizer: Tensor | float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """The trainer's loss: PPO-clip + kl_loss_coef * KL - entropy_coef * entropy, aggregated.

    ``cfg`` is an ``AlgorithmConfig`` (or anything with its fields: eps_clip, eps_clip_high,
    use_kl_loss, kl_loss_coef, kl_loss_type, entropy_coef, loss_agg_mode). Returns
    ``(sum / normalizer, metrics)``; see the module docstring for choosing ``normalizer`` across
    micro-batches and ranks. Metrics are detached scalars averaged over this batch's valid tokens,
    plus ``num_tokens``, ``num_seqs``, ``loss_sum`` and ``normalizer`` for weighted reduction.
    """
    agg = cfg.loss_agg_mode
    loss_tok, was_clipped, ratio, log_old_over_new, m = _policy_terms(
        inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask, cfg.eps_clip, cfg.eps_clip_high
    )
    total = loss_tok
    kl = None
    if inputs.ref_logprobs is not None:
        kl = kl_penalty(_clean(inputs.logprobs.float(), m), _clean(inputs.ref_logprobs.float(), m), cfg.kl_loss_type)
        if cfg.use_kl_loss and cfg.kl_loss_coef != 0.0:
            total = total + cfg.kl_loss_coef * kl
    elif cfg.use_kl_loss and cfg.kl_loss_coef != 0.0:
        raise ValueError("use_kl_loss is set but LossInputs.ref_logprobs is None")
    if inputs.entropy is not None and cfg.entropy_coef != 0.0:
        total = total - cfg.entropy_coef * _clean(inputs.entropy.float(), m)

    loss_sum = aggregate_sum(total, m, agg)
    norm = loss_normalizer(m, agg).clamp(min=1) if normalizer is None else normalizer
    loss = loss_sum / norm

    with torch.no_grad():
        metrics = {
            "pg_loss": masked_mean(loss_tok, m),
            "clipfrac": masked_mean(was_clipped.float(), m),
            "approx_kl": masked_mean(log_old_over_new, m),
            "ratio_mean": masked_mean(ratio, m),
            "num_tokens": m.sum().float(),
            "num_seqs": m.any(dim=-1).sum().float(),
            "loss_sum": loss_sum.detach(),
            "normalizer": torch.as_tensor(norm, dtype=torch.float32, device=loss_sum.device).detach(),
        }
        if kl is not None:
            metrics["kl"] = masked_mean(kl, m)
        if inputs.entropy is not None:
            metrics["entropy"] = masked_mean(inputs.entropy.float(), m)
    return loss, metrics
