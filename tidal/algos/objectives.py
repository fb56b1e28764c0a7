"""The policy objectives the estimators train with, the value loss and DAPO's overlong penalty.

``rl_loss`` is the trainer's loss for every estimator: a per-token policy term chosen by
``cfg.advantage_estimator``, times the behaviour-policy correction's weights (``tidal.algos.correction``),
plus the KL penalty and the entropy bonus, aggregated by ``--loss-agg-mode`` with an external
normaliser across micro-batches and ranks (``tidal.algos.losses``' docstring says how to choose it).
``policy_loss`` is the PPO-clip term alone, normalised within its batch.

Policy terms, per token ``t`` of sequence ``i`` with ``r_t = exp(logp_t - old_t)``:

- PPO-clip (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_plus_plus*``, ``ppo``): ``max(-A r_t,
  -A clip(r_t, 1 - eps_clip, 1 + eps_clip_high))`` (Schulman et al. 2017, Eq. 7). A separate
  ``--eps-clip-high`` is DAPO's decoupled clip ("clip-higher", Yu et al. 2025, Eq. 10).
- GSPO (``gspo``): the same clip on the sequence ratio ``s_i = exp(mean_t (logp_t - old_t))``
  shared by every token of the sequence (Zheng et al. 2025, arXiv 2507.18071, Eq. 5-7). GSPO's
  ranges are small (the paper uses 3e-4 / 4e-4).
- CISPO (``cispo``): ``-sg(clip(r_t, 1 - eps_clip, 1 + eps_clip_high)) * A * logp_t``: the ratio is
  clipped under stop-gradient, so clipped tokens still pass a gradient through ``logp_t``
  (MiniMax-M1, arXiv 2506.13585, Eq. 4-5). The paper has no lower bound: ``--eps-clip 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tidal.algos.losses import aggregate_sum, kl_penalty, loss_normalizer, masked_mean

POLICY_KINDS = ("ppo-clip", "gspo", "cispo")


def policy_kind(estimator: str) -> str:
    """Which policy term an ``--advantage-estimator`` trains with."""
    return estimator if estimator in ("gspo", "cispo") else "ppo-clip"


def _clean(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def policy_terms(
    kind: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss[B, T], clipped[B, T] bool, ratio[B, T]) of one policy term (see the module docstring); all masked.

    ``advantages`` is [B] (one per sequence) or [B, T]. ``ratio`` is the one the clip acts on: the
    token ratio, or for GSPO the sequence ratio broadcast over its tokens.
    """
    m = mask.to(torch.bool)
    logp = _clean(logprobs.float(), m)
    old = _clean(old_logprobs.float(), m)
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = _clean(adv.expand_as(logp), m)
    if kind == "gspo":
        seq = ((logp - old).sum(-1) / m.sum(-1).clamp(min=1)).unsqueeze(-1)
        ratio = _clean(torch.exp(seq).expand_as(logp), m)
    elif kind in ("ppo-clip", "cispo"):
        ratio = _clean(torch.exp(logp - old), m)
    else:
        raise ValueError(f"unknown policy term {kind!r}; expected one of {POLICY_KINDS}")
    bounded = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    if kind == "cispo":
        loss = -bounded.detach() * adv * logp
        return _clean(loss, m), (bounded != ratio) & m, ratio
    unclipped, clipped = -adv * ratio, -adv * bounded
    return torch.maximum(unclipped, clipped), (clipped > unclipped) & m, ratio


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
    m = mask.to(torch.bool)
    high = eps_clip if eps_clip_high is None else eps_clip_high
    loss_tok, was_clipped, ratio = policy_terms("ppo-clip", logprobs, old_logprobs, advantages, m, eps_clip, high)
    loss = aggregate_sum(loss_tok, m, agg) / loss_normalizer(m, agg).clamp(min=1)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean(was_clipped.float(), m),
            "approx_kl": masked_mean(_clean(old_logprobs.float(), m) - _clean(logprobs.float(), m), m),
            "ratio_mean": masked_mean(ratio, m),
        }
    return loss, metrics


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, value_clip: float | None) -> Tensor:
    """Per-token clipped value loss[B, T] (PPO2 as in OpenAI baselines; slime's ``--value-clip``).

    ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)``: the value may move at most
    ``eps`` from the one the advantages were computed with before the loss stops pulling it.
    ``value_clip=None`` is the plain ``0.5 * (V - R)^2``. Masked positions are 0.
    """
    m = mask.to(torch.bool)
    v, old, ret = _clean(values.float(), m), _clean(old_values.float(), m), _clean(returns.float(), m)
    loss = (v - ret).square()
    if value_clip is not None:
        clipped = old + (v - old).clamp(-value_clip, value_clip)
        loss = torch.maximum(loss, (clipped - ret).square())
    return _clean(0.5 * loss, m)


