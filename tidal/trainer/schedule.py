"""Learning-rate schedule: linear warmup, then constant, cosine or linear decay to ``min_lr``.

A plain object whose only state is the number of optimizer steps taken, so a checkpoint stores one
integer and a resumed run computes exactly the same rates (``torch.optim.lr_scheduler`` objects
pickle closures and depend on call order, which makes bit-exact resume harder to reason about).
"""

from __future__ import annotations

import math

import torch

from tidal.errors import ConfigError


class LRSchedule:
    """``lr_at(step)`` for the step about to be taken; ``apply(optimizer)`` sets it and counts the step."""

    def __init__(
        self, *, lr: float, min_lr: float, warmup_steps: int, decay_style: str, total_steps: int | None = None
    ):
        if decay_style not in ("constant", "cosine", "linear"):
            raise ConfigError(f"--lr-decay-style {decay_style}: use constant, cosine or linear")
        if decay_style != "constant" and not total_steps:
            raise ConfigError(
                f"--lr-decay-style {decay_style} needs the number of optimizer steps; pass total_steps to the trainer"
            )
        self.lr, self.min_lr, self.warmup_steps = lr, min_lr, max(0, int(warmup_steps))
        self.decay_style, self.total_steps = decay_style, total_steps
        self.step = 0  # optimizer steps taken so far

    @classmethod
    def of(cls, trainer, total_steps: int | None, *, lr: float | None = None) -> LRSchedule:
        """The schedule ``--lr``, ``--min-lr``, ``--lr-warmup-steps`` and ``--lr-decay-style`` (a
        ``TrainerConfig``) describe; another peak ``lr`` (the critic's) scales ``min_lr`` with it."""
        min_lr = trainer.min_lr
        if lr is None:
            lr = trainer.lr
        else:
            min_lr = trainer.min_lr * lr / trainer.lr if trainer.lr > 0 else 0.0
        return cls(
            lr=lr,
            min_lr=min_lr,
            warmup_steps=trainer.lr_warmup_steps,
            decay_style=trainer.lr_decay_style,
            total_steps=total_steps,
        )

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            # step 0 trains at lr/warmup rather than 0, so no optimizer step is wasted.
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_style == "constant":
            return self.lr
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.decay_style == "linear":
            return self.min_lr + (self.lr - self.min_lr) * (1.0 - progress)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer) -> float:
        """Set the rate of the step about to run on every param group; returns it."""
        lr = self.lr_at(self.step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def advance(self) -> None:
        self.step += 1

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
