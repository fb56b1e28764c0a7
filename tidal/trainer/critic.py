"""PPO's critic: a value model trained next to the policy on the same ranks, devices and memory backend.

``--advantage-estimator ppo`` (``--use-critic`` follows from it) builds one ``Critic`` per trainer
rank. It is the policy's architecture with a one-output token head
(``AutoModelForTokenClassification``, ``num_labels=1``): from a Hugging Face folder the backbone is
the policy's checkpoint, from a preset it is initialised like the policy; the head starts at zero,
so the first advantages are the plain returns (REINFORCE) and the baseline is learned from there.

The critic is sharded with the policy's FSDP2 machinery (the trainer passes its ``shard``
function), has its own AdamW and learning rate (``--critic-lr``, default ``--lr``), and its
tensors join the policy's state classes (WEIGHTS, OPTIMIZER, GRADS), so the trainer's
``pause``/``resume`` release and restore both models under the same per-class memory policy; its
weights and moments are saved in the trainer's checkpoint under ``critic.`` names. It is never
synced to the engines.

Per rollout (see ``TrainerActor``): old values ``V_old`` come from a no-grad pass before any
update, GAE turns them and the outcome rewards into advantages and returns
(``tidal.algos.estimators.gae``), and each optimizer step also steps the critic on the clipped
value loss (``tidal.algos.objectives.value_loss``), normalised like the policy loss.

Values are aligned with the policy's log-probs: position ``t`` scores the state that predicts token
``t + 1``, so ``values[:, t]`` is the baseline of the token whose log-prob is ``logprobs[:, t]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tidal.algos.losses import aggregate_sum
from tidal.algos.objectives import value_loss
from tidal.config.schema import AlgorithmConfig, TrainerConfig
from tidal.trainer.schedule import LRSchedule
from tidal.trainer.step import model_call
from tidal.trainer.weights import local_shard

PREFIX = "critic."


def build_value_model(spec, *, seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The value model on the host: the policy's architecture with a zero-initialised 1-output token head."""
    from transformers import AutoModelForTokenClassification

    from tidal.model.load import model_config

    if spec.is_preset:
        cfg = model_config(spec)
        cfg.num_labels = 1
        torch.manual_seed(seed)
        model = AutoModelForTokenClassification.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForTokenClassification.from_pretrained(
            spec.path, num_labels=1, dtype=dtype, attn_implementation="sdpa", trust_remote_code=spec.trust_remote_code
        )
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is not None:
        with torch.no_grad():
            for p in head.parameters():
                p.zero_()
    model.config.use_cache = False
    return model


class Critic:
    """One rank's value model and its optimizer; ``shard`` is the trainer's FSDP2 wrapping of a host model."""

    def __init__(
        self,
        spec,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig,
        *,
        shard: Callable[[torch.nn.Module], torch.nn.Module],
        total_steps: int | None = None,
    ):
        self.algo = algorithm
        model = build_value_model(spec, seed=trainer.seed + 1)
        if trainer.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = shard(model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        lr = algorithm.critic_lr if algorithm.critic_lr is not None else trainer.lr
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=lr,
            betas=(trainer.adam_beta1, trainer.adam_beta2),
            eps=trainer.adam_eps,
            weight_decay=trainer.weight_decay,
        )
        # The policy's schedule shape at the critic's own peak rate.
        self.schedule = LRSchedule.of(trainer, total_steps, lr=lr)
        self.clip_grad = trainer.clip_grad

    def values(self, input_ids: Tensor) -> Tensor:
        """Values[B, T-1] (fp32) of every position but the last, aligned with the policy's log-probs."""
        with model_call():
            out = self.model(input_ids=input_ids, use_cache=False).logits
        return out[:, :-1, 0].float()

    def loss(
        self, values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, normalizer: Tensor | float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The clipped value loss of one micro-batch, summed and divided by the policy's ``normalizer``."""
        agg = self.algo.loss_agg_mode
        per_token = value_loss(values, old_values, returns, mask, self.algo.value_clip)
        loss_sum = aggregate_sum(per_token, mask, agg)
        m = mask.to(torch.bool)
        with torch.no_grad():
            n = m.sum().clamp(min=1)
            clipped = (values - old_values).abs() > self.algo.value_clip
            metrics = {
                "value_loss": torch.where(m, per_token, 0.0).sum() / n,
                "value_mean": torch.where(m, values.detach(), 0.0).sum() / n,
                "value_clipfrac": (clipped & m).sum() / n,
            }
        return loss_sum / normalizer, metrics

    def step(self) -> Tensor:
        """Clip the critic's gradient norm, step AdamW at the scheduled rate, zero the grads; returns the norm."""
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm=max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.schedule.apply(self.optimizer)
        self.optimizer.step()
        self.schedule.advance()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.detach().float().reshape(())

    # ---- tensors per state class, and names for checkpoints ----------------------------------------
    def weight_tensors(self) -> list[Tensor]:
        return [local_shard(p) for p in self.model.parameters()]

    def optimizer_tensors(self) -> list[Tensor]:
        return [
            local_shard(v)
            for state in self.optimizer.state.values()
            for k, v in state.items()
            if k != "step" and torch.is_tensor(v)
        ]

    def grad_tensors(self) -> list[Tensor]:
        return [local_shard(p.grad) for p in self.params if p.grad is not None]

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        """``critic.<HF name>`` -> parameter (the checkpoint's names for the critic's weights)."""
        return [(PREFIX + n, p) for n, p in self.model.named_parameters()]
