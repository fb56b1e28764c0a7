"""The static KV cache of the fast decode path, and how big it may be.

One tensor holds every layer's keys and values, ``[layers, 2, rows, kv_heads, max_len, head_dim]``.
It is allocated once, so its address never changes while it lives: a CUDA graph captured against it
stays valid across calls (and across a pause/resume that keeps virtual addresses, as
torch_memory_saver does). Why not transformers' ``StaticCache``: the decoder needs the *prefix* of
its rows (``rows[:bucket]``) to be a view with a fixed address for every batch bucket, and it moves
the rows that are still decoding into that prefix when others finish (compaction); one tensor
with rows in the third dimension gives both for free.

Every row of a batch decodes at the same cache column (prompts are left-padded), so one column
index serves the whole batch and the columns a step may attend to are a prefix of the row.

``plan_rows`` turns a memory budget into the number of rows the cache holds, counting the decode
workspace (logits, sampling noise) that scales with the rows too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.errors import UserError


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the cache, from the model config."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token across all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * (torch.finfo(self.dtype).bits // 8)


def kv_shape(config, dtype: torch.dtype) -> KVShape:
    """The cache shape of a transformers text config (llama / qwen2 / qwen3 style attention)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return KVShape(layers=cfg.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)


def workspace_bytes_per_row(config, dtype: torch.dtype, max_len: int) -> int:
    """Decode-step memory that scales with the batch: logits, their fp32 copy, sampling noise, outputs.

    A decode step holds the model-dtype logits, one fp32 copy (log-sum-exp and sampling read it),
    the exponential noise and one fp32 temporary: about ``vocab * (elem + 12)`` bytes per row. The
    per-row output buffers (token ids and log-probs) add ``12`` bytes per position.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    elem = torch.finfo(dtype).bits // 8
    per_step = cfg.vocab_size * (elem + 12) + cfg.hidden_size * 16 * elem
    inter = getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
    return per_step + inter * 3 * elem + max_len * 12


def prefill_workspace_bytes(config, dtype: torch.dtype, prefill_tokens: int) -> int:
    """Activations of one prefill chunk of ``prefill_tokens`` tokens (eager, freed after the chunk)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    elem = torch.finfo(dtype).bits // 8
    inter = getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
    return prefill_tokens * (cfg.hidden_size * 8 + inter * 3) * elem


def plan_rows(
    *,
    budget_bytes: int,
    shape: KVShape,
    max_len: int,
    per_row_workspace: int,
    fixed_bytes: int,
    max_batch: int,
) -> int:
    """Rows of cache that fit ``budget_bytes`` after ``fixed_bytes`` (weights, prefill workspace).

    Raises ``UserError`` when not even one row fits, naming the budget and the sequence length.
    """
    per_row = shape.bytes_per_token * max_len + per_row_workspace
    room = budget_bytes - fixed_bytes
    rows = min(max_batch, room // per_row) if room > 0 else 0
    if rows < 1:
        raise UserError(
            f"rollout memory budget of {budget_bytes / 2**30:.2f} GiB leaves {max(room, 0) / 2**30:.2f} GiB after "
            f"weights and workspace, less than one sequence of {max_len} tokens needs ({per_row / 2**30:.3f} GiB); "
            "raise --rollout-mem-fraction or lower --rollout-max-response-len / --rollout-max-prompt-len"
        )
    return int(rows)


class StaticKVCache:
    """Keys and values of ``rows`` sequences of up to ``max_len`` tokens, at a fixed address.

    ``keys(layer)`` / ``values(layer)`` are ``[rows, kv_heads, max_len, head_dim]`` views; a batch
    bucket uses their first ``bucket`` rows.
    """

    def __init__(self, shape: KVShape, rows: int, max_len: int, device: torch.device | str) -> None:
        self.shape = shape
        self.rows = rows
        self.max_len = max_len
        # Zeroed, not empty: masked-out columns still pass through ``softmax @ V`` with weight 0,
        # and ``0 * NaN`` from uninitialised memory would poison real rows.
        self.buf = torch.zeros(
            (shape.layers, 2, rows, shape.kv_heads, max_len, shape.head_dim), dtype=shape.dtype, device=device
        )

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    def keys(self, layer: int) -> torch.Tensor:
        return self.buf[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.buf[layer, 1]

    def zero_(self, rows: int | None = None, cols: int | None = None) -> None:
        """Clear the first ``rows`` rows and ``cols`` columns (after a resume the memory holds arbitrary bytes)."""
        self.buf[:, :, :rows, :, :cols].zero_()

    def compact(self, index: torch.Tensor, upto: int) -> None:
        """Move rows ``index`` (ascending) to the front, keeping columns ``[0, upto)``.

        One layer at a time, so the temporary copy is one layer's rows, not the whole cache.
        """
        n = int(index.numel())
        for layer in range(self.shape.layers):
            part = self.buf[layer, :, :, :, :upto]
            part[:, :n].copy_(part.index_select(1, index))


def plan_cache(config, dtype, shape, budget: int, max_len: int, prefill_tokens: int, max_batch: int) -> dict:
    """How a decoder's budget of ``budget`` bytes splits: rows, cache bytes, workspace estimate."""
    per_row_ws = workspace_bytes_per_row(config, dtype, max_len)
    fixed = prefill_workspace_bytes(config, dtype, prefill_tokens)
    rows = plan_rows(
        budget_bytes=budget,
        shape=shape,
        max_len=max_len,
        per_row_workspace=per_row_ws,
        fixed_bytes=fixed,
        max_batch=max_batch,
    )
    return {
        "budget_bytes": budget,
        "rows": rows,
        "max_seq_len": max_len,
        "kv_bytes": rows * max_len * shape.bytes_per_token,
        "workspace_bytes": rows * per_row_ws + fixed,
    }
