"""Hugging Face <-> Megatron-core weight layout for Llama, Qwen2 and Qwen3: names, fusions and TP shards.

Pure functions over tensors (no process groups, no megatron import), so the whole mapping is
tested on CPU. One ``Entry`` describes one Megatron parameter of one pipeline stage: its name in
``GPTModel.named_parameters()`` (layer indices local to the stage), the Hugging Face tensors it
holds, and how it is laid out:

- ``replicated``: the same tensor on every TP rank (norms, Qwen3's per-head q/k norms);
- ``row``: split along dim 1 (``RowParallelLinear``: ``o_proj``, ``down_proj``);
- ``vocab``: split along dim 0 after padding the vocabulary to a multiple of the TP size
  (``VocabParallelEmbedding`` and the column-parallel output layer); the padded rows are zeros
  and are dropped on the way back (log-probs mask those columns, ``tidal.trainer.megatron.vocab``);
- ``qkv``: Megatron's fused ``linear_qkv`` (weight or Qwen2's bias). Its output rows are grouped
  by key/value head: for each of the ``g`` query groups, that group's ``h/g`` query heads, then
  its key head, then its value head (``head_dim`` rows each), which is how
  ``SelfAttention.get_query_key_value_tensors`` splits it. Column parallelism gives each TP rank
  ``g/tp`` whole groups, so the fused tensor is cut into ``tp`` contiguous pieces;
- ``fc1``: the gated MLP's ``linear_fc1`` = ``[gate; up]`` *per TP shard*: rank ``r`` holds
  ``cat(gate.chunk(tp)[r], up.chunk(tp)[r])`` (Megatron's GLU splits each shard's output in two).

With Transformer Engine's fused layers the two pre-norms live inside the next linear
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); ``te=True`` names them so.
Every conversion is views, ``cat`` and slicing, so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidal.errors import UserError

ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class Arch:
    """The shape facts of a Hugging Face decoder that the layout depends on."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    rope_theta: float
    norm_eps: float
    max_positions: int

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp


