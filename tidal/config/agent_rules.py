"""Resolution rule of multi-turn rollouts: the environment, its budgets and what they exclude.

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


def multi_turn(ctx: Context) -> None:
    r, d, m = ctx.cfg.rollout, ctx.cfg.data, ctx.cfg.model
    from tidal.model.load import PRESETS  # presets without --tokenizer use the character tokenizer

    if r.env_path is not None:
        if not PLUGIN_PATH.match(r.env_path):
            raise ConfigError(f"--env-path {r.env_path}: expected module:Class or file.py:Class, e.g. my_envs:Maze")
        file = r.env_path.rsplit(":", 1)[0]
        if file.endswith(".py") and not os.path.isfile(file):
            raise ConfigError(f"--env-path {r.env_path}: no such file {file}")
    multi = r.env_path is not None or (d.prompt_data is None and d.task in MULTI_TURN_TASKS)
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
