"""Pure tensor functions of the RL algorithm: advantages, estimators, losses, corrections, KL, entropy, log-probs.

Nothing here imports Ray, engines or models, so every function is testable on hand-computed values.
``advantages`` (GRPO, dynamic sampling), ``estimators`` (RLOO, REINFORCE++, GAE), ``losses``
(PPO-clip, KL, entropy, the fused log-prob kernel), ``objectives`` (GSPO, CISPO, the value loss,
the overlong penalty, the trainer's ``rl_loss``), ``correction`` (TIS, IcePop, sequence masks,
mismatch metrics).
"""

from tidal.algos.advantages import dynamic_sampling_keep, grpo_advantages, zero_variance_groups
from tidal.algos.correction import Correction, CorrectionInputs, apply_correction, mismatch_metrics
from tidal.algos.estimators import (
    gae,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
    sample_advantages,
)
from tidal.algos.logprobs import entropy_from_logits, token_logprobs, token_logprobs_and_entropy
from tidal.algos.losses import aggregate_sum, kl_penalty, loss_normalizer, masked_mean
from tidal.algos.objectives import RLInputs, overlong_penalty, policy_loss, policy_terms, rl_loss, value_loss

__all__ = [
    "Correction",
    "CorrectionInputs",
    "RLInputs",
    "aggregate_sum",
    "apply_correction",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "kl_penalty",
    "loss_normalizer",
    "masked_mean",
    "mismatch_metrics",
    "overlong_penalty",
    "policy_loss",
    "policy_terms",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rl_loss",
    "rloo_advantages",
    "sample_advantages",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "value_loss",
    "zero_variance_groups",
]
