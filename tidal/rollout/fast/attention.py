"""The attention function the fast decode path plugs into transformers' model code.

transformers models call attention through ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
with the layer's query, key and value after RoPE. The decoder registers ``fast_attention`` under
``ATTN_NAME`` and, only while it runs the model (``active``), switches the model config to it and
calls the model without a transformers cache. The function then owns the KV cache:

- prefill (``ctx.decode`` false): writes the prompt's keys/values into cache rows
  ``[ctx.row0, ctx.row0 + rows)``, columns ``[ctx.prefill_from, width)`` (unless ``ctx.kv_written``: the fused
  forward's compiled pieces wrote them), and attends with
  transformers' own SDPA function over the 4-D mask the decoder built (over the cache's columns
  ``[0, width)`` when an earlier part of the prompt was reused from ``tidal.rollout.fast.prefix``),
  with cuDNN's kernel left out (``prefill_kernels``: it would build a graph for every new shape);
- decode: writes the one new key/value of every row at cache column ``ctx.cpos`` (a device tensor,
  so a captured graph reads the current column at replay; unless ``ctx.kv_written``: the fused forward's
  compiled piece wrote them, ``FusedDecodeForward(write_kv=True)``) and attends over the first
  ``ctx.kv_len`` columns of the batch's rows. Grouped-query heads are folded into the query
  length (``[rows, kv_heads, group, dim]``), so each key/value head is read once, never repeated
  ``group`` times in memory; the mask ``[rows, 1, 1, kv_len]`` broadcasts over the group. With
  ``ctx.flex`` set (``--rollout-decode-attention flex``) the same folded query goes to
  FlexAttention over the whole cache row instead, with the step's block mask ``ctx.block_mask``
  (``tidal.rollout.fast.flex_decode``); the 4-D mask the model passes along is then ignored.

Outside ``active`` (no context) the function behaves exactly like transformers' SDPA attention,
so any other forward pass of the same model is unaffected. It is never compiled
(``torch.compiler.disable``): a compiled step keeps it as an eager call between fused parts, because
its in-place writes into a slice of the large cache tensor must stay in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tidal.rollout.fast.flex_decode import FlexDecode
from tidal.rollout.fast.static_cache import StaticKVCache

ATTN_NAME = "tidal_fast_decode"


@dataclass
class AttnContext:
    """What the attention function needs during one forward pass of the decoder."""

    cache: StaticKVCache
    decode: bool
    rows: int  # rows of this forward pass (a batch bucket in decode)
    row0: int = 0  # first cache row (prefill chunks)
    cpos: torch.Tensor | None = None  # [1] int64, the cache column decode writes
    kv_len: int = 0  # columns decode attends to (a static bucket >= cpos + 1)
    prefill_from: int = 0  # prefill: first cache column of this pass (earlier ones hold a reused prefix)
    flex: FlexDecode | None = None  # decode through FlexAttention (kv_len is then the whole cache)
    block_mask: BlockMask | None = None  # the step's block mask, built once per step for every layer
    kv_written: bool = False  # the caller wrote this pass's keys and values already (fused, write_kv)
    origin: torch.Tensor | None = None  # decode: [0, 1] (first row, tokens a row), where fused pieces write (write_kv)


class _Active:
    ctx: AttnContext | None = None


@torch.compiler.disable
def fast_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    ctx = _Active.ctx
    if ctx is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("sliding_window") is not None:
        raise RuntimeError("fast decode: sliding-window attention layers are not supported")
    layer = module.layer_idx
    if not ctx.decode:
        lo, end = ctx.prefill_from, ctx.prefill_from + key.shape[2]
        keys = ctx.cache.keys(layer)[ctx.row0 : ctx.row0 + ctx.rows]
        values = ctx.cache.values(layer)[ctx.row0 : ctx.row0 + ctx.rows]
        if not ctx.kv_written:
            keys[:, :, lo:end].copy_(key)
            values[:, :, lo:end].copy_(value)
        if lo:  # attend to the reused prefix in the cache as well
            key, value = keys[:, :, :end], values[:, :, :end]
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling)
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    k_all = ctx.cache.keys(layer)[:rows]
    v_all = ctx.cache.values(layer)[:rows]
    if not ctx.kv_written:
        k_all.index_copy_(2, ctx.cpos, key)
        v_all.index_copy_(2, ctx.cpos, value)
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    if ctx.flex is not None:
        out = ctx.flex.attend(q, k_all[:, :, : ctx.kv_len], v_all[:, :, : ctx.kv_len], ctx.block_mask, scaling)
        return out.reshape(rows, 1, heads, dim), None
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k_all[:, :, : ctx.kv_len], v_all[:, :, : ctx.kv_len], attn_mask=attention_mask, scale=scaling
    )
    # [rows, kv_heads, group, dim] -> [rows, 1, heads, dim], the layout transformers expects back.
    return out.reshape(rows, 1, heads, dim), None


def current() -> AttnContext | None:
    """The context of the forward pass running now (``active``), or None outside one."""
    return _Active.ctx


_registered = False


def register() -> None:
    """Make ``ATTN_NAME`` known to transformers (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, fast_attention)
        # Mask creation for this name (used only if a 2-D mask ever reaches it) is SDPA's.
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
        _registered = True


# The prefill's SDPA kernels, cuDNN's left out: cuDNN builds an execution graph for every new shape (tens of
# milliseconds on the host, the device idle meanwhile) and a prefill's shape (the chunk's distinct prompts by
# its longest prompt) is new at almost every rollout. The memory-efficient kernel takes the 4-D mask with no
# per-shape set-up (flash, first in the list, takes no mask: it serves a maskless call); math is the fallback.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def prefill_kernels() -> contextlib.AbstractContextManager:
    """The SDPA kernels a prefill forward may use (``PREFILL_BACKENDS``); the decode step's are not limited."""
    return sdpa_kernel(PREFILL_BACKENDS)


@contextlib.contextmanager
def active(model: torch.nn.Module, ctx: AttnContext) -> Iterator[None]:
    """Run the model's attention through ``fast_attention`` with ``ctx``, then restore everything."""
    register()
    config = model.config
    before = config._attn_implementation
    _Active.ctx = ctx
    config._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        config._attn_implementation = before
        _Active.ctx = None


def check_supported(model: torch.nn.Module) -> str | None:
    """Why the fast path cannot run this model, or None when it can."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))}: only full attention is supported"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention is not supported"
    attn = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
    if len(attn) != cfg.num_hidden_layers:
        return f"found {len(attn)} attention modules with a layer_idx for {cfg.num_hidden_layers} layers"
    return None
