"""Parameter counts of the decoder families tidal ships presets for, from the config's numbers alone.

The memory plan needs a model's size before anything starts. Building the model on the ``meta``
device answers for any architecture but imports transformers and torch (2-4 s of a 2-core host,
on the driver, before Ray starts); for Llama, Qwen2 and Qwen3 configs, the families of the presets
and of SmolLM2, the count is a sum over the tensors their transformers modules create:

    embed_tokens [vocab, hidden]; lm_head [vocab, hidden] unless tied; norm [hidden]
    per layer:   q_proj [heads*head_dim, hidden], k_proj and v_proj [kv*head_dim, hidden],
                 o_proj [hidden, heads*head_dim], gate_proj and up_proj [inter, hidden],
                 down_proj [hidden, inter], input_layernorm and post_attention_layernorm [hidden];
                 biases: Llama's q/k/v/o with ``attention_bias`` and gate/up/down with ``mlp_bias``,
                 Qwen2's q/k/v always, Qwen3's q/k/v/o with ``attention_bias``;
                 Qwen3 adds q_norm and k_norm [head_dim]

Missing keys take the defaults of transformers' config classes (``tests/unit/test_model_shape.py``
builds each preset and each family's defaults on ``meta`` and compares every figure). Any other
``model_type`` returns None and the caller builds on ``meta``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Qwen2's and Qwen3's config defaults (Qwen3 adds its head_dim).
_QWEN = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
)
# model_type -> (class name, defaults that differ between families).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaForCausalLM",
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32),
    ),
    "qwen2": ("Qwen2ForCausalLM", _QWEN),
    "qwen3": ("Qwen3ForCausalLM", {**_QWEN, "head_dim": 128}),
}


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan knows of a model: its size and the dimensions that size its caches."""

    name: str
    arch: str
    params: int  # unique parameters (tied weights once)
    num_tensors: int
    largest_tensor: int  # elements
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of_tensors(cls, name: str, arch: str, sizes: list[int], **dims: int) -> ModelShape:
        """The shape from the element counts of a model's unique tensors and its ``dims`` (layers ... head_dim)."""
        return cls(name=name, arch=arch, params=sum(sizes), num_tensors=len(sizes), largest_tensor=max(sizes), **dims)


def count_decoder(model_type: str, config: dict[str, Any], name: str = "") -> ModelShape | None:
    """The shape of a Llama/Qwen2/Qwen3 causal LM from its config values; None for other families."""
    if model_type not in FAMILIES or config.get("architectures") not in (None, [FAMILIES[model_type][0]]):
        return None
    arch, defaults = FAMILIES[model_type]
    c = {**defaults, **{k: v for k, v in config.items() if v is not None}}
    hidden, inter, vocab, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    q, k = heads * head_dim, kv * head_dim
    layer = [q * hidden, k * hidden, k * hidden, hidden * q, inter * hidden, inter * hidden, hidden * inter]
    layer += [hidden, hidden]
    if model_type == "qwen2":
        layer += [q, k, k]
    elif c.get("attention_bias", False):
        layer += [q, k, k, hidden]
    if model_type == "llama" and c.get("mlp_bias", False):
        layer += [inter, inter, hidden]
    if model_type == "qwen3":
        layer += [head_dim, head_dim]
    tied = bool(c.get("tie_word_embeddings", False))
    tensors = [vocab * hidden, hidden] + ([] if tied else [vocab * hidden]) + layer * layers
    dims = dict(layers=layers, hidden=hidden, intermediate=inter, vocab=vocab, kv_heads=kv, head_dim=head_dim)
    return ModelShape.of_tensors(name, arch, tensors, **dims)
