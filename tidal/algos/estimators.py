"""Advantage estimators beyond GRPO: RLOO, REINFORCE++, REINFORCE++-baseline, GAE, as pure tensor functions.

Shapes: ``B`` sequences, ``T`` response positions; ``mask[b, t]`` is 1 for the response tokens of
row ``b``. Rewards are one scalar per sequence (outcome rewards), laid out group-major like
``tidal.algos.advantages``: ``rewards[g * group_size + i]`` is sample ``i`` of prompt ``g``.

Which estimator needs what:

=============================  ============================================  =====================
estimator                      baseline                                      result
=============================  ============================================  =====================
``rloo``                       mean of the *other* samples of the group      one value per sequence
``reinforce_plus_plus``        none; returns whitened over the batch         one value per token
``reinforce_plus_plus_baseline`` group mean, then whitened over the batch    one value per token
``ppo`` (``gae``)              a learned value per token                     advantages and returns per token
=============================  ============================================  =====================

Whitening is over every valid token of the batch (a long response weighs by its length), which is
what REINFORCE++ calls global batch normalisation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tidal.algos.advantages import _grouped, grpo_advantages

# Estimators whose advantages come from group statistics of the rewards, one value per sequence.
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "gspo", "cispo")


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Leave-one-out advantages[B] (RLOO; Kool et al. 2019, "Buy 4 REINFORCE samples", Eq. 9; Ahmadian et al. 2024).

    ``A_i = r_i - 1/(k-1) * sum_{j != i} r_j``, which equals ``k/(k-1) * (r_i - mean_g)``. The
    baseline of a sample never contains its own reward, so the gradient stays unbiased. A group of
    one has no other sample: its advantage is zero.
    """
    grouped = _grouped(rewards.float(), group_size)
    if group_size == 1:
        return torch.zeros_like(grouped).reshape(-1)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def outcome_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Token rewards[B, T]: each sequence's scalar reward on its last valid token, 0 elsewhere."""
    m = mask.to(torch.bool)
    last = _last_index(m)
    out = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    has = m.any(dim=-1)
    rows = torch.arange(m.shape[0], device=m.device)[has]
    out[rows, last[has]] = rewards.float().to(m.device)[has]
    return out


def _last_index(m: Tensor) -> Tensor:
    """Index[B] of the last True of each row (0 for an empty row)."""
    pos = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    return torch.where(m, pos, torch.zeros_like(pos)).amax(dim=-1)


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Returns[B, T]: ``G_t = sum_{k >= t} gamma^(k - t) r_k`` over valid positions (0 at masked ones)."""
    m = mask.to(torch.bool)
    r = torch.where(m, token_rewards.float(), 0.0)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return torch.where(m, out, 0.0)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / (std + eps)`` with mean and std over the valid positions of the whole batch; 0 elsewhere.

    The std is the unbiased (Bessel-corrected) one; a batch with one valid value is centred only.
    """
    m = mask.to(torch.bool)
    vals = x.float()[m]
    if vals.numel() == 0:
        return torch.zeros_like(x, dtype=torch.float32)
    mean = vals.mean()
    centred = x.float() - mean
    if vals.numel() > 1:
        centred = centred / (vals.std() + eps)
    return torch.where(m, centred, 0.0)


