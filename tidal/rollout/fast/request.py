"""The request side of the fast decoder: checking a batch request, batch buckets, cutting rows at stop ids.

Pure functions (no device state) that ``FastDecoder.generate`` calls before and after its waves;
kept apart so the decoder module holds the cache, the step and the wave loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.errors import UserError
from tidal.rollout.generate import first_of


def batch_buckets(rows: int) -> list[int]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then powers of two and their 1.5x, up to ``rows``."""
    out, b = [], 1
    while b < rows:
        out.append(b)
        if b >= 8 and b + b // 2 < rows:
            out.append(b + b // 2)
        b *= 2
    out.append(rows)
    return sorted(set(out))


@dataclass
class DecodeResult:
    """Per row, in input order: generated token ids (cut after a stop id or the row's limit), their
    raw-policy log-probs, and whether a stop id ended the row (else its length limit did)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    stopped: list[bool]
    stats: dict = field(default_factory=dict)


def check_request(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    stop_ids: Sequence[int],
    temperature: float,
    top_p: float,
    top_k: int,
    max_stop_ids: int,
) -> tuple[list[int], list[int]]:
    """The per-row limits and the distinct stop ids of a request, or a ``UserError`` naming what is wrong."""
    n = len(prompts)
    limits = [int(max_new_tokens)] * n if isinstance(max_new_tokens, int) else [int(x) for x in max_new_tokens]
    if len(limits) != n:
        raise UserError(f"fast decode: {len(limits)} max_new_tokens for {n} prompts; give one or one per prompt")
    if any(x < 1 for x in limits):
        raise UserError("fast decode: max_new_tokens must be at least 1 for every prompt")
    if any(len(p) == 0 for p in prompts):
        raise UserError("fast decode: every prompt needs at least one token")
    stops = list(dict.fromkeys(int(s) for s in stop_ids))
    if len(stops) > max_stop_ids:
        raise UserError(f"fast decode: {len(stops)} stop token ids, at most {max_stop_ids} are supported")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise UserError(
            f"fast decode: temperature={temperature}, top_p={top_p}, top_k={top_k}: need T >= 0, 0 < top_p <= 1, top_k >= 0"
        )
    return limits, stops


def cut_at_stops(
    tokens: list[list[int]], logprobs: list[list[float]], limits: list[int], stops: set[int]
) -> list[tuple[list[int], list[float], bool]]:
    """Each row's (tokens, log-probs, stopped): cut at its limit, or just after its first stop id."""
    out = []
    for row, lps, limit in zip(tokens, logprobs, limits):
        row = row[:limit]
        k = first_of(row, stops)
        out.append((row, lps[:limit], False) if k is None else (row[: k + 1], lps[: k + 1], True))
    return out
