"""Behaviour-policy correction: the engine samples from a policy that is not exactly the trainer's.

The engine's compiled decode, its sampling settings and (with async training) staleness make the
distribution that generated a response, ``pi_engine``, differ from the trainer's ``pi_old`` that
the PPO ratio is taken against. The per-token importance ratio

    rho_t = pi_old(y_t) / pi_engine(y_t) = exp(old_logprobs - engine_logprobs)

re-weights each token's loss so the gradient is an expectation under ``pi_old`` again. Its
variance is bounded by one of four built-in corrections (``--tis-mode`` x ``--tis-level``):

================  =================================================================================
truncate, token   TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
                  RL training"): weight ``clip(rho_t, low, C)`` on each token's loss
mask, token       IcePop (Ling team 2025): tokens with ``rho_t`` outside ``[low, C]`` get no gradient
truncate, seq.    the sequence's geometric-mean ratio ``rho_seq = exp(mean_t log rho_t)`` clipped to
                  ``[low, C]`` weighs every token of the response (GSPO-style length normalisation)
mask, sequence    a response whose ``rho_seq`` is outside ``[low, C]`` is dropped whole (TRL's
                  ``sequence_mask``)
================  =================================================================================

The weights carry no gradient (they correct the sampling distribution, not the objective).
``apply_correction`` is the one entry point: a ``--custom-tis-function-path`` function has the same
signature and returns the same ``Correction``.

Mismatch metrics (``mismatch_metrics``) are reported every step whether or not a correction is on:
the k3 estimate of KL(pi_engine || pi_old) over the engine's samples (Schulman 2020,
"Approximating KL divergence"), and the ratio's mean, min and max.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tidal.algos.losses import kl_penalty

TIS_MODES = ("truncate", "mask")
TIS_LEVELS = ("token", "sequence")
# exp() of a log-ratio beyond this overflows nothing but says nothing either; clamped for the weights.
_MAX_LOG_RATIO = 20.0


@dataclass
class Correction:
    """What a correction does to one micro-batch; every tensor is [B, T], detached.

    weights:   multiplies each token's policy loss (1 where nothing is corrected)
    keep:      bool, False where a token's gradient is dropped (masked) on top of the loss mask
    truncated: bool, True where the weight was clipped (for the fraction metric)
    """

    weights: Tensor
    keep: Tensor
    truncated: Tensor


@dataclass
class CorrectionInputs:
    """old_logprobs, engine_logprobs, mask: [B, T] (mask: response tokens that have an engine log-prob)."""

    old_logprobs: Tensor
    engine_logprobs: Tensor
    mask: Tensor


def log_ratio(inputs: CorrectionInputs) -> Tensor:
    """``log rho[B, T] = old - engine`` at valid positions, 0 elsewhere (so garbage there cannot leak)."""
    m = inputs.mask.to(torch.bool)
    lr = inputs.old_logprobs.detach().float() - inputs.engine_logprobs.detach().float()
    return torch.where(m, lr, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def sequence_log_ratio(lr: Tensor, mask: Tensor) -> Tensor:
    """Log of the geometric-mean ratio per sequence, [B]: the mean of ``log rho_t`` over its valid tokens."""
    m = mask.to(torch.bool)
    return torch.where(m, lr, 0.0).sum(-1) / m.sum(-1).clamp(min=1)


def token_tis(lr: Tensor, mask: Tensor, clip: float, clip_low: float = 0.0) -> Correction:
    """Truncated IS per token: ``w_t = clip(rho_t, clip_low, clip)`` (TIS; slime's ``--use-tis``)."""
    m = mask.to(torch.bool)
    rho = lr.exp()
    w = rho.clamp(min=clip_low, max=clip)
    return Correction(torch.where(m, w, 1.0), torch.ones_like(m), m & (w != rho))


def token_mask(lr: Tensor, mask: Tensor, high: float, low: float = 0.0) -> Correction:
    """IcePop-style masking per token: ``w_t = rho_t`` if ``low <= rho_t <= high``, else the token is dropped."""
    m = mask.to(torch.bool)
    rho = lr.exp()
    inside = (rho >= low) & (rho <= high)
    keep = inside | ~m
    return Correction(torch.where(m & inside, rho, 1.0), keep, torch.zeros_like(m))


def sequence_tis(lr: Tensor, mask: Tensor, clip: float, clip_low: float = 0.0) -> Correction:
    """Sequence-level truncation: every token of row b is weighted by ``clip(rho_seq[b], clip_low, clip)``."""
    m = mask.to(torch.bool)
    rho = sequence_log_ratio(lr, m).exp()
    w = rho.clamp(min=clip_low, max=clip)
    weights = torch.where(m, w.unsqueeze(-1).expand(m.shape), 1.0)
    return Correction(weights, torch.ones_like(m), m & (w != rho).unsqueeze(-1))


def sequence_mask(lr: Tensor, mask: Tensor, high: float, low: float = 0.0) -> Correction:
    """Sequence-level masking: a row whose ``rho_seq`` lies outside ``[low, high]`` is dropped whole, others weigh 1.

    This is a rejection test, not a re-weighting, as in TRL's ``sequence_mask``: kept responses are
    trained on as they are.
    """
    m = mask.to(torch.bool)
    rho = sequence_log_ratio(lr, m).exp()
    inside = ((rho >= low) & (rho <= high)).unsqueeze(-1)
    return Correction(torch.ones(m.shape, device=m.device), inside | ~m, torch.zeros_like(m))


_BUILTIN = {
    ("truncate", "token"): token_tis,
    ("mask", "token"): token_mask,
    ("truncate", "sequence"): sequence_tis,
    ("mask", "sequence"): sequence_mask,
}


def apply_correction(inputs: CorrectionInputs, cfg: Any) -> Correction:
    """The built-in correction that ``cfg`` (an ``AlgorithmConfig``: tis_mode, tis_level, tis_clip, tis_clip_low) selects."""
    if (cfg.tis_mode, cfg.tis_level) not in _BUILTIN:
        raise ValueError(f"unknown correction {cfg.tis_mode}/{cfg.tis_level}; expected {TIS_MODES} x {TIS_LEVELS}")
    return _BUILTIN[(cfg.tis_mode, cfg.tis_level)](log_ratio(inputs), inputs.mask, cfg.tis_clip, cfg.tis_clip_low)


def mismatch_metrics(inputs: CorrectionInputs, correction: Correction | None = None) -> dict[str, Tensor]:
    """Sums over the valid tokens (detached, for weighted reduction across micro-batches and ranks).

    ``mismatch_k3_sum``: sum of k3 = ``rho - 1 - log rho`` (KL(pi_engine || pi_old) per token over
    the engine's samples); ``ratio_sum``, ``ratio_min``, ``ratio_max`` of ``rho``; ``truncated_sum``
    and ``masked_sum`` (tokens the correction clipped or dropped); ``count`` (valid tokens).
    """
    m = inputs.mask.to(torch.bool)
    with torch.no_grad():
        lr = log_ratio(inputs)
        rho = lr.exp()
        # k3 with samples from the engine: kl_penalty(logp=engine, ref=old) = exp(old - engine) - (old - engine) - 1.
        k3 = kl_penalty(inputs.engine_logprobs.detach().float(), inputs.old_logprobs.detach().float(), "k3")
        inf = torch.full((), float("inf"), device=m.device)  # a fill: a tensor from host data would wait for the device
        out = {
            "mismatch_k3_sum": torch.where(m, k3, 0.0).sum(),
            "ratio_sum": torch.where(m, rho, 0.0).sum(),
            "ratio_min": torch.where(m, rho, inf).amin() if m.numel() else inf,
            "ratio_max": torch.where(m, rho, -inf).amax() if m.numel() else -inf,
            "count": m.sum().float(),
        }
        zero = out["count"].new_zeros(())
        out["truncated_sum"] = (correction.truncated & m).sum().float() if correction is not None else zero
        out["masked_sum"] = (~correction.keep & m).sum().float() if correction is not None else zero
    return out


__all__ = [
    "TIS_LEVELS",
    "TIS_MODES",
    "Correction",
    "CorrectionInputs",
    "apply_correction",
    "log_ratio",
    "mismatch_metrics",
    "sequence_log_ratio",
    "sequence_mask",
    "sequence_tis",
    "token_mask",
    "token_tis",
]
