"""What the trainer's loss needs beyond the current log-probs, for one rollout: old policy, correction, critic.

``RolloutObjective`` is built once per ``train`` call and consulted per micro-batch:

- ``prepare(mb, trainer_old)``: picks the old policy of the PPO ratio (the trainer's log-probs, or
  with ``--use-rollout-logprobs`` the engine's), computes the behaviour-policy correction
  (``--use-tis``: built-in ``tidal.algos.correction.apply_correction`` or the
  ``--custom-tis-function-path`` function) and adds the mismatch metrics of the micro-batch;
- ``prepare_values(mb, critic)``: PPO only, before any update: old values, then GAE advantages and
  returns from the outcome rewards;
- ``loss(mb, logprobs, entropy, normalizer)``: ``tidal.algos.objectives.rl_loss`` with the above;
- ``metrics(groups)``: the rollout's mismatch and critic figures, reduced over ranks (one host
  transfer, with the trainer's own).

Everything stays on the device until ``metrics``; nothing here waits for it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tidal.algos.correction import Correction, CorrectionInputs, apply_correction, mismatch_metrics
from tidal.algos.estimators import gae, outcome_token_rewards
from tidal.algos.objectives import RLInputs, rl_loss
from tidal.config.schema import AlgorithmConfig

_SUMS = ("mismatch_k3_sum", "ratio_sum", "count", "truncated_sum", "masked_sum")
_CRITIC = ("value_loss", "value_mean", "value_clipfrac")


def load_custom_correction(path: str):
    """The ``--custom-tis-function-path`` function: ``fn(CorrectionInputs, AlgorithmConfig) -> Correction``."""
    from tidal.rollout.plugins import load_callable

    return load_callable(path, "--custom-tis-function-path")


class RolloutObjective:
    def __init__(self, algo: AlgorithmConfig, device: torch.device, custom_correction=None):
        self.algo, self.device = algo, device
        self.custom = custom_correction
        self.sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=device)
        self.extremes = torch.full((2,), float("-inf"), dtype=torch.float64, device=device)  # -min, max
        self.critic_sums = torch.zeros(len(_CRITIC) + 1, dtype=torch.float64, device=device)
        self.critic_norms: list[Tensor] = []

    # ---- per micro-batch -----------------------------------------------------------------------
    def prepare(self, mb: Any, trainer_old: Tensor) -> None:
        """Set ``mb.old_logprobs`` (and ``mb.correction``) from the trainer's old log-probs [B, T-1]."""
        algo = self.algo
        has_engine = mb.has_engine_logprobs & mb.mask
        mb.old_logprobs = trainer_old
        if algo.use_rollout_logprobs:
            mb.old_logprobs = torch.where(has_engine, mb.engine_logprobs, trainer_old)
        mb.correction = None
        if not mb.num_engine_logprobs:
            return
        inputs = CorrectionInputs(trainer_old, mb.engine_logprobs, has_engine)
        if algo.use_tis:
            fn = self.custom or apply_correction
            mb.correction = fn(inputs, algo)
            if not isinstance(mb.correction, Correction):
                raise TypeError(
                    f"--custom-tis-function-path must return tidal.algos.correction.Correction, got {type(mb.correction).__name__}"
                )
        m = mismatch_metrics(inputs, mb.correction)
        self.sums += torch.stack([m[k].double() for k in _SUMS])
        self.extremes = torch.maximum(self.extremes, torch.stack([-m["ratio_min"], m["ratio_max"]]).double())

    def prepare_values(self, mb: Any, critic) -> None:
        """PPO: ``mb.old_values``, and GAE ``mb.advantages`` / ``mb.returns`` [B, T-1] from the rows' rewards."""
        mb.old_values = critic.values(mb.input_ids).detach()
        token_rewards = outcome_token_rewards(mb.rewards, mb.mask)
        mb.advantages, mb.returns = gae(token_rewards, mb.old_values, mb.mask, self.algo.gamma, self.algo.lambd)

    def loss(self, mb: Any, logprobs: Tensor, entropy: Tensor | None, normalizer) -> tuple[Tensor, dict[str, Tensor]]:
        c = getattr(mb, "correction", None)
        inputs = RLInputs(
            logprobs=logprobs,
            old_logprobs=mb.old_logprobs,
            advantages=mb.advantages,
            mask=mb.mask,
            ref_logprobs=mb.ref_logprobs,
            entropy=entropy,
            weights=None if c is None else c.weights,
            keep=None if c is None else c.keep,
        )
        return rl_loss(inputs, self.algo, normalizer=normalizer)

    def critic_backward(self, mb: Any, critic, normalizer, region) -> None:
        """The critic's value loss on ``mb``, backward inside ``region`` (the GRADS allocation region)."""
        values = critic.values(mb.input_ids)
        loss, m = critic.loss(values, mb.old_values, mb.returns, mb.mask, normalizer)
        with region:
            loss.backward()
        n = float(mb.num_response_tokens)
        self.critic_sums += torch.stack([*(m[k].double() * n for k in _CRITIC), self.critic_sums.new_full((), n)])

    def critic_step(self, critic) -> None:
        self.critic_norms.append(critic.step())

    # ---- per rollout ----------------------------------------------------------------------------
    def metrics(self, groups) -> dict[str, float]:
        """Mismatch (and critic) figures of the rollout, reduced over ranks; rank-independent keys."""
        parts = [self.sums, self.critic_sums, *(n.to(self.sums.device).double().reshape(1) for n in self.critic_norms)]
        host = torch.cat([p.reshape(-1) for p in parts]).tolist()
        k = len(_SUMS) + len(self.critic_sums)
        sums = groups.all_reduce_host(host[:k])
        neg_min, top = groups.all_reduce_host(self.extremes.tolist(), op=torch.distributed.ReduceOp.MAX)
        s = dict(zip(_SUMS, sums[: len(_SUMS)]))
        count = s["count"]
        out: dict[str, float] = {}
        if count:
            out.update(
                {
                    "mismatch/k3": s["mismatch_k3_sum"] / count,
                    "mismatch/ratio_mean": s["ratio_sum"] / count,
                    "mismatch/ratio_min": -neg_min,
                    "mismatch/ratio_max": top,
                    "mismatch/truncated_frac": s["truncated_sum"] / count,
                    "mismatch/masked_frac": s["masked_sum"] / count,
                }
            )
        if self.critic_norms:
            c = sums[len(_SUMS) :]
            n = max(c[-1], 1.0)
            out.update({name: v / n for name, v in zip(_CRITIC, c[:-1])})
            out["critic_grad_norm"] = sum(host[k:]) / len(self.critic_norms)
        return out
