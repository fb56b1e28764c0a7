"""Megatron-core's ``GPTModel`` for one pipeline stage, from a Hugging Face config, filled from HF tensors.

``transformer_config`` turns the HF shape (``tidal.trainer.megatron.mapping.Arch``) and the
parallelism flags into Megatron's ``TransformerConfig``: RMSNorm, SwiGLU (``gated_linear_unit``
with SiLU), no linear biases except Qwen2's QKV bias, Qwen3's q/k norms (``qk_layernorm``), RoPE
with the model's theta, grouped-query attention (``num_query_groups``), dropout off. Parameters are
fp32 (the master weights, as in the FSDP backend); the forward runs under bf16 autocast
(``enable_autocast``, which Megatron's schedules apply), so gradients accumulate into fp32 main
grads in the DDP buffers. The layer spec is Transformer Engine's when it imports, else Megatron's
local spec (plain PyTorch layers): ``choose_transformer_impl``, ``--transformer-impl``.

Nothing here needs CUDA: with ``cpu_init`` the stage builds on the host (over a gloo process group),
which is how the CI tests check the mapping against Megatron's own parameter names and shapes.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidal.errors import UserError
from tidal.trainer.megatron.mapping import Arch, Entry, entries, to_megatron

INSTALL_HINT = "pip install 'tidal[megatron]'"


def megatron_available() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def require_megatron() -> None:
    if not megatron_available():
        raise UserError(f"--train-backend megatron: megatron-core is not installed; {INSTALL_HINT}")


@functools.cache
def transformer_engine_importable() -> bool:
    """Whether Transformer Engine's PyTorch layers import here (installed is not enough: its CUDA libraries load)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or OSError from a missing CUDA library
        return False
    return True


def choose_transformer_impl(
    requested: str | None, importable: Callable[[], bool] = transformer_engine_importable
) -> str:
    """The layer spec to build: ``requested`` (``--transformer-impl``, derived by the config from what is
    installed), or when unset Transformer Engine's if it imports, else Megatron's local one."""
    if requested is None:
        return "transformer_engine" if importable() else "local"
    if requested == "transformer_engine" and not importable():
        raise UserError(
            "--transformer-impl transformer_engine: transformer_engine does not import on this machine; "
            "fix its installation or use --transformer-impl local"
        )
    return requested


@dataclass(frozen=True)
class Parallel:
    """The parallel layout of the trainer's ranks (Megatron's order: TP fastest, then CP, DP, PP)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    nccl_ub: bool = False

    @classmethod
    def from_trainer(cls, t) -> Parallel:
        return cls(
            tp=t.tensor_model_parallel_size,
            pp=t.pipeline_model_parallel_size,
            cp=t.context_parallel_size,
            sequence_parallel=t.sequence_parallel,
            distributed_optimizer=t.use_distributed_optimizer,
        )


def transformer_config(
    arch: Arch, par: Parallel, *, cpu_init: bool = False, recompute: bool = False, autocast: bool = True
):
    """Megatron's ``TransformerConfig`` for ``arch`` under ``par``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = {}
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if par.pp > 1:
        # Rows differ in length between micro-batches; stages exchange shapes first.
        kw.update(variable_seq_lengths=True, pipeline_dtype=torch.float32, moe_token_dispatcher_type="alltoall")
    if autocast:
        kw.update(enable_autocast=True, autocast_dtype=torch.bfloat16)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp,
        sequence_parallel=par.sequence_parallel,
        params_dtype=torch.float32,
        use_cpu_initialization=cpu_init,
        perform_initialization=False,  # every weight is loaded from the HF tensors
        **kw,
    )


def layer_spec(arch: Arch, te: bool):
    """Transformer Engine's layer spec when ``te``, else Megatron's local (PyTorch) spec."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    return specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")


def build_stage(arch: Arch, config, spec, *, tp: int, pp_rank: int, pp_size: int):
    """The ``GPTModel`` of pipeline stage ``pp_rank`` (embedding on the first, output layer on the last)."""
    from megatron.core.models.gpt import GPTModel

    stage = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.padded_vocab(tp),
        max_sequence_length=arch.max_positions,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tied,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
    )
    mark_tensor_parallel(stage)
    return stage


def mark_tensor_parallel(stage) -> int:
    """Give each tensor-parallel weight Megatron's attributes (``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride``) where missing; returns how many were missing.

    Megatron-core before 0.19 sets them only while initialising a weight, and tidal builds with
    ``perform_initialization=False`` (every weight comes from the HF tensors): the sharded weights then
    looked replicated, so the gradient norm, and the clipping by it, counted tensor-parallel rank 0's
    shard of each weight only. 0.19 sets them either way; this does what it does (fc1 holds gate and up
    interleaved per rank: stride 2)."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    marked = 0
    for name, module in stage.named_modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        set_tensor_model_parallel_attributes(weight, True, dim, 2 if name.endswith("linear_fc1") else 1)
        marked += 1
    return marked


def stage_parameters(
    model, arch: Arch, *, pp_rank: int, pp_size: int, te: bool
) -> list[tuple[Entry, torch.nn.Parameter]]:
    """Each mapped entry of the stage with its live parameter; refuses a model with parameters the mapping lacks."""
    params = dict(model.named_parameters())
    out = []
    for e in entries(arch, pp_rank=pp_rank, pp_size=pp_size, te=te):
        if e.megatron not in params:
            raise RuntimeError(f"Megatron model has no parameter {e.megatron}; the layout mapping is out of date")
        out.append((e, params.pop(e.megatron)))
    params.pop("output_layer.weight", None)  # tied with PP > 1: the last stage's copy of the embedding
    if params:
        raise RuntimeError(f"Megatron parameters without an HF mapping: {', '.join(sorted(params))}")
    return out


def load_hf(
    model,
    arch: Arch,
    get: Callable[[str], torch.Tensor],
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    te: bool,
) -> None:
    """Copy the HF tensors ``get(name)`` into the stage's parameters (this TP rank's shards)."""
    with torch.no_grad():
        for e, p in stage_parameters(model, arch, pp_rank=pp_rank, pp_size=pp_size, te=te):
            p.copy_(to_megatron(e, get, arch, tp_rank, tp_size))
        out = dict(model.named_parameters()).get("output_layer.weight")
        if arch.tied and out is not None:  # PP > 1: the last stage starts from the embedding
            emb = Entry("output_layer.weight", ("model.embed_tokens.weight",), "vocab")
            out.copy_(to_megatron(emb, get, arch, tp_rank, tp_size))