def arch_from_hf(config) -> Arch:
    """``Arch`` of a transformers config (Llama, Qwen2, Qwen3); anything else is refused in one line."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UserError(
            f"--train-backend megatron: model type {model_type!r} is not supported; use a Llama, Qwen2 or Qwen3 model "
            "or --train-backend fsdp"
        )
    rope = getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in (None, "default"):
        raise UserError(
            f"--train-backend megatron: rope scaling {rope_type!r} is not mapped; use --train-backend fsdp for this model"
        )
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    if getattr(config, "mlp_bias", False):
        raise UserError("--train-backend megatron: MLP biases are not mapped; use --train-backend fsdp for this model")
    rope_params = getattr(config, "rope_parameters", None) or {}
    theta = getattr(config, "rope_theta", None) or rope_params.get("rope_theta", 10000.0)
    return Arch(
        model_type=model_type,
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        ffn_hidden_size=int(config.intermediate_size),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=int(config.vocab_size),
        qkv_bias=qkv_bias,
        qk_norm=model_type == "qwen3",
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        rope_theta=float(theta),
        norm_eps=float(config.rms_norm_eps),
        max_positions=int(config.max_position_embeddings),
    )


def check_parallel(arch: Arch, tp: int, pp: int) -> None:
    """Refuse TP/PP sizes the layout cannot split (one line naming the flag and the fix)."""
    from tidal.config.megatron_rules import split_problem

    problem = split_problem(
        "the model's", kv_heads=arch.num_kv_heads, ffn=arch.ffn_hidden_size, layers=arch.num_layers, tp=tp, pp=pp
    )
    if problem:
        raise UserError(problem)


@dataclass(frozen=True)
class Entry:
    """One Megatron parameter of one stage and the Hugging Face tensors it holds."""

    megatron: str
    hf: tuple[str, ...]
    kind: str  # replicated | row | vocab | qkv | fc1


def _layer_entries(arch: Arch, local: int, layer: int, te: bool) -> list[Entry]:
    m, h = f"decoder.layers.{local}.", f"model.layers.{layer}."
    attn, mlp = h + "self_attn.", h + "mlp."
    out = [
        Entry(
            m + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"),
            (h + "input_layernorm.weight",),
            "replicated",
        ),
        Entry(
            m + "self_attention.linear_qkv.weight",
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            "qkv",
        ),
    ]
    if arch.qkv_bias:
        out.append(
            Entry(
                m + "self_attention.linear_qkv.bias",
                (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                "qkv",
            )
        )
    if arch.qk_norm:
        out.append(Entry(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated"))
        out.append(Entry(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated"))
    out += [
        Entry(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"),
        Entry(
            m + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"),
            (h + "post_attention_layernorm.weight",),
            "replicated",
        ),
        Entry(m + "mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), "fc1"),
        Entry(m + "mlp.linear_fc2.weight", (mlp + "down_proj.weight",), "row"),
    ]
    return out


def entries(arch: Arch, *, pp_rank: int = 0, pp_size: int = 1, te: bool = False) -> list[Entry]:
    """Every parameter of pipeline stage ``pp_rank`` (even layer split), in ``named_parameters()`` order."""
    per_stage = arch.num_layers // pp_size
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: list[Entry] = []
    if first:
        out.append(Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    for local in range(per_stage):
        out += _layer_entries(arch, local, pp_rank * per_stage + local, te)
    if last:
        out.append(Entry("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
        # Tied: the output layer reads the embedding (on the first stage; with PP > 1 the last stage
        # keeps a copy Megatron keeps equal, which is not an HF tensor of its own).
        if not arch.tied:
            out.append(Entry("output_layer.weight", ("lm_head.weight",), "vocab"))
    return out


def hf_names(arch: Arch) -> list[str]:
    """Every HF parameter name of the model (tied weights once), in layer order."""
    return [n for e in entries(arch) for n in e.hf]


# ---- one entry, HF -> Megatron shard and back ----------------------------------------------------------


def _fuse_qkv(arch: Arch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, (arch.num_heads // g) * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(arch: Arch, fused: torch.Tensor) -> list[torch.Tensor]:
    g, d = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // g
    rest = fused.shape[1:]
    grouped = fused.reshape(g, (per + 2) * d, *rest)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


def to_megatron(
    entry: Entry, get: Callable[[str], torch.Tensor], arch: Arch, tp_rank: int = 0, tp_size: int = 1
) -> torch.Tensor:
    """The TP-rank-local Megatron tensor of ``entry`` from full HF tensors (``get(hf_name)``)."""
    parts = [get(n) for n in entry.hf]
    if entry.kind == "replicated":
        return parts[0]
    if entry.kind == "row":
        return parts[0].chunk(tp_size, dim=1)[tp_rank]
    if entry.kind == "vocab":
        full = parts[0]
        pad = arch.padded_vocab(tp_size) - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros((pad, *full.shape[1:]))])
        return full.chunk(tp_size, dim=0)[tp_rank]
    if entry.kind == "qkv":
        return _fuse_qkv(arch, *parts).chunk(tp_size, dim=0)[tp_rank]
    if entry.kind == "fc1":
        gate, up = parts
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
    raise ValueError(f"unknown layout {entry.kind!r}")


def _cat(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)  # one shard: a view, no copy


def to_hf(entry: Entry, shards: list[torch.Tensor], arch: Arch) -> list[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of ``entry`` from every TP rank's shard (in TP-rank order). With one
    shard the results are views of it (no copy); they may be non-contiguous (the split QKV parts)."""
    if entry.kind == "replicated":
        return [(entry.hf[0], shards[0])]
    if entry.kind == "row":
        return [(entry.hf[0], _cat(shards, dim=1))]
    if entry.kind == "vocab":
        return [(entry.hf[0], _cat(shards)[: arch.vocab_size])]
    if entry.kind == "qkv":
        return list(zip(entry.hf, _split_qkv(arch, _cat(shards))))
    if entry.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(entry.hf[0], _cat([h[0] for h in halves])), (entry.hf[1], _cat([h[1] for h in halves]))]
    raise ValueError(f"unknown layout {entry.kind!r}")


def shard_dim(entry: Entry) -> int | None:
    """The dim along which TP ranks' shards are concatenated (None: replicated)."""
    return {"replicated": None, "row": 1}.get(entry.kind, 0)
