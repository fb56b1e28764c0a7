"""One decode call of the fast path's attention function, as the decoder's step makes it (CPU and GPU tests)."""

from __future__ import annotations

import torch

from tidal.model.load import ModelSpec
from tidal.rollout.fast import attention
from tidal.rollout.fast.flex_decode import FlexDecode


def gqa7(head_dim: int, max_positions: int = 256) -> ModelSpec:
    """Qwen2.5-0.5B's head layout (14 query heads on 2 KV heads: a group of 7, not a power of two) at a tiny
    width: ``head_dim`` 8 on CPU; on CUDA at least 16, the smallest FlexAttention's compiled kernels take."""
    return ModelSpec(
        name=f"tiny-gqa7-hd{head_dim}",
        arch="qwen2",
        config_kwargs=dict(
            vocab_size=64,
            hidden_size=14 * head_dim,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
            tie_word_embeddings=True,
        ),
    )


class _Layer(torch.nn.Module):
    layer_idx = 1


def decode_attention_call(flex: FlexDecode | None, cache, query, key, value, start, cpos, kv_len, scale=0.3):
    """``attention.fast_attention`` in decode mode at cache column ``cpos`` (a ``[1]`` device tensor):
    with ``flex`` None the SDPA path over ``kv_len`` columns and its additive mask, else FlexAttention
    with the step's block mask. ``start``: ``[rows]`` first real column of each row."""
    rows, heads = query.shape[:2]
    kv_heads = key.shape[1]
    if flex is None:
        col = torch.arange(kv_len, device=query.device)
        valid = (col[None] >= start[:rows, None]) & (col[None] <= cpos)
        mask = torch.zeros(rows, 1, 1, kv_len, dtype=query.dtype, device=query.device)
        mask.masked_fill_(~valid[:, None, None], float("-inf"))
        block_mask = None
    else:
        mask = torch.zeros(rows, 1, 1, 1, dtype=query.dtype, device=query.device)
        block_mask = flex.mask(start, cpos, rows, heads // kv_heads, kv_len)
    ctx = attention.AttnContext(
        cache=cache, decode=True, rows=rows, cpos=cpos, kv_len=kv_len, flex=flex, block_mask=block_mask
    )
    attention._Active.ctx = ctx
    try:
        out, _ = attention.fast_attention(_Layer(), query, key, value, mask, scaling=scale)
    finally:
        attention._Active.ctx = None
    return out