def reinforce_plus_plus_advantages(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ advantages[B, T] (Hu et al. 2025, arXiv 2501.03262, Eq. 6-7).

    The outcome reward sits on the last token, the return of each token is its discounted sum
    (``discounted_returns``), and the returns are normalised over every valid token of the batch:
    ``A_t = (G_t - mean(G)) / std(G)``. No critic and no group baseline.
    """
    returns = discounted_returns(outcome_token_rewards(rewards, mask), mask, gamma)
    return masked_whiten(returns, mask)


def reinforce_plus_plus_baseline_advantages(rewards: Tensor, group_size: int, mask: Tensor) -> Tensor:
    """REINFORCE++-baseline advantages[B, T] (Hu et al. 2025, arXiv 2501.03262, Eq. 8-9).

    Each reward minus its group's mean (``A' = r - mean_g``), broadcast over the sequence's tokens,
    then normalised over every valid token of the batch (``A = (A' - mean(A')) / std(A')``): the
    group mean removes the prompt's difficulty, the batch statistics keep the scale stable where a
    group std would be near zero.
    """
    grouped = _grouped(rewards.float(), group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    m = mask.to(torch.bool)
    per_token = centred.to(m.device).unsqueeze(-1).expand(m.shape)
    return masked_whiten(per_token, m)


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lambd: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation: (advantages[B, T], returns[B, T]) (Schulman et al. 2016, Eq. 16).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = sum_l (gamma * lambd)^l delta_{t+l}``, computed
    backwards as ``A_t = delta_t + gamma * lambd * A_{t+1}``; ``returns = A + V`` are the value
    targets. Past a sequence's last valid token the value is 0 (the episode has ended), so the last
    token's delta is ``r_T - V_T``. Masked positions are 0 in both outputs.
    """
    m = mask.to(torch.bool)
    r = torch.where(m, token_rewards.float(), 0.0)
    v = torch.where(m, values.float(), 0.0)
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    running = torch.zeros_like(next_value)
    for t in range(r.shape[1] - 1, -1, -1):
        valid = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = torch.where(valid, delta + gamma * lambd * running, running)
        next_value = torch.where(valid, v[:, t], next_value)
        adv[:, t] = running
    adv = torch.where(m, adv, 0.0)
    return adv, torch.where(m, adv + v, 0.0)


def response_mask(response_lens: Tensor) -> Tensor:
    """Mask[N, max_len] with the first ``response_lens[i]`` positions of row i set."""
    lens = response_lens.long()
    width = int(lens.max()) if lens.numel() else 0
    return torch.arange(max(width, 1)).unsqueeze(0) < lens.unsqueeze(1)


def sample_advantages(
    rewards: Tensor, response_lens: Tensor, group_size: int, cfg: Any, mask: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Advantages of one rollout from its rewards[N] and response lengths[N], as ``cfg.advantage_estimator`` says.

    Returns ``(per_sequence[N], per_token[N, max_len] or None)``. ``grpo``, ``gspo`` and ``cispo`` use
    GRPO's group-normalised advantage (``--grpo-std-normalization``), ``dr_grpo`` the group-centred
    one, ``rloo`` the leave-one-out one; the REINFORCE++ pair also give per-token values (their
    per-sequence value is the row mean). ``ppo`` gives zeros: its advantages come from the critic,
    in the trainer (``gae``). ``mask[N, max_len]``, when given, holds the trained tokens of each
    response (a multi-turn trajectory's policy tokens); default: the first ``response_lens[i]``.
    """
    est = cfg.advantage_estimator
    if est in GROUP_ESTIMATORS:
        std = cfg.grpo_std_normalization and est != "dr_grpo"
        return grpo_advantages(rewards, group_size, std_normalize=std), None
    if est == "rloo":
        return rloo_advantages(rewards, group_size), None
    if est == "ppo":
        return torch.zeros(rewards.shape[0]), None
    mask = response_mask(response_lens) if mask is None else mask.to(torch.bool)
    if est == "reinforce_plus_plus":
        tok = reinforce_plus_plus_advantages(rewards, mask, cfg.gamma)
    elif est == "reinforce_plus_plus_baseline":
        tok = reinforce_plus_plus_baseline_advantages(rewards, group_size, mask)
    else:
        raise ValueError(f"unknown advantage estimator {est!r}")
    per_seq = tok.sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq, tok


__all__ = [
    "GROUP_ESTIMATORS",
    "discounted_returns",
    "response_mask",
    "sample_advantages",
    "gae",
    "masked_whiten",
    "outcome_token_rewards",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
]
