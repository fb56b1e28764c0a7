"""Resolution rules of the trainer section: the global batch and the token budget, the learning rate.

Plain functions over ``tidal.config.validate.Context``; ``validate`` registers them in its ordered
rule list (``batch`` after the memory and transport rules, ``lr`` after the algorithm rules), so they
run in the one resolve pass and appear in docs/configuration.md with their ids and summaries. Each
raises ``ConfigError`` with one line: the flags involved and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.config import agent_rules
from tidal.errors import ConfigError

if TYPE_CHECKING:
    from tidal.config.validate import Context


def batch(ctx: Context) -> None:
    r, t, c = ctx.cfg.rollout, ctx.cfg.trainer, ctx.cfg.cluster
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    ranks = c.actor_num_nodes * c.actor_num_gpus_per_node
    if t.global_batch_size is None:
        ctx.derive(
            "global_batch_size",
            samples,
            "batch",
            f"rollout-batch-size {r.rollout_batch_size} x n-samples-per-prompt {r.n_samples_per_prompt}: one step per rollout",
        )
    gbs = t.global_batch_size
    if samples % gbs:
        raise ConfigError(
            f"--global-batch-size {gbs} does not divide the {samples} samples of a rollout (--rollout-batch-size {r.rollout_batch_size} x "
            f"--n-samples-per-prompt {r.n_samples_per_prompt}); use a divisor such as {divisor_near(samples, gbs, ranks)}"
        )
    if not r.debug_rollout_only and gbs % ranks:
        raise ConfigError(
            f"--global-batch-size {gbs} is not a multiple of the {ranks} trainer ranks; use a multiple of {ranks}"
        )
    longest = agent_rules.longest_sample(ctx.cfg)
    if longest > t.max_tokens_per_gpu:
        what, knob = (
            ("trajectory", "--max-trajectory-tokens")
            if agent_rules.is_multi_turn(ctx.cfg)
            else ("response", "--rollout-max-response-len")
        )
        raise ConfigError(
            f"--max-tokens-per-gpu {t.max_tokens_per_gpu} is below the longest sample ({r.rollout_max_prompt_len} prompt + "
            f"{longest - r.rollout_max_prompt_len} {what} tokens); raise it to at least {longest} or lower --rollout-max-prompt-len/{knob}"
        )


def divisor_near(n: int, target: int, multiple_of: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0 and d % multiple_of == 0] or [n]
    return min(divisors, key=lambda d: (abs(d - target), d))


def lr(ctx: Context) -> None:
    t = ctx.cfg.trainer
    if t.min_lr > t.lr:
        raise ConfigError(f"--min-lr {t.min_lr} is above --lr {t.lr}; lower --min-lr")