def overlong_penalty(response_lens: Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment[B] (Yu et al. 2025, arXiv 2503.14476, Eq. 13), times ``factor``.

    0 up to ``max_len - buffer_len`` tokens, then falling linearly to -1 at ``max_len``
    (``((max_len - buffer_len) - |y|) / buffer_len``), -1 beyond. Added to the reward.
    """
    n = response_lens.float()
    free = max_len - buffer_len
    pen = torch.where(n <= free, torch.zeros_like(n), (free - n) / max(buffer_len, 1))
    return factor * pen.clamp(min=-1.0)


@dataclass
class RLInputs:
    """One micro-batch for ``rl_loss``. All [B, T] tensors share the same positions.

    logprobs:      [B, T] float, current policy, requires grad (from ``token_logprobs``)
    old_logprobs:  [B, T] float, policy that generated the samples (no grad)
    advantages:    [B] or [B, T] float
    mask:          [B, T] bool/0-1, response tokens to train on
    ref_logprobs:  [B, T] float or None, frozen reference policy (needed when use_kl_loss)
    entropy:       [B, T] float or None, from ``entropy_from_logits`` (with grad for a bonus)
    weights: [B, T] or None, the correction's per-token loss weights (detached)
    keep:    [B, T] bool or None, False where the correction drops a token
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    ref_logprobs: Tensor | None = None
    entropy: Tensor | None = None
    weights: Tensor | None = None
    keep: Tensor | None = None


def rl_loss(inputs: RLInputs, cfg: Any, normalizer: Tensor | float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy term x correction weights + kl_loss_coef * KL - entropy_coef * entropy, aggregated by ``loss_agg_mode``.

    ``cfg`` is an ``AlgorithmConfig``. Tokens the correction drops (``keep`` False) leave the loss
    but still count in the normaliser, so dropping a token never up-weights the others. Metrics
    are detached means over this batch's valid tokens (``pg_loss``, ``clipfrac``, ``approx_kl``,
    ``ratio_mean``, ``kl``, ``entropy``), plus ``num_tokens``, ``num_seqs``, ``loss_sum`` and
    ``normalizer`` for weighted reduction across micro-batches and ranks.
    """
    agg = cfg.loss_agg_mode
    m = inputs.mask.to(torch.bool)
    trained = m if inputs.keep is None else m & inputs.keep.to(torch.bool)
    high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    kind = policy_kind(cfg.advantage_estimator)
    loss_tok, was_clipped, ratio = policy_terms(
        kind, inputs.logprobs, inputs.old_logprobs, inputs.advantages, trained, cfg.eps_clip, high
    )
    total = loss_tok if inputs.weights is None else loss_tok * _clean(inputs.weights.float().detach(), trained)
    kl = None
    if inputs.ref_logprobs is not None:
        kl = kl_penalty(_clean(inputs.logprobs.float(), m), _clean(inputs.ref_logprobs.float(), m), cfg.kl_loss_type)
        if cfg.use_kl_loss and cfg.kl_loss_coef != 0.0:
            total = total + cfg.kl_loss_coef * _clean(kl, trained)
    elif cfg.use_kl_loss and cfg.kl_loss_coef != 0.0:
        raise ValueError("use_kl_loss is set but RLInputs.ref_logprobs is None")
    if inputs.entropy is not None and cfg.entropy_coef != 0.0:
        total = total - cfg.entropy_coef * _clean(inputs.entropy.float(), trained)

    loss_sum = aggregate_sum(total, m, agg)
    norm = loss_normalizer(m, agg).clamp(min=1) if normalizer is None else normalizer
    loss = loss_sum / norm
    with torch.no_grad():
        metrics = {
            "pg_loss": masked_mean(loss_tok, trained),
            "clipfrac": masked_mean(was_clipped.float(), trained),
            "approx_kl": masked_mean(_clean(inputs.old_logprobs.float(), m) - _clean(inputs.logprobs.float(), m), m),
            "ratio_mean": masked_mean(ratio, trained),
            "num_tokens": m.sum().float(),
            "num_seqs": m.any(dim=-1).sum().float(),
            "loss_sum": loss_sum.detach(),
            # From a float by a fill on the device: a tensor built from host data is a blocking copy.
            "normalizer": norm.detach().float()
            if torch.is_tensor(norm)
            else loss_sum.new_full((), float(norm), dtype=torch.float32),
        }
        if kl is not None:
            metrics["kl"] = masked_mean(kl, m)
        if inputs.entropy is not None:
            metrics["entropy"] = masked_mean(inputs.entropy.float(), m)
    return loss, metrics


__all__ = [
    "POLICY_KINDS",
    "RLInputs",
    "overlong_penalty",
    "policy_kind",
    "policy_loss",
    "policy_terms",
    "rl_loss",
    "value_loss",
]
