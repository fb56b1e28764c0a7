"""Prefix reuse of the fast decode path: a prompt's keys and values kept between generate calls.

A multi-turn trajectory sends the engine its whole context every turn, and each turn's context
starts with the previous turn's request (token in, token out: the same ids). ``PrefixStore`` keeps
the KV of every request's *prompt*, copied out of the static cache right after its prefill (before
any decode step or compaction moves rows), by the prompt's ids. When a later request's ids start
with a stored prompt, the decoder copies that KV into the row's cache columns and prefills only
the rest: the previous turn's response and the environment's observation. Response tokens are
prefilled again rather than kept from decoding (a row's decode-time KV is gone once compaction
drops the row), so what is saved is the prefill of everything before the last turn.

Contents are valid only for the weights they were computed with: the engine clears the store on
every weight update and on every memory release (``EmbeddedEngine.flush_cache``), and the store
holds at most ``budget_bytes``: entries already used by a later request are dropped first (their
trajectory has stored a longer one), then the oldest. A request whose stored prefix is its
whole prompt reuses all but the last token (a forward pass needs at least one).

Within one prefill chunk, rows whose prompts are equal (the samples of one GRPO group) share one row of
the forward pass: ``shared_prompts`` finds each row's distinct prompt, the forward covers only those, and
``share_rows`` copies their keys and values to the rows that asked for the same prompt.

``prefill_plan`` is the per-chunk arithmetic: a chunk of left-padded rows runs one forward pass
over the columns ``[from_col, width)``; rows whose stored prefix covers fewer columns recompute
the difference, rows without one prefill whole (the chunk's ``from_col`` is the smallest cover).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

_MOD = (1 << 61) - 1  # prefix hashes: a polynomial in the token ids modulo a Mersenne prime
_BASE = 1_000_003


def prefix_hashes(ids: Sequence[int]) -> list[int]:
    """``h[k]``: the hash of ``ids[:k]``, for every ``k`` (one pass; a lookup tries every stored length)."""
    h, out = 0, [0]
    for t in ids:
        h = (h * _BASE + int(t) + 1) % _MOD
        out.append(h)
    return out


class PrefixStore:
    """Prompt KV by prompt ids, on the decoder's device, at most ``budget_bytes`` (used, then oldest, dropped).

    Entries are found by (length, prefix hash): a lookup hashes the request's ids once and tries
    each stored length, then compares the ids of a candidate in full, so a hash collision never
    reuses a wrong prefix.
    """

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._entries: OrderedDict[tuple[int, int], tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()
        self._lengths: dict[int, int] = {}  # stored prompt length -> entries of that length
        self.bytes = 0
        self.hits = self.lookups = self.reused_tokens = self.prefilled_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[int]) -> tuple[int, torch.Tensor | None]:
        """(tokens reusable, KV ``[layers, 2, kv_heads, stored_len, dim]``) of the longest stored prefix of ``ids``."""
        self.lookups += 1
        if not self._entries:
            return 0, None
        hashes = prefix_hashes(ids)
        for length in sorted((n for n in self._lengths if n <= len(ids)), reverse=True):
            key = (length, hashes[length])
            entry = self._entries.get(key)
            if entry is not None and entry[0] == tuple(ids[:length]):
                self.hits += 1
                # A used prefix is the first to go: its trajectory has moved on and stores a longer one.
                self._entries.move_to_end(key, last=False)
                return min(length, len(ids) - 1), entry[1]
        return 0, None

    def put(self, ids: Sequence[int], kv: torch.Tensor) -> None:
        key = (len(ids), prefix_hashes(ids)[-1])
        size = kv.numel() * kv.element_size()
        if size > self.budget or key in self._entries:
            return
        self._entries[key] = (tuple(ids), kv)
        self._lengths[len(ids)] = self._lengths.get(len(ids), 0) + 1
        self.bytes += size
        while self.bytes > self.budget:
            old, (_, dropped) = self._entries.popitem(last=False)
            self._forget(old[0], dropped)

    def _forget(self, length: int, kv: torch.Tensor) -> None:
        self.bytes -= kv.numel() * kv.element_size()
        self._lengths[length] -= 1
        if not self._lengths[length]:
            del self._lengths[length]

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.bytes = 0

    def stats(self) -> dict[str, float]:
        total = self.reused_tokens + self.prefilled_tokens
        return {
            "prefix/hits": self.hits,
            "prefix/lookups": self.lookups,
            "prefix/reused_tokens": self.reused_tokens,
            "prefix/prefilled_tokens": self.prefilled_tokens,
            "prefix/reused_frac": self.reused_tokens / total if total else 0.0,
            "prefix/bytes": self.bytes,
        }


def prefill_plan(lens: Sequence[int], reusable: Sequence[int], width: int) -> tuple[int, list[int]]:
    """(from_col, tokens reused per row) of one prefill chunk of left-padded rows of length ``lens``.

    Row ``i`` occupies columns ``[width - lens[i], width)``; its first ``reusable[i]`` tokens have
    stored KV. The forward pass covers ``[from_col, width)`` with ``from_col`` the smallest column
    every row can start computing from; row ``i`` reuses ``from_col - (width - lens[i])`` tokens.
    """
    from_col = min(width - n + r for n, r in zip(lens, reusable))
    return from_col, [max(0, from_col - (width - n)) for n in lens]


def fill_prefix(cache, row: int, start: int, kv: torch.Tensor, count: int) -> None:
    """Copy the first ``count`` stored tokens into cache row ``row``, columns ``[start, start + count)``."""
    if count:
        cache.buf[:, :, row, :, start : start + count].copy_(kv[:, :, :, :count])


def reuse_prefixes(store: PrefixStore, cache, prompts: Sequence[Sequence[int]], row0: int, width: int) -> int:
    """Copy each row's stored prefix KV into its cache row (rows ``row0 + i``, left-padded to ``width``);
    returns the first column the prefill must compute for the chunk."""
    found = [store.lookup(p) for p in prompts]
    lens = [len(p) for p in prompts]
    from_col, reused = prefill_plan(lens, [n for n, _ in found], width)
    for i, ((_, kv), count) in enumerate(zip(found, reused)):
        fill_prefix(cache, row0 + i, width - lens[i], kv, count)
    store.reused_tokens += sum(reused)
    store.prefilled_tokens += sum(lens) - sum(reused)
    return from_col


def take_prompt(cache, row: int, start: int, width: int) -> torch.Tensor:
    """A copy of cache row ``row``'s prompt KV, columns ``[start, width)``: ``[layers, 2, kv_heads, len, dim]``."""
    return cache.buf[:, :, row, :, start:width].clone()


