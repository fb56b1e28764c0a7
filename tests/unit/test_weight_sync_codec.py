"""Delta codec, bucket packing and checksums, without actors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.errors import WeightSyncError
from tidal.weight_sync import delta
from tidal.weight_sync.bucket import (
    _views_and_gaps,
    device_checksum,
    entry_view,
    entry_views,
    host_checksum,
    pack,
    plan_buckets,
)
from tidal.weight_sync.verify import compare_checksums


def _pair(n: int, frac: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, n, dtype=np.uint8)
    new = old.copy()
    idx = rng.choice(n, int(n * frac), replace=False)
    new[idx] ^= rng.integers(1, 256, idx.size, dtype=np.uint8)  # every picked byte really changes
    return old, new, idx.size


@pytest.mark.parametrize("encoding", ["overwrite", "xor"])
@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_encode_apply_roundtrip_over_chunks(monkeypatch, encoding, compression):
    monkeypatch.setattr(delta, "CHUNK", 4096)  # many chunks, encoded and applied on the pool
    old, new, n_changed = _pair(50_000, 0.01)
    snap = old.copy()
    changed, records, parts = delta.encode(new, snap, encoding, compression)
    assert changed == n_changed
    assert np.array_equal(snap, new), "the snapshot becomes the new bytes"
    assert all(r[1] <= 4096 for r in records) and len(records) > 1
    target = old.copy()
    delta.apply(target, b"".join(parts), records, encoding, compression)
    assert np.array_equal(target, new)
    if compression == "zstd":
        assert sum(map(len, parts)) < new.size // 4  # 1% density compresses well below a quarter
    again = target.copy()
    delta.apply(again, b"".join(parts), records, encoding, compression)
    # overwrite is idempotent; xor applied twice reverts the changed bytes.
    assert np.array_equal(again, new) == (encoding == "overwrite")


def test_unchanged_tensor_encodes_to_nothing():
    old, _, _ = _pair(10_000, 0.0)
    assert delta.encode(old.copy(), old.copy(), "overwrite", "zstd") == (0, [], [])


def test_corrupt_or_truncated_payload_is_refused():
    old, new, _ = _pair(20_000, 0.05)
    _, records, parts = delta.encode(new, old.copy(), "overwrite", "zstd")
    blob = bytearray(b"".join(parts))
    with pytest.raises(WeightSyncError):
        delta.apply(old.copy(), bytes(blob[:-5]), records, "overwrite", "zstd")
    blob[10] ^= 0xFF
    with pytest.raises(WeightSyncError):
        delta.apply(old.copy(), bytes(blob), records, "overwrite", "zstd")


def test_pack_views_every_dtype_and_checksums_catch_a_flip():
    group = [
        ("a", torch.randn(7, 5)),
        ("b", torch.randn(13).to(torch.bfloat16)),
        ("c", torch.arange(9, dtype=torch.int64)),
        ("d", torch.randn(3, 3, 3).to(torch.float16)),
    ]
    flat, entries = pack(group)
    assert all(e["offset"] % 64 == 0 for e in entries)
    for (name, t), e in zip(group, entries):
        assert e["name"] == name and torch.equal(entry_view(flat, e), t)
    h, d = host_checksum(flat.numpy()), device_checksum(flat)
    flat[entries[2]["offset"] + 3] ^= 0x10
    assert host_checksum(flat.numpy()) != h and device_checksum(flat) != d


@pytest.mark.parametrize("mixed", [False, True])
def test_a_buckets_views_and_gaps_cover_each_byte_once_and_the_gaps_are_zeroed(mixed):
    # One dtype: the views come from one split of the buffer; mixed dtypes: one slice each. Either way every
    # byte of the buffer is in exactly one entry or one alignment gap, and pack zeroes every gap.
    group = [("a", torch.randn(7, 5)), ("e", torch.empty(0, 3)), ("b", torch.randn(16)), ("c", torch.randn(3, 3))]
    if mixed:
        group[2] = ("b", torch.arange(9, dtype=torch.int64))
    flat, entries = pack(group)
    seen = torch.zeros(flat.numel(), dtype=torch.int64)
    base = flat.data_ptr()
    views, gaps = _views_and_gaps(flat, entries)
    for t in views + gaps:
        start = t.data_ptr() - base if t.numel() else 0
        seen[start : start + t.numel() * t.element_size()] += 1
    assert torch.equal(seen, torch.ones_like(seen))
    # Gaps after "a" (140 bytes) and "c" (36), and after "b" where it is 9 int64 (72; 16 floats end aligned).
    assert all(not g.any() for g in gaps) and len(gaps) == 2 + mixed
    for (name, t), e, v in zip(group, entries, views):
        assert torch.equal(v, t) and torch.equal(entry_view(flat, e), t), name


def test_entry_views_read_a_senders_own_layout():
    # Entries another sender laid out (out of order, wider gaps) are each sliced where they say.
    flat = torch.zeros(512, dtype=torch.uint8)
    a, b = torch.arange(6, dtype=torch.float32), torch.arange(4, dtype=torch.float32) + 10
    flat[256:280].view(torch.float32)[:] = a
    flat[0:16].view(torch.float32)[:] = b
    entries = [
        {"name": "a", "dtype": "float32", "shape": [2, 3], "offset": 256, "nbytes": 24},
        {"name": "b", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16},
    ]
    got = entry_views(flat, entries)
    assert torch.equal(got[0], a.view(2, 3)) and torch.equal(got[1], b)


def test_device_checksum_sees_swapped_words():
    buf = torch.arange(64, dtype=torch.uint8)
    swapped = buf.view(torch.int64).flip(0).contiguous().view(torch.uint8)
    assert device_checksum(buf) != device_checksum(swapped)


def test_plan_buckets_streams_and_respects_the_limit():
    consumed = []

    def stream():
        for i in range(10):
            consumed.append(i)
            yield f"w{i}", torch.zeros(100)  # 400 bytes, 448 aligned

    gen = plan_buckets(stream(), 1000)
    first = next(gen)
    assert [n for n, _ in first] == ["w0", "w1"] and consumed == [0, 1, 2], "lazy: one tensor of look-ahead"
    rest = list(gen)
    assert sum(len(b) for b in [first, *rest]) == 10
    big = list(plan_buckets([("big", torch.zeros(1000)), ("x", torch.zeros(1))], 1000))
    assert [len(b) for b in big] == [1, 1]


def test_compare_checksums_names_every_difference():
    out = compare_checksums({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "9", "d": "4"})
    assert len(out) == 3
    assert (
        any(m.startswith("b:") for m in out)
        and any(m.startswith("c:") for m in out)
        and any(m.startswith("d:") for m in out)
    )
    assert compare_checksums({"a": "1"}, {"a": "1"}) == []


def test_pack_casts_to_the_engine_dtype_bit_for_bit():
    # The trainer may feed fp32 (its master weights or backup) and name the engine dtype: every entry
    # then describes, and holds, exactly what a cast of the source gives.
    src = [("w", torch.randn(33, 7)), ("b", torch.randn(5)), ("empty", torch.empty(0, 4))]
    flat, entries = pack(src, "cpu", torch.bfloat16)
    assert [e["dtype"] for e in entries] == ["bfloat16"] * 3
    assert [e["nbytes"] for e in entries] == [33 * 7 * 2, 5 * 2, 0]
    assert all(e["offset"] % 64 == 0 for e in entries)
    for (name, t), e in zip(src, entries):
        got = entry_view(flat, e)
        assert got.dtype == torch.bfloat16 and got.shape == t.shape, name
        assert torch.equal(got.view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), name
    # Same dtype: no cast, the raw bytes.
    same, e2 = pack([("w", src[0][1])], "cpu", torch.float32)
    assert e2[0]["dtype"] == "float32" and torch.equal(entry_view(same, e2[0]), src[0][1])


def test_timed_stream_brings_tensors_to_the_host_in_the_engine_dtype():
    from tidal.weight_sync.base import SyncReport
    from tidal.weight_sync.stream import timed_stream, to_host

    report = SyncReport(mode="full", transport="tensor", version=1)
    names: list[str] = []
    src = [("a", torch.randn(10)), ("b", torch.randn(3, 3, dtype=torch.float64))]
    out = list(timed_stream(iter(src), report, names, dtype=torch.bfloat16))
    assert names == ["a", "b"]
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for _, t in out)
    assert report.bytes_total == (10 + 9) * 2  # counted in the engine dtype
    # on_device: tensors pass untouched (the consumer casts where it packs), bytes still in the engine dtype.
    report = SyncReport(mode="full", transport="tensor", version=1)
    passed = list(timed_stream(iter(src), report, dtype=torch.bfloat16, on_device=True))
    assert passed[0][1] is src[0][1] and report.bytes_total == (10 + 9) * 2
    assert to_host(src[0][1]) is src[0][1]  # already on the host in its dtype: no copy
