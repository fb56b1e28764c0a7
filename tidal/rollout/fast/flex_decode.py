"""Decode attention through PyTorch's FlexAttention: each row reads only the KV blocks it has written.

The SDPA decode path (``tidal.rollout.fast.attention``) attends over a static KV length, the
written columns rounded up to ``kv_block``, with an additive mask of that length: every row reads
up to ``kv_block - 1`` columns it does not need, and each KV-length bucket is its own CUDA graph.
FlexAttention's decoding kernel (short queries, split-KV) takes a ``BlockMask`` instead: per row,
how many KV blocks to visit and which (``kv_num_blocks``, ``kv_indices``), plus a ``mask_mod`` for
the columns inside them. ``decode_blocks`` builds those lists on the device from the decoder's state
(each slot's first real column, the column written this step), once per step, so a captured graph
reads the current lengths at every replay. The attended length is then the whole cache: one graph
per batch bucket serves every length, and the kernel stops at each row's last written block.

Layout: the cache's ``[rows, kv_heads, max_len, head_dim]`` as it is, and grouped-query heads folded
into the query length (``[rows, kv_heads, group, head_dim]``) as on the SDPA path. The kernel then
sees plain multi-head attention with a query length of ``group``; FlexAttention's own GQA handling
in its decoding kernel takes only power-of-two groups, and Qwen2.5-0.5B's group is 7.

Running it: on CUDA ``flex_attention`` goes through ``torch.compile`` (``dynamic=False``: the
decoding kernel needs a static batch, so each batch bucket compiles once; the recompile limit is
raised around the call for that). Elsewhere it runs eagerly, FlexAttention's reference
implementation: it applies ``mask_mod`` to every column and ignores the block lists, which have
their own test.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 64  # KV columns per sparse block: what a row reads past its last written column is < BLOCK
_Q_BLOCK = 128  # the query side is one block (the query length is the GQA group, < 128)
RECOMPILES = 64  # one compile per batch bucket (up to 16 for 512 rows), with room to spare
# What the decode mask guarantees, told to the kernel: each row's blocks are consecutive
# (``decode_blocks``), so the next one is the current one plus one, without reading the list.
# (ROWS_GUARANTEED_SAFE is left off: a kernel tile smaller than a block may start in a row's padding.)
KERNEL_DEFAULTS = {"BLOCKS_ARE_CONTIGUOUS": True}
_HAS_COMPUTE_Q = "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


def decode_blocks(
    start: torch.Tensor, cpos: torch.Tensor, block: int, n_blocks: int, done: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the KV blocks that hold its columns ``[start_b, cpos]``: ``(kv_num_blocks, kv_indices)``.

    ``start``: ``[rows]`` first real column of each row (left padding before it); ``cpos``: ``[1]``
    the column written this step. Row ``b`` visits blocks ``f_b .. l`` with ``f_b = start_b // block``
    and ``l = cpos // block``: ``kv_num_blocks[b] = l - f_b + 1`` and ``kv_indices[b, j] = f_b + j``
    (clamped to the last block; entries past ``kv_num_blocks`` are never read). ``done``: ``[rows]``
    rows whose output nobody reads any more (they ended, or are empty slots of the batch bucket until
    the next compaction): they visit the last block alone (``f_b = l``), so they cost one block, not
    their whole length. Shapes ``[rows, 1, 1]`` and ``[rows, 1, 1, n_blocks]``, int32, as
    ``BlockMask.from_kv_blocks`` takes them (one head and one query block broadcast over all).
    """
    first = torch.div(start, block, rounding_mode="floor")
    last = torch.div(cpos, block, rounding_mode="floor")
    if done is not None:
        first = torch.where(done, last, first)
    num = (last - first + 1).to(torch.int32)
    j = torch.arange(n_blocks, device=start.device, dtype=start.dtype)
    idx = (first[:, None] + j[None, :]).clamp_(max=n_blocks - 1).to(torch.int32)
    return num[:, None, None], idx[:, None, None, :]


def _mask_mod(start: torch.Tensor, cpos: torch.Tensor) -> Callable:
    """Column ``kv`` of row ``b`` is attended when ``start[b] <= kv <= cpos``: its real tokens so far."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= start[b]) & (kv_idx <= cpos[0])

    return mask_mod


class FlexDecode:
    """FlexAttention for the decode step: builds the step's ``BlockMask`` and runs the kernel.

    ``compiled``: run ``flex_attention`` through ``torch.compile`` (on for CUDA; the eager reference
    implementation materialises the scores). ``kernel_options``: passed to ``flex_attention`` over
    ``KERNEL_DEFAULTS`` (e.g. ``{"num_warps": 4, "num_stages": 2}``), to compare kernel settings without
    code changes.
    """

    def __init__(self, *, compiled: bool, block: int = BLOCK, kernel_options: dict | None = None) -> None:
        self.block = block
        self.compiled = compiled
        self.kernel_options = {**KERNEL_DEFAULTS, **(kernel_options or {})}
        self._fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
        self._bound: tuple[torch.Tensor, torch.Tensor] | None = None
        self._mod: Callable | None = None

    def mask(
        self,
        start: torch.Tensor,
        cpos: torch.Tensor,
        rows: int,
        q_len: int,
        kv_len: int,
        done: torch.Tensor | None = None,
    ) -> BlockMask:
        """The block mask of one step for the first ``rows`` slots: ``start`` is the decoder's whole
        ``[slots]`` buffer and ``cpos`` its ``[1]`` column, ``done`` (optional, ``[rows]``) the slots whose
        output is not used (``decode_blocks``); all are read on the device, never on the host."""
        if self._bound is None or self._bound[0] is not start or self._bound[1] is not cpos:
            # One mask_mod per pair of state buffers: compiled code keeps seeing the same function.
            self._bound, self._mod = (start, cpos), _mask_mod(start, cpos)
        num, idx = decode_blocks(start[:rows], cpos, self.block, -(-kv_len // self.block), done)
        extra = {"compute_q_blocks": False} if _HAS_COMPUTE_Q else {}
        return BlockMask.from_kv_blocks(
            num, idx, BLOCK_SIZE=(_Q_BLOCK, self.block), mask_mod=self._mod, seq_lengths=(q_len, kv_len), **extra
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float | None
    ) -> torch.Tensor:
        """``softmax(q k^T * scale + mask) v`` over the blocks ``block_mask`` lists; q ``[rows, heads, q_len, dim]``,
        k and v ``[rows, heads, kv_len, dim]`` with the same number of heads."""
        if not self.compiled:
            return self._fn(q, k, v, block_mask=block_mask, scale=scale, kernel_options=self.kernel_options)
        with torch._dynamo.config.patch(**{recompile_limit_name(): RECOMPILES}):
            return self._fn(q, k, v, block_mask=block_mask, scale=scale, kernel_options=self.kernel_options)


def recompile_limit_name() -> str:
    """The dynamo setting that caps recompiles of one function (renamed from ``cache_size_limit``)."""
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
