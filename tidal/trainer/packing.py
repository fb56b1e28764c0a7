"""Split a rollout into optimizer steps, share each step among ranks, and pack micro-batches.

Three pure functions, used in this order by the trainer:

1. ``split_global_batches``: consecutive chunks of ``global_batch_size`` samples, one optimizer step
   each (``None``/0: the whole rollout is one step). When the rollout does not divide evenly (dynamic
   sampling may drop groups) the last step is smaller rather than dropping data.
2. ``balance_across_ranks``: each rank takes a share of one step, balanced by token count (greedy
   longest-first onto the least-loaded rank), because a rank's time is proportional to its tokens and
   every rank waits for the slowest at each FSDP collective.
3. ``pack_micro_batches``: one rank's share cut into micro-batches whose *padded* size
   (``rows * longest row``) stays within ``max_tokens_per_gpu``. Micro-batches are padded rectangles
   of sequences sorted by length (longest first), so neighbours have similar lengths and little
   padding is wasted; that is simple and fast on CPU, where varlen (packed, unpadded) attention is
   not available. A single sequence longer than the budget gets a micro-batch of its own (a sequence
   cannot be split) and is reported by ``oversized``.

``plan_rollout`` combines them into the per-rank plan, and ``equalize_micro_batches`` pads every
rank's list to the same length: FSDP all-gathers in every forward and reduce-scatters in every
backward, so a rank that ran one micro-batch fewer than its peers would hang them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


def split_global_batches(n_samples: int, global_batch_size: int | None) -> list[list[int]]:
    """Indices of each optimizer step: consecutive chunks of ``global_batch_size`` (last may be smaller)."""
    if n_samples <= 0:
        return []
    if not global_batch_size or global_batch_size >= n_samples:
        return [list(range(n_samples))]
    return [list(range(s, min(s + global_batch_size, n_samples))) for s in range(0, n_samples, global_batch_size)]


def balance_across_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Assign each index to a rank so that token totals are as even as a greedy pass makes them.

    Longest first onto the rank with the fewest tokens so far (ties: fewer samples, then lower rank),
    which is deterministic: every rank computes the same plan without communicating.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    heap = [(0, 0, r) for r in range(world_size)]  # (tokens, samples, rank)
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, count, rank = heapq.heappop(heap)
        shares[rank].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, rank))
    for share in shares:
        share.sort()
    return shares


def pack_micro_batches(
    lengths: Sequence[int], max_tokens: int, indices: Sequence[int] | None = None
) -> list[list[int]]:
    """Cut ``indices`` (default: all) into micro-batches whose padded size ``rows * max_len <= max_tokens``.

    Sorted longest first, each micro-batch is filled greedily; its first row is its longest, so the
    padded size of a candidate is known before adding it.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    order = sorted(indices if indices is not None else range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def padded_tokens(lengths: Sequence[int], batch: Sequence[int]) -> int:
    """Size of a micro-batch as a padded rectangle (what the token budget bounds)."""
    return len(batch) * max((lengths[i] for i in batch), default=0)


def oversized(lengths: Sequence[int], max_tokens: int) -> list[int]:
    """Indices of sequences longer than the budget (each runs alone, over budget)."""
    return [i for i, n in enumerate(lengths) if n > max_tokens]


@dataclass
class StepPlan:
    """One optimizer step as one rank sees it: its micro-batches (sample indices; [] = zero-weight filler)."""

    micro_batches: list[list[int]] = field(default_factory=list)


def plan_rollout(
    lengths: Sequence[int], *, world_size: int, global_batch_size: int | None, max_tokens: int
) -> list[list[StepPlan]]:
    """The whole rollout's plan: ``plan[step][rank]``, micro-batch counts already equal across ranks."""
    plan: list[list[StepPlan]] = []
    for step_indices in split_global_batches(len(lengths), global_batch_size):
        step_lengths = [lengths[i] for i in step_indices]
        shares = balance_across_ranks(step_lengths, world_size)
        per_rank = [
            [[step_indices[j] for j in mb] for mb in pack_micro_batches(step_lengths, max_tokens, share)]
            for share in shares
        ]
        plan.append([StepPlan(mbs) for mbs in equalize_micro_batches(per_rank)])
    return plan


def equalize_micro_batches(per_rank: list[list[list[int]]]) -> list[list[list[int]]]:
    """Pad every rank's micro-batch list with empty (zero-weight) micro-batches to the longest length."""
    n = max((len(mbs) for mbs in per_rank), default=0)
    n = max(n, 1)  # a step always runs at least one forward/backward on every rank
    return [mbs + [[] for _ in range(n - len(mbs))] for mbs in per_rank]