def shared_prompts(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(first row of each distinct prompt, in order; each row's index into that list). A distinct prompt's
    index is never past the row that first asks for it (``share_rows`` relies on it)."""
    index: dict[tuple[int, ...], int] = {}
    firsts, owner = [], []
    for row, p in enumerate(prompts):
        key = tuple(p)
        if key not in index:
            index[key] = len(firsts)
            firsts.append(row)
        owner.append(index[key])
    return firsts, owner


def prefill_chunks(prompts: Sequence[Sequence[int]], width: int, tokens: int, share: bool) -> list[tuple[int, int]]:
    """Row ranges ``[r0, r1)`` of a wave's prefill forwards, in order: each forward computes at most
    ``tokens // width`` prompts (at least one), counting equal prompts of a range once when ``share`` (a
    GRPO group's samples), else every row: the budget bounds the tokens a forward computes (its activations,
    ``static_cache.prefill_workspace_bytes``), and a group's rows only copy its keys and values. Bounding rows
    instead would split a wave of groups into forwards of an eighth of the prompts the budget allows (eight
    samples a prompt), each bound by its kernel launches about as much as a full one."""
    per = max(1, tokens // max(1, width))
    out: list[tuple[int, int]] = []
    r0, seen = 0, set()
    for r, p in enumerate(prompts):
        key = tuple(p) if share else r
        if key not in seen and len(seen) == per:
            out.append((r0, r))
            r0, seen = r, set()
        seen.add(key)
    if len(prompts) > r0:
        out.append((r0, len(prompts)))
    return out


def share_rows(cache, row0: int, owner: Sequence[int], width: int) -> None:
    """Cache rows ``row0 + i`` (columns ``[0, width)``) take the keys and values of row ``row0 + owner[i]``: the
    forward wrote distinct prompt ``k`` into row ``row0 + k``. A layer at a time (each one's gather is a copy
    of the chunk's rows of that layer only), so the chunk's own rows may be read and written in one go."""
    src = torch.as_tensor([row0 + k for k in owner], dtype=torch.long, device=cache.buf.device)
    rows = slice(row0, row0 + len(owner))
    for layer in cache.buf:
        layer[:, rows, :, :width] = layer[:, src, :, :width]
