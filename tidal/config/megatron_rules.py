"""Resolution rules of the Megatron-core backend and of the gradient-buffer backup (the seed's policy).

Plain functions over ``tidal.config.validate.Context``, registered in ``validate``'s ordered rule
list: ``megatron`` after the cluster rule (it needs the trainer ranks), ``grad_buffers`` after the
offload rules (it needs ``offload_train``). Each raises ``ConfigError`` with one line.

The gradient-buffer rule is slime's seed PR #1924: under ``--offload-train`` a paused trainer's
gradient buffers are released without a host backup (``disable_grad_buffers_cpu_backup``), since
every step zeroes them first; NCCL user buffers (``--use-nccl-ub``) are allocated from NCCL's own
pool, cannot live in such a region, and are refused together with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.errors import ConfigError

if TYPE_CHECKING:
    from tidal.config.validate import Context

_PARALLEL = (
    ("tensor_model_parallel_size", 1),
    ("pipeline_model_parallel_size", 1),
    ("context_parallel_size", 1),
    ("sequence_parallel", False),
    ("use_distributed_optimizer", False),
    ("use_nccl_ub", False),
    ("transformer_impl", None),
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def megatron(ctx: Context) -> None:
    t, c = ctx.cfg.trainer, ctx.cfg.cluster
    if t.train_backend != "megatron":
        for name, default in _PARALLEL:
            if getattr(t, name) != default:
                raise ConfigError(f"{_flag(name)} is a Megatron option; add --train-backend megatron or drop it")
        return
    _transformer_impl(ctx)
    if ctx.cfg.rollout.debug_rollout_only:
        return  # no trainer is started
    if c.device != "cuda":
        raise ConfigError(
            "--train-backend megatron needs CUDA (Megatron-core's forward and DistributedDataParallel run on GPUs "
            "only); use --train-backend fsdp on CPU"
        )
    if not ctx.env.megatron_available:
        raise ConfigError("--train-backend megatron: megatron-core is not installed; pip install 'tidal[megatron]'")
    tp, pp, cp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.context_parallel_size
    if cp != 1:
        raise ConfigError(
            f"--context-parallel-size {cp}: the megatron backend packs padded micro-batches and does not split "
            "sequences yet; use 1 (tensor or pipeline parallelism for long sequences)"
        )
    if t.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel splits over tensor-parallel ranks; add --tensor-model-parallel-size > 1")
    if t.sequence_parallel and t.transformer_impl == "local" and not ctx.env.apex_available:
        raise ConfigError(
            "--sequence-parallel with --transformer-impl local needs apex (Megatron's local layer spec normalises "
            "with torch's norm otherwise, which cannot split the sequence); install transformer_engine or apex, "
            "or drop --sequence-parallel"
        )
    ranks = c.actor_num_nodes * c.actor_num_gpus_per_node
    if ranks % (tp * pp):
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} does not divide the {ranks} "
            "trainer ranks; use sizes whose product divides --actor-num-nodes x --actor-num-gpus-per-node"
        )
    if ctx.cfg.algorithm.use_critic:
        raise ConfigError(
            "--advantage-estimator ppo trains a critic, which the megatron backend does not have; use --train-backend fsdp"
        )
    shape = ctx.shape()
    problem = split_problem(
        f"{shape.name}'s", kv_heads=shape.kv_heads, ffn=shape.intermediate, layers=shape.layers, tp=tp, pp=pp
    )
    if problem:
        raise ConfigError(problem)


def split_problem(model: str, *, kv_heads: int, ffn: int, layers: int, tp: int, pp: int) -> str | None:
    """Why tensor-parallel size ``tp`` x pipeline size ``pp`` cannot split the model (one line naming the flag
    and the fix; ``model`` names it, e.g. "tiny's"), or None. Query heads are a multiple of the key-value
    heads, so dividing those divides both. The config rule and the trainer (built without one) both ask."""
    if kv_heads % tp or ffn % tp:
        return (
            f"--tensor-model-parallel-size {tp} does not divide {model} {kv_heads} key-value heads and MLP width "
            f"{ffn}; use a divisor of both"
        )
    if layers % pp:
        return f"--pipeline-model-parallel-size {pp} does not divide {model} {layers} layers; use a divisor"
    return None


def _transformer_impl(ctx: Context) -> None:
    """Transformer Engine's layer spec when it is installed, Megatron's local spec otherwise."""
    t, has_te = ctx.cfg.trainer, ctx.env.transformer_engine_available
    if t.transformer_impl is None:
        why = "transformer_engine is installed" if has_te else "transformer_engine is not installed"
        ctx.derive("transformer_impl", "transformer_engine" if has_te else "local", "megatron", why)
    elif t.transformer_impl == "transformer_engine" and not has_te:
        raise ConfigError(
            "--transformer-impl transformer_engine: transformer_engine is not installed; install it or use "
            "--transformer-impl local"
        )


def grad_buffers(ctx: Context) -> None:
    m, t = ctx.cfg.memory, ctx.cfg.trainer
    offload = bool(m.offload_train)
    value = m.disable_grad_buffers_cpu_backup
    if value is None:
        why = "--offload-train: gradients are zeroed before every step" if offload else "the trainer never pauses"
        ctx.derive("disable_grad_buffers_cpu_backup", offload, "grad-buffers", why)
    elif value != offload:
        raise ConfigError(
            f"--{'' if value else 'no-'}disable-grad-buffers-cpu-backup contradicts offload-train "
            f"{'on' if offload else 'off'}: it follows from --offload-train (gradients are zeroed before every step); drop it"
        )
    if t.use_nccl_ub and offload:
        raise ConfigError(
            "--use-nccl-ub: NCCL user buffers come from NCCL's pool and cannot be paused without backup under "
            "--offload-train; drop one of the two"
        )
