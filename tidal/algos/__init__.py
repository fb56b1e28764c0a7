"""Pure tensor functions of the RL algorithm: advantages, PPO-clip loss, KL, entropy, log-probs.

Nothing here imports Ray, engines or models, so every function is testable on hand-computed values.
"""

from tidal.algos.advantages import dynamic_sampling_keep, grpo_advantages, zero_variance_groups
from tidal.algos.losses import (
    LossInputs,
    aggregate_sum,
    entropy_from_logits,
    grpo_loss,
    kl_penalty,
    loss_normalizer,
    masked_mean,
    policy_loss,
    token_logprobs,
    token_logprobs_and_entropy,
)

__all__ = [
    "LossInputs",
    "aggregate_sum",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "grpo_advantages",
    "grpo_loss",
    "kl_penalty",
    "loss_normalizer",
    "masked_mean",
    "policy_loss",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "zero_variance_groups",
]
