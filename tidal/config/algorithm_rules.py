"""Resolution rules of the algorithm section: estimator, critic, off-policy correction, overlong penalty, clip range, KL.

Plain functions over ``tidal.config.validate.Context``; ``validate`` registers them in its ordered
rule list (``critic`` before ``critic-offload``, the others after the batch rules), so they run in
the one resolve pass and appear in docs/configuration.md. Each raises ``ConfigError`` with one line:
the flags involved and the fix. Kept apart from ``validate`` so that module stays about the
cluster, memory and transport rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.config.run_rules import PLUGIN_PATH
from tidal.errors import ConfigError

if TYPE_CHECKING:
    from tidal.config.validate import Context

# Estimators whose returns are discounted by --gamma, and the one that learns a value baseline.
_DISCOUNTED = ("ppo", "reinforce_plus_plus")


def _unused(ctx: Context, names: tuple[str, ...], why: str, fix: str) -> None:
    for name in names:
        if ctx.explicit(name):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} has no effect {why}; {fix}")


def critic(ctx: Context) -> None:
    """``--use-critic`` follows from ``--advantage-estimator ppo``; the critic's own flags need it."""
    a = ctx.cfg.algorithm
    est = a.advantage_estimator
    if a.use_critic is None:
        ctx.derive("use_critic", est == "ppo", "critic", f"--advantage-estimator {est}")
    elif a.use_critic and est != "ppo":
        raise ConfigError(
            f"--use-critic: --advantage-estimator {est} has no value baseline to learn; use --advantage-estimator ppo "
            "(PPO with a critic) or drop --use-critic"
        )
    elif not a.use_critic and est == "ppo":
        raise ConfigError(
            "--no-use-critic: --advantage-estimator ppo needs its critic (GAE over learned values); drop --no-use-critic "
            "or choose a critic-free estimator such as grpo or reinforce_plus_plus"
        )
    if not a.use_critic:
        _unused(
            ctx, ("value_clip", "critic_lr", "lambd"), "without a critic", "use --advantage-estimator ppo or drop it"
        )
    elif a.critic_lr is None:
        ctx.derive("critic_lr", ctx.cfg.trainer.lr, "critic", "the policy's --lr")
    if est not in _DISCOUNTED:
        _unused(ctx, ("gamma",), f"with --advantage-estimator {est}", "only ppo and reinforce_plus_plus discount")
    for name in ("gamma", "lambd"):
        if getattr(a, name) > 1:
            raise ConfigError(f"--{name} {getattr(a, name)}: must be within [0, 1]; use 1 for undiscounted returns")


def tis(ctx: Context) -> None:
    """Off-policy correction: bounds in order, flags only with ``--use-tis``, one old policy at a time."""
    a = ctx.cfg.algorithm
    if not a.use_tis:
        _unused(
            ctx,
            ("tis_clip", "tis_clip_low", "tis_mode", "tis_level", "custom_tis_function_path"),
            "without --use-tis",
            "add --use-tis or drop it",
        )
        return
    if a.use_rollout_logprobs:
        raise ConfigError(
            "--use-tis with --use-rollout-logprobs: the PPO ratio is then already taken against the engine's policy "
            "and the correction ratio is 1; keep one of the two"
        )
    if a.tis_clip_low > a.tis_clip:
        raise ConfigError(
            f"--tis-clip-low {a.tis_clip_low} is above --tis-clip {a.tis_clip}: the ratio bounds are inverted; "
            "swap them (e.g. --tis-clip-low 0.5 --tis-clip 2)"
        )
    if a.tis_clip <= 0:
        raise ConfigError("--tis-clip 0 weights every token by 0; use a bound above 1 such as 2")
    if a.tis_mode == "mask" and not a.tis_clip_low <= 1.0 <= a.tis_clip:
        raise ConfigError(
            f"--tis-mode mask with bounds [{a.tis_clip_low}, {a.tis_clip}] drops even tokens on which engine and trainer "
            "agree (ratio 1); choose bounds around 1 such as --tis-clip-low 0.5 --tis-clip 2"
        )
    path = a.custom_tis_function_path
    if path is not None and not PLUGIN_PATH.match(path):
        raise ConfigError(
            f"--custom-tis-function-path {path}: expected module:function or file.py:function, e.g. my_pkg.mis:weights"
        )


def overlong(ctx: Context) -> None:
    """DAPO's overlong penalty needs a buffer shorter than the longest response."""
    a, r = ctx.cfg.algorithm, ctx.cfg.rollout
    if a.overlong_buffer_len == 0:
        _unused(ctx, ("overlong_penalty_factor",), "without --overlong-buffer-len", "set a buffer length or drop it")
        return
    if a.overlong_buffer_len >= r.rollout_max_response_len:
        raise ConfigError(
            f"--overlong-buffer-len {a.overlong_buffer_len} must be below --rollout-max-response-len "
            f"{r.rollout_max_response_len} (the penalty starts that many tokens before the limit); lower it"
        )


def eps_clip_high(ctx: Context) -> None:
    a = ctx.cfg.algorithm
    if a.eps_clip_high is None:
        ctx.derive("eps_clip_high", a.eps_clip, "eps-clip-high", "symmetric clipping")


def kl(ctx: Context) -> None:
    a = ctx.cfg.algorithm
    if a.kl_loss_coef > 0 and not a.use_kl_loss:
        raise ConfigError(
            f"--kl-loss-coef {a.kl_loss_coef} has no effect without --use-kl-loss; add --use-kl-loss or drop the coefficient"
        )
