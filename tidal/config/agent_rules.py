"""Resolution rule of multi-turn rollouts: the environment, its budgets and what they exclude.

Also the sizes other rules need (``longest_sample``: a trajectory is longer than one response;
``prefix_cache_bytes``: the engine's stored prefixes), so the memory plan and the batch checks
count a multi-turn run's real lengths.

A plain function over ``tidal.config.validate.Context``, registered in ``validate``'s rule list as
``multi-turn`` (after ``data``), so it runs in the one resolve pass and appears in
docs/configuration.md. Kept apart from ``validate`` so that module stays about the cluster, memory
and transport rules.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tidal.config.run_rules import PLUGIN_PATH
from tidal.errors import ConfigError

if TYPE_CHECKING:
    from tidal.config.validate import Context

_MULTI_TURN_FLAGS = ("max_turns", "max_trajectory_tokens", "env_timeout", "agent_reward")
_CHAT_TASKS = ("calculator",)
# The built-in tasks an environment answers (tidal.data.tasks.MULTI_TURN_TASKS; a test checks they agree).
MULTI_TURN_TASKS = ("guess", "calculator")
_PREFIX_CACHE_MB = 1024  # --rollout-prefix-cache-mb with an environment


def is_multi_turn(cfg) -> bool:
    """Whether an environment answers the policy's turns: ``--env-path``, or a multi-turn built-in task."""
    d = cfg.data
    return cfg.rollout.env_path is not None or (d.prompt_data is None and d.task in MULTI_TURN_TASKS)


def longest_sample(cfg) -> int:
    """Tokens of the longest sample: the prompt and one response, or a whole trajectory with an environment."""
    r = cfg.rollout
    response = (
        max(r.rollout_max_response_len, r.max_trajectory_tokens) if is_multi_turn(cfg) else r.rollout_max_response_len
    )
    return r.rollout_max_prompt_len + response


def prefix_cache_bytes(cfg) -> int:
    """Bytes each engine may keep for stored prefixes (``--rollout-prefix-cache-mb`` or its default)."""
    mb = cfg.rollout.rollout_prefix_cache_mb
    if mb is None:
        mb = _PREFIX_CACHE_MB if is_multi_turn(cfg) else 0
    return int(mb) << 20


def multi_turn(ctx: Context) -> None:
    r, d, m = ctx.cfg.rollout, ctx.cfg.data, ctx.cfg.model
    from tidal.model.load import PRESETS  # presets without --tokenizer use the character tokenizer

    if r.env_path is not None:
        if not PLUGIN_PATH.match(r.env_path):
            raise ConfigError(f"--env-path {r.env_path}: expected module:Class or file.py:Class, e.g. my_envs:Maze")
        file = r.env_path.rsplit(":", 1)[0]
        if file.endswith(".py") and not os.path.isfile(file):
            raise ConfigError(f"--env-path {r.env_path}: no such file {file}")
    multi = is_multi_turn(ctx.cfg)
    if r.rollout_prefix_cache_mb is None:
        why = "an environment: turns extend earlier requests" if multi else "single-turn: no request extends another"
        ctx.derive("rollout_prefix_cache_mb", _PREFIX_CACHE_MB if multi else 0, "multi-turn", why)
    if not multi:
        for name in _MULTI_TURN_FLAGS:
            if ctx.explicit(name):
                raise ConfigError(
                    f"--{name.replace('_', '-')} has no effect without an environment; add --env-path module:Class "
                    "(or a multi-turn --task: guess, calculator) or drop it"
                )
        return
    if r.custom_generate_function_path:
        raise ConfigError(
            "--custom-generate-function-path and an environment both decide how samples are generated; keep one"
        )
    if r.async_mode != "off":  # the asynchronous drivers (tidal.driver_async) generate without the agent loop
        raise ConfigError(
            f"--async {r.async_mode} generates one response per prompt; multi-turn rollouts (an environment) run in "
            "the synchronous loop: drop --async"
        )
    if r.max_trajectory_tokens < r.rollout_max_response_len:
        raise ConfigError(
            f"--max-trajectory-tokens {r.max_trajectory_tokens} is below --rollout-max-response-len "
            f"{r.rollout_max_response_len}: no policy turn would fit; raise it"
        )
    if d.prompt_data is None and d.task in _CHAT_TASKS and m.model in PRESETS and not m.tokenizer:
        raise ConfigError(
            f"--task {d.task} asks chat questions; --model {m.model} has a character tokenizer and no chat "
            "template; use --preset smollm2-135m-cpu (or another instruct model)"
        )
