"""Resolution rules of memory and weight sync: offload decisions, the memory plan, host backups, transports.

Plain functions over ``tidal.config.validate.Context``; ``validate`` registers them in its ordered
rule list (after the cluster rule, before the batch rule), so they run in the one resolve pass and
appear in docs/configuration.md with their ids and summaries. Each raises ``ConfigError`` with one
line: the flags involved and the fix. Kept apart from ``validate`` so that module stays the pass
itself and the rules of devices, cluster, batch and algorithm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.config.args import flag_of
from tidal.config.environment import format_bytes
from tidal.config.plan import choose_offload, describe_combo
from tidal.errors import ConfigError

if TYPE_CHECKING:
    from tidal.config.validate import Context


def _f(name: str) -> str:
    return flag_of(name)


def offload_needs_colocate(ctx: Context) -> None:
    c, m = ctx.cfg.cluster, ctx.cfg.memory
    if c.colocate:
        return
    for name in ("offload_train", "offload_rollout"):
        value = getattr(m, name)
        if value:
            raise ConfigError(
                f"{_f(name)} needs --colocate: with separate devices nothing waits for the memory; drop it"
            )
        if value is None:
            ctx.derive(name, False, "offload-needs-colocate", "not colocated")


def offload_needed(ctx: Context) -> None:
    m = ctx.cfg.memory
    plan = ctx.plan()
    if ctx.cfg.rollout.debug_rollout_only:
        fits = plan.combo(False, False).generate_bytes <= plan.budget  # engines only: no trainer is started
        train, rollout = m.offload_train, m.offload_rollout
    elif not ctx.cfg.cluster.colocate:
        fits = plan.fits(False, False)
        train, rollout = m.offload_train, m.offload_rollout
    else:
        train, rollout, fits = choose_offload(plan, m.offload_train, m.offload_rollout)
        chosen = plan.combo(train, rollout)
        for name, value in (("offload_train", train), ("offload_rollout", rollout)):
            if getattr(m, name) is None:
                verdict = "needed" if value else "not needed"
                ctx.derive(name, value, "offload-needed", f"{verdict}: {describe_combo(plan, chosen)}")
    if not fits and m.check_memory_plan:
        combo = plan.combo(bool(train), bool(rollout))
        chosen = f"offload-train {'on' if train else 'off'}, offload-rollout {'on' if rollout else 'off'}"
        raise ConfigError(
            f"memory plan does not fit with {chosen} ({describe_combo(plan, combo)}); add devices, lower --rollout-batch-size "
            "or --rollout-max-response-len (engine KV), use --gradient-checkpointing or a lower --max-tokens-per-gpu, "
            "or pass --no-check-memory-plan if the estimate is wrong (see `tidal explain`)"
        )


def host_memory(ctx: Context) -> None:
    m = ctx.cfg.memory
    if m.offload_host_memory is None:
        policy, why = _host_policy(ctx)
        ctx.derive("offload_host_memory", policy, "host-memory", why)
    if m.offload_host_memory == "disk" and not m.offload_disk_dir:
        raise ConfigError("--offload-host-memory disk needs --offload-disk-dir (a fast local folder)")
    if m.offload_disk_dir and m.offload_host_memory != "disk":
        raise ConfigError(
            "--offload-disk-dir is only used with --offload-host-memory disk; add that flag or drop the folder"
        )
    if ctx.cfg.cluster.device != "cuda" or not m.offload_train or not m.check_memory_plan:
        return  # on CPU the backup lives in the same memory as the tensor it replaces
    plan = ctx.plan()
    need = plan.host_paused(True, m.offload_host_memory)
    if need > plan.host_budget:
        raise ConfigError(
            f"--offload-train: paused trainer state needs {format_bytes(need)} of host memory per node, {format_bytes(plan.host_budget)} usable; "
            "use --offload-host-memory disk --offload-disk-dir DIR, or more trainer nodes"
        )


def resume_early(ctx: Context) -> None:
    m, c = ctx.cfg.memory, ctx.cfg.cluster
    asked = m.train_resume_early
    if asked not in (None, "off") and not m.offload_train:
        raise ConfigError(
            f"--train-resume-early {asked} needs --offload-train (a trainer that never pauses never resumes); drop it"
        )
    fits, room = _resume_early_room(ctx) if m.offload_train and c.colocate else ("off", "the trainer never pauses")
    if asked is None:
        # The weights where they fit, on GPU: their copy back left the step in two H200 runs (resume 0.085 ->
        # 0.035 s, the generate beside it 0.003-0.005 s slower); all of the state did not (the generate slowed
        # as much as the resume saved), so it stays opt-in. On CPU the host is the device: nothing to hide.
        gpu = c.device == "cuda"
        pick = "weights" if fits != "off" and gpu else "off"
        if fits == "off":
            note = ""
        elif gpu:
            note = "; so weights (all is opt-in)" if fits == "all" else "; so weights"
        else:
            note = "; off on CPU (the host is the device)"
        ctx.derive("train_resume_early", pick, "resume-early", room + note)
        return
    order = ("off", "weights", "all")
    if order.index(asked) > order.index(fits) and c.device == "cuda" and m.check_memory_plan:
        raise ConfigError(
            f"--train-resume-early {asked}: the memory plan does not fit it beside the generate phase ({room}); "
            f"use {' or '.join(order[: order.index(fits) + 1][::-1])}, or --no-check-memory-plan if the estimate is wrong"
        )


def _resume_early_room(ctx: Context) -> tuple[str, str]:
    """What of the trainer fits beside the generate phase in the plan: all, weights or off, and the figures."""
    plan = ctx.plan()
    t, generate = plan.trainer_per_device, plan.combo(True, bool(ctx.cfg.memory.offload_rollout)).generate_bytes
    unit = "GPU" if plan.device == "cuda" else "host"
    room = f"of {format_bytes(plan.budget)} usable per {unit}"
    if generate + t * plan.trainer_static <= plan.budget:
        return (
            "all",
            f"all fits: generate {format_bytes(generate + t * plan.trainer_static)} with the trainer's state {room}",
        )
    if generate + t * plan.trainer["weights"] <= plan.budget:
        weights = format_bytes(generate + t * plan.trainer["weights"])
        return "weights", f"the weights fit: generate {weights} with the trainer's weights {room}"
    return "off", f"nothing fits: generate {format_bytes(generate)} {room}"


def _host_policy(ctx: Context) -> tuple[str, str]:
    """retain when the pinned backups leave at least half of the host budget to everything else, else release."""
    if ctx.cfg.cluster.device != "cuda":
        return "release", "CPU: the device is the host, there is nothing to keep pinned"
    if not ctx.cfg.memory.offload_train:
        return "retain", "the trainer never pauses: no backups to hold"
    plan = ctx.plan()
    need = plan.host_paused(True, "retain")
    share = f"backups {format_bytes(need)} per node of {format_bytes(plan.host_budget)} usable host memory"
    if need * 2 <= plan.host_budget:
        return "retain", f"{share}: room to keep them pinned"
    return "release", f"{share}: too much to keep pinned between pauses"


def train_env_vars(ctx: Context) -> None:
    env_vars = ctx.cfg.cluster.train_env_vars
    for flag, env in (("--train-env-vars", env_vars), ("--rollout-env-vars", ctx.cfg.rollout.rollout_env_vars)):
        for key, value in env.items():
            if not isinstance(value, str):
                raise ConfigError(f'{flag}: value of {key} must be a string (write "{value}" in quotes)')
    if ctx.cfg.memory.memory_backend != "tms":
        return
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:true" in env_vars.get(key, "").replace(" ", "").lower():
            raise ConfigError(
                f"--train-env-vars: torch_memory_saver cannot pause memory of {key}=expandable_segments:True; remove it or use --memory-backend portable"
            )
    ub = env_vars.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "0").lower()
    if ctx.cfg.memory.offload_train and ub in ("1", "true"):
        raise ConfigError(
            "--train-env-vars: NCCL user buffers (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1) cannot live in paused memory; unset it or drop --offload-train"
        )


def transport(ctx: Context) -> None:
    w, colocate = ctx.cfg.weight_sync, ctx.cfg.cluster.colocate
    if w.update_weight_transport is None:
        value, why = (
            ("tensor", "colocated: in-process hand-over") if colocate else ("broadcast", "not colocated: process group")
        )
        ctx.derive("update_weight_transport", value, "transport", why)
    elif w.update_weight_transport == "nccl":
        ctx.derive("update_weight_transport", "broadcast", "transport", "nccl is slime's name for broadcast")
    if w.update_weight_transport == "tensor" and not colocate and not ctx.cfg.rollout.debug_rollout_only:
        raise ConfigError(
            "--update-weight-transport tensor needs --colocate (hand-over within a device); use broadcast or disk"
        )
    if w.update_weight_transport == "disk" and not w.update_weight_disk_dir:
        raise ConfigError(
            "--update-weight-transport disk needs --update-weight-disk-dir (a folder every engine can read)"
        )
    if w.update_weight_disk_dir and w.update_weight_transport != "disk":
        raise ConfigError(
            "--update-weight-disk-dir is only used with --update-weight-transport disk; add that flag or drop the folder"
        )


def delta(ctx: Context) -> None:
    w = ctx.cfg.weight_sync
    delta_disk = w.update_weight_mode == "delta" and w.update_weight_transport == "disk"
    if delta_disk and not w.update_weight_local_checkpoint_dir:
        raise ConfigError(
            "--update-weight-mode delta over disk needs --update-weight-local-checkpoint-dir (a per-host folder where engines apply deltas)"
        )
    if delta_disk and w.update_weight_compression != "zstd":
        raise ConfigError(
            "--update-weight-compression none: delta over disk writes slime's stream, which is always zstd; drop the flag"
        )
    if delta_disk and w.update_weight_checksum == "none":
        raise ConfigError(
            "--update-weight-checksum none: delta over disk writes slime's stream, which checksums every changed tensor; "
            "use xxh3-128, blake3 or adler32"
        )
    if w.update_weight_local_checkpoint_dir and not delta_disk:
        raise ConfigError(
            "--update-weight-local-checkpoint-dir is only used with --update-weight-mode delta --update-weight-transport disk; drop it"
        )
