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

The log-prob and entropy functions work on ``V``-wide logits in row chunks with hand-written
backward passes, so a full fp32 ``[B, T, V]`` softmax is never materialised (for a 150k vocabulary
that tensor is larger than the model's activations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean")
KL_KINDS = ("k1", "k2", "k3")

# Rows of [N, V] logits handled at once: 4096 rows of a 150k vocabulary in fp32 is 2.4 GB, so a
# smaller chunk keeps the transient at tens of MB on large vocabularies, while tiny vocabularies
# still run in one or two chunks.
_CHUNK_ELEMENTS = 1 << 24


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """fp32 for half-precision logits (softmax sums lose digits in bf16), else the input's own."""
    return torch.promote_types(logits.dtype, torch.float32)


def _rows_per_chunk(vocab: int, chunk_rows: int | None) -> int:
    if chunk_rows is not None:
        return max(1, chunk_rows)
    return max(1, _CHUNK_ELEMENTS // max(1, vocab))


def _scaled(x: Tensor, dt: torch.dtype, temperature: float) -> Tensor:
    """x in the compute dtype, divided by the temperature; a view (no copy) when neither applies."""
    x = x.to(dt)
    return x if temperature == 1.0 else x / temperature


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits / temperature).gather(targets), computed and differentiated in row chunks."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, rows: int) -> Tensor:
        n, dt = logits.shape[0], _compute_dtype(logits)
        out = torch.empty(n, dtype=dt, device=logits.device)
        lse = torch.empty(n, dtype=dt, device=logits.device)
        for s in range(0, n, rows):
            x = _scaled(logits[s : s + rows], dt, temperature)
            torch.logsumexp(x, dim=-1, out=lse[s : s + rows])
            out[s : s + rows] = x.gather(-1, targets[s : s + rows].unsqueeze(-1)).squeeze(-1) - lse[s : s + rows]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, targets, lse = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], rows):
            # d logp[target] / dx = (onehot(target) - softmax(x / t)) / t, built in place in one buffer.
            g = _scaled(logits[s : s + rows], lse.dtype, t).sub(lse[s : s + rows].unsqueeze(-1)).exp_().neg_()
            g.scatter_add_(-1, targets[s : s + rows].unsqueeze(-1), torch.ones_like(g[:, :1]))
            g.mul_((grad_out[s : s + rows].to(lse.dtype) / t).unsqueeze(-1))
            grad[s : s + rows] = g
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    """Entropy of softmax(logits) per row, computed and differentiated in row chunks."""

    @staticmethod
    def forward(ctx, logits: Tensor, rows: int) -> Tensor:
        n, dt = logits.shape[0], _compute_dtype(logits)
        out = torch.empty(n, dtype=dt, device=logits.device)
        lse = torch.empty(n, dtype=dt, device=logits.device)
        for s in range(0, n, rows):
            x = logits[s : s + rows].to(dt)
            torch.logsumexp(x, dim=-1, out=lse[s : s + rows])
            p = x.sub(lse[s : s + rows].unsqueeze(-1)).exp_()
            # H = lse - sum_i p_i x_i
            out[s : s + rows] = lse[s : s + rows] - p.mul_(x).sum(-1)
        ctx.save_for_backward(logits, lse, out)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, lse, ent = ctx.saved_tensors
        rows = ctx.rows
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], rows):
            logp = logits[s : s + rows].to(lse.dtype).sub(lse[s : s + rows].unsqueeze(-1))
            # dH/dx_j = -p_j (log p_j + H)
            g = logp.exp().mul_(logp.add_(ent[s : s + rows].unsqueeze(-1))).neg_()
            grad[s : s + rows] = g.mul_(grad_out[s : s + rows].to(lse.dtype).unsqueeze(-1))
        return grad, None


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, chunk_rows: int | None = None) -> Tensor:
    """Log-probs[B, T] (fp32, or fp64 for fp64 logits) of targets[B, T] under softmax(logits[B, T, V] / temperature).

    Equals ``log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None])[..., 0]``
    but only ever holds ``chunk_rows`` rows of fp32 softmax at once, forward and backward.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on [B, T]")
    lead = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).long()
    rows = _rows_per_chunk(logits.shape[-1], chunk_rows)
    return _TokenLogprobs.apply(flat_logits, flat_targets, float(temperature), rows).view(lead)


def entropy_from_logits(logits: Tensor, chunk_rows: int | None = None) -> Tensor:
    """Entropy[B, T] (fp32 or fp64 like ``token_logprobs``, nats) of softmax(logits[B, T, V]), chunked like ``token_logprobs``."""
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    return _Entropy.apply(flat, _rows_per_chunk(logits.shape[-1], chunk_rows)).view(lead)


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
