"""Group-relative advantages (GRPO, Dr.GRPO) and dynamic sampling, as pure tensor functions.

GRPO samples ``group_size`` responses per prompt and scores each response against its siblings:
the advantage of a sample is its reward minus the mean reward of its group, divided by the group's
standard deviation (``std_normalize=True``). Dr.GRPO drops the division (``std_normalize=False``)
because it up-weights groups that are nearly solved or nearly hopeless. The std is the unbiased
(Bessel-corrected) one, as slime and TRL compute it.

A group whose rewards all equal has advantage zero for every sample: it contributes no gradient but
still costs a forward and backward pass. Dynamic sampling (DAPO) drops such groups before training.

Rewards are laid out group-major: ``rewards[g * group_size + i]`` is sample ``i`` of prompt ``g``,
which is the order ``tidal.rollout.orchestrate.make_rollout_samples`` produces.
"""

from __future__ import annotations

from torch import Tensor


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """View flat rewards[num_groups * group_size] as [num_groups, group_size]."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_groups * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def grpo_advantages(rewards: Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages[num_groups * group_size] from rewards[num_groups * group_size] (same layout).

    ``(r - mean_g) / (std_g + eps)`` with ``std_normalize``, else ``r - mean_g`` (Dr.GRPO). A group
    of one sample has no siblings to compare with, so its advantage is zero.
    """
    grouped = _grouped(rewards.float(), group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if std_normalize and group_size > 1:
        # eps keeps all-equal groups (std 0) at exactly zero instead of 0/0.
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def zero_variance_groups(rewards: Tensor, group_size: int) -> Tensor:
    """BoolTensor[num_groups]: True where every reward in the group is the same."""
    grouped = _grouped(rewards, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def dynamic_sampling_keep(rewards: Tensor, group_size: int) -> Tensor:
    """BoolTensor[num_groups * group_size]: True for samples of groups whose rewards differ (kept)."""
    return (~zero_variance_groups(rewards, group_size)).repeat_interleave(group_size)
