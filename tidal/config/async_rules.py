"""Resolution rules of asynchronous training (``--async``, ``tidal.driver_async``).

Plain functions over ``tidal.config.validate.Context``, registered by ``validate`` before the cluster
rule and the offload decision, because they settle placement and offload:

- Generation overlaps training, so neither side can hand its memory to the other: offload is off
  (an explicit ``--offload*`` is refused). Left to the default, placement is disaggregated (engines
  on their own cores or GPUs, as slime's ``train_async.py`` requires) when the devices allow it;
  on one GPU the trainer and engine stay colocated, both resident, and the memory plan must fit them.
- Samples come from older weights, so the engine's log-probs are the behaviour policy: without
  ``--use-tis`` or ``--use-rollout-logprobs`` given, ``--use-tis`` is derived (an explicit
  ``--no-use-tis`` is kept).
- Trainer and engines sharing a GPU (colocated on CUDA): the trainer's processes get
  ``CUDA_MPS_CLIENT_PRIORITY=1`` unless either side's env vars set a priority. Under a CUDA MPS daemon
  the engine's short decode kernels are then scheduled before the trainer's long GEMMs instead of queueing
  behind them; without MPS the variable is ignored (figures: docs/async.md).
- ``--partial-rollout`` (full only, single-turn; the embedded engine's generate step, which a custom generate
  function reaches through ``generate_default``, or an HTTP engine's requests): requests in flight at a
  sync are paused and continued on the new weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.errors import ConfigError

if TYPE_CHECKING:
    from tidal.config.validate import Context

_FULL_ONLY = ("max_staleness", "async_buffer_size")


def async_mode(ctx: Context) -> None:
    r = ctx.cfg.rollout
    _over_sampling(ctx)
    if r.async_mode == "off":
        for name in (*_FULL_ONLY, "partial_rollout"):
            if ctx.explicit(name) and getattr(r, name) is not False:
                raise ConfigError(f"--{name.replace('_', '-')} is only used with --async; add --async or drop the flag")
        return
    if r.partial_rollout:
        _partial_rollout(ctx)
    if r.debug_rollout_only:
        raise ConfigError(f"--async {r.async_mode} overlaps generation with training; --debug-rollout-only has none")
    if r.async_mode == "one-step":
        for name in _FULL_ONLY:
            if ctx.explicit(name):
                raise ConfigError(
                    f"--{name.replace('_', '-')} is only used with --async full (one-step is always one version "
                    "behind); drop it"
                )
    else:
        if r.async_buffer_size is None:
            ctx.derive(
                "async_buffer_size",
                r.rollout_batch_size * max(1, r.max_staleness),
                "async",
                "rollout-batch-size x max-staleness: in a steady run no group waits longer than the bound allows",
            )
        if r.async_buffer_size < r.rollout_batch_size:
            raise ConfigError(
                f"--async-buffer-size {r.async_buffer_size} is below --rollout-batch-size {r.rollout_batch_size}: "
                "the trainer could never take a batch; raise it"
            )
    _placement(ctx)
    _mps_priority(ctx)
    _behaviour_policy(ctx)


def _partial_rollout(ctx: Context) -> None:
    """``--partial-rollout``: requests in flight at a sync are paused and continued on the new weights. It needs
    the full loop (one-step waits for its generation before syncing) and single generate calls: the embedded
    engine's generate step (a custom generate function is paused inside the ``generate_default`` it calls; one
    that never calls it finishes its call on the old weights, as without the flag) or an HTTP engine's
    requests (aborted and continued from prompt + response so far, as slime does)."""
    from tidal.config.agent_rules import is_multi_turn

    r = ctx.cfg.rollout
    if r.async_mode != "full":
        raise ConfigError(
            "--partial-rollout continues requests in flight at a weight update; --async one-step has none (it syncs "
            "after its generation ended): use --async full or drop the flag"
        )
    if is_multi_turn(ctx.cfg):
        raise ConfigError(
            "--partial-rollout continues single generate calls, not a multi-turn environment (its turns are whole "
            "generate calls); drop it"
        )


def _over_sampling(ctx: Context) -> None:
    r = ctx.cfg.rollout
    if r.over_sampling_batch_size is None:
        if r.async_mode == "off":  # the synchronous loop: one round, dynamic sampling trains what it kept
            return
        ctx.derive("over_sampling_batch_size", r.rollout_batch_size, "async", "one round of rollout-batch-size prompts")
    if r.over_sampling_batch_size < r.rollout_batch_size and not ctx.cfg.algorithm.dynamic_sampling:
        raise ConfigError(
            f"--over-sampling-batch-size {r.over_sampling_batch_size} is below --rollout-batch-size "
            f"{r.rollout_batch_size}; without --dynamic-sampling rounds are whole batches: raise it or drop it"
        )


def _placement(ctx: Context) -> None:
    c, m, mode = ctx.cfg.cluster, ctx.cfg.memory, ctx.cfg.rollout.async_mode
    ranks = c.actor_num_nodes * c.actor_num_gpus_per_node
    if not ctx.explicit("colocate") and c.colocate:
        spare = c.device != "cuda" or c.ray_address is not None or ctx.env.device_count > ranks
        if spare:
            ctx.derive("colocate", False, "async", f"--async {mode}: engines generate on their own devices")
    for name in ("offload", "offload_train", "offload_rollout"):
        value = getattr(m, name)
        if value and ctx.explicit(name):
            raise ConfigError(
                f"--async {mode} with {'--' + name.replace('_', '-')}: engines generate while the trainer trains, so "
                "neither can release its memory; drop the offload flag (the memory plan must fit both resident)"
            )
        if value is not False:
            ctx.derive(name, False, "async", f"--async {mode}: trainer and engines are resident together")


MPS_PRIORITY = "CUDA_MPS_CLIENT_PRIORITY"


def _mps_priority(ctx: Context) -> None:
    c = ctx.cfg.cluster
    if not c.colocate or c.device != "cuda":
        return
    if MPS_PRIORITY in c.train_env_vars or MPS_PRIORITY in ctx.cfg.rollout.rollout_env_vars:
        return
    ctx.derive(
        "train_env_vars",
        {**c.train_env_vars, MPS_PRIORITY: "1"},
        "async",
        f"--async {ctx.cfg.rollout.async_mode} on shared GPUs: under CUDA MPS the engine's kernels go before the trainer's",
    )


def _behaviour_policy(ctx: Context) -> None:
    a = ctx.cfg.algorithm
    if a.use_tis or a.use_rollout_logprobs or ctx.explicit("use_tis"):
        return
    ctx.derive(
        "use_tis", True, "async", "samples come from older weights: the engine's log-probs are the behaviour policy"
    )
