"""The delta codec's word/flags/values layout: round trips, idempotence, checksums and corrupt input."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import xxhash

from tidal.bench import delta_codec as bench
from tidal.errors import WeightSyncError
from tidal.weight_sync import delta
from tidal.weight_sync.checksum import checksum_bytes


def _bf16_update(n_elems: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A bf16 tensor and an Adam-like update of it: mostly low bytes change, ~20-30 % of 8-byte words."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n_elems, generator=g) * 0.02
    step = torch.randint(0, 2, (n_elems,), generator=g).float().mul_(2).sub_(1) * 3e-6
    old = master.to(torch.bfloat16).view(torch.uint8).numpy().copy()
    new = (master - step).to(torch.bfloat16).view(torch.uint8).numpy().copy()
    return old, new


def _roundtrip(old, new, encoding, compression):
    snap = old.copy()
    changed, records, parts, csum = delta.submit_encode(new, snap, encoding, compression, "xxh3-128").result()
    assert changed == int(np.count_nonzero(old != new))
    assert np.array_equal(snap, new), "the snapshot becomes the new bytes"
    target = old.copy()
    [got] = delta.apply_many([(target, b"".join(parts), records, delta.CHUNK)], encoding, compression, "xxh3-128")
    assert np.array_equal(target, new)
    assert got == csum == delta.digest(new, "xxh3-128")
    return records, parts, target


@pytest.mark.parametrize("encoding", ["overwrite", "xor"])
@pytest.mark.parametrize("compression", ["zstd", "none"])
@pytest.mark.parametrize("n_elems", [20_000, 20_003, 5])  # whole words, a partial last word, one partial word
def test_bf16_update_roundtrips_across_chunks(monkeypatch, encoding, compression, n_elems):
    monkeypatch.setattr(delta, "CHUNK", 4096)
    old, new = _bf16_update(n_elems)
    new[-1] ^= 0x40  # the very last byte changes too (inside the zero-padded word when the size is odd)
    records, parts, target = _roundtrip(old, new, encoding, compression)
    assert all(len(r) == 6 and r[1] <= 4096 for r in records)
    again = target.copy()
    delta.apply(again, b"".join(parts), records, encoding, compression)
    # overwrite is idempotent; xor applied twice reverts the changed bytes.
    assert np.array_equal(again, new) == (encoding == "overwrite")


@pytest.mark.parametrize("encoding", ["overwrite", "xor"])
def test_dense_and_sparse_changes(monkeypatch, encoding):
    monkeypatch.setattr(delta, "CHUNK", 1000)
    rng = np.random.default_rng(3)
    old = rng.integers(0, 256, 10_001, dtype=np.uint8)
    new = rng.integers(0, 256, old.size, dtype=np.uint8)  # nearly every byte changes
    new[2000:4000] = old[2000:4000]  # two unchanged chunks in the middle are left out
    records, _, _ = _roundtrip(old, new, encoding, "zstd")
    assert 2000 not in [r[0] for r in records] and 3000 not in [r[0] for r in records]
    one = old.copy()
    one[7777] ^= 1  # a single flipped bit
    records, _, _ = _roundtrip(old, one, encoding, "zstd")
    assert [r[0] for r in records] == [7000] and records[0][5] == 1


def test_flags_are_smaller_than_a_byte_bitmap():
    old, new = _bf16_update(1 << 19)
    changed, records, parts = delta.encode(new, old.copy(), "overwrite", "zstd")
    positions = sum(r[2] + r[3] for r in records)  # word bitmap + flags, compressed
    assert positions < len(np.packbits(old != new)) // 3
    assert sum(r[4] for r in records) <= changed + 64 * len(records)  # values: about one byte per change


def test_xor_values_compress_below_overwrite():
    old, new = _bf16_update(1 << 19)
    over = sum(map(len, delta.encode(new, old.copy(), "overwrite", "zstd")[2]))
    xor = sum(map(len, delta.encode(new, old.copy(), "xor", "zstd")[2]))
    assert xor < over


def _encoded(compression="zstd", n=8192, chunk=4096):
    old, new = _bf16_update(n // 2)
    _, records, parts = delta.encode(new, old.copy(), "overwrite", compression)
    return old, new, records, parts


def test_corrupt_payload_is_refused(monkeypatch):
    monkeypatch.setattr(delta, "CHUNK", 4096)
    old, _, records, parts = _encoded()
    blob = bytearray(b"".join(parts))
    with pytest.raises(WeightSyncError, match="needs|holds"):
        delta.apply(old.copy(), bytes(blob[:-5]), records, "overwrite", "zstd")
    for at in (5, records[0][2] + 5, len(blob) - 10):  # inside the word bitmap, the flags, the values
        bad = bytearray(blob)
        bad[at] ^= 0xFF
        with pytest.raises(WeightSyncError):
            delta.apply(old.copy(), bytes(bad), records, "overwrite", "zstd")


def test_malformed_records_are_refused(monkeypatch):
    monkeypatch.setattr(delta, "CHUNK", 4096)
    old, _, records, parts = _encoded()
    blob = b"".join(parts)
    cases = [
        [r[:5] for r in records],  # the old 5-field layout
        [[*records[0][:5], records[0][5] + 1], *records[1:]],  # wrong changed-byte count
        [[records[0][0] + 8, *records[0][1:]], *records[1:]],  # off the chunk grid
        [records[0], records[0]],  # a chunk twice
        [[r[0], r[1], -1, *r[3:]] for r in records],
    ]
    for recs in cases:
        with pytest.raises(WeightSyncError):
            delta.apply(old.copy(), blob, recs, "overwrite", "zstd")


def test_uncompressed_flags_marking_past_the_end_are_refused():
    old = np.zeros(13, dtype=np.uint8)  # one whole word + a 5-byte partial word
    new = old.copy()
    new[12] = 7
    _, records, parts = delta.encode(new, old.copy(), "overwrite", "none")
    words, flags, values = (np.frombuffer(p, dtype=np.uint8).copy() for p in parts)
    assert list(np.unpackbits(words)[:2]) == [0, 1] and flags[0] == 0b00001000
    flags[0] = 0b00000100  # byte 13: past the end of the tensor
    with pytest.raises(WeightSyncError, match="past the chunk's end"):
        delta.apply(old.copy(), words.tobytes() + flags.tobytes() + values.tobytes(), records, "overwrite", "none")
    words[0] |= 0b00100000  # a third word, which a 13-byte chunk does not have
    with pytest.raises(WeightSyncError, match="past the chunk's end"):
        delta.apply(old.copy(), words.tobytes() + parts[1] + parts[2], records, "overwrite", "none")


def test_uncompressed_flipped_value_is_caught_by_the_checksum(monkeypatch):
    monkeypatch.setattr(delta, "CHUNK", 4096)
    old, new, records, parts = _encoded("none")
    blob = bytearray(b"".join(parts))
    blob[-1] ^= 0x01
    target = old.copy()
    [got] = delta.apply_many([(target, bytes(blob), records, 4096)], "overwrite", "none", "xxh3-128")
    assert got != delta.digest(new, "xxh3-128", 4096)


@pytest.mark.parametrize("n", [0, 1, 65_535, 65_536, 65_537, 1_000_003])
def test_checksum_of_large_buffers_equals_the_one_shot_digest(n):
    buf = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert checksum_bytes(buf) == xxhash.xxh3_128_hexdigest(buf) == checksum_bytes(buf.tobytes())


def test_digest_is_chunked_hash_tree(monkeypatch):
    buf = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    whole = xxhash.xxh3_128_hexdigest(buf)
    assert delta.digest(buf, "xxh3-128", 1 << 20) == whole
    leaves = "".join(xxhash.xxh3_128_hexdigest(buf[a : a + 4096]) for a in range(0, buf.size, 4096))
    assert delta.digest(buf, "xxh3-128", 4096) == xxhash.xxh3_128_hexdigest(leaves.encode())


def test_set_threads_resizes_the_pool():
    try:
        delta.set_threads(2)
        assert delta.pool()._max_workers == 2
        old, new = _bf16_update(40_000)
        _roundtrip(old, new, "overwrite", "zstd")
    finally:
        delta.set_threads(None)


def test_bench_runs_small_and_checks_itself(monkeypatch, capsys):
    monkeypatch.setattr(delta, "CHUNK", delta.CHUNK)  # the bench's --chunk-mib sets it; restored after
    try:
        bench.main(["--mib", "2", "--threads", "2", "--reps", "1", "--chunk-mib", "0.25"])
    finally:
        delta.set_threads(None)
    out = json.loads(capsys.readouterr().out)
    assert out["bitwise_equal"] and out["tensors"] > 1 and 0.02 < out["density"] < 0.04
    assert set(out["memcpy_gbps"]) == {"1", "2"} and out["encode_gbps"] > 0 and out["apply_gbps"] > 0


def test_bench_disk_format_runs_small_and_checks_itself(monkeypatch, capsys, tmp_path):
    try:
        bench.main(["--mib", "2", "--threads", "2", "--reps", "1", "--format", "disk", "--disk-dir", str(tmp_path)])
    finally:
        delta.set_threads(None)
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "disk (slime)" and out["bitwise_equal"] and out["tensors"] > 1
    assert 0 < out["bytes_on_disk"] < out["bytes_total"] and out["apply_gbps"] > 0 and out["write_s"] > 0
    assert os.listdir(tmp_path) == []  # the bench removes its files
