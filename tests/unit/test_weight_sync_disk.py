"""Delta over disk in slime's stream format, both directions, without Ray.

The other half of each exchange is ``slime_rules`` (written from slime's published rules alone, not
with tidal's codec): ``slime_apply`` reads a stream as slime's receiver does, ``slime_publish``
writes one as slime's trainer does.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from slime_rules import _locations, _raw, slime_apply, slime_publish

from tidal.config.schema import WeightSyncConfig
from tidal.errors import UserError, WeightSyncError
from tidal.weight_sync import disk_format as fmt
from tidal.weight_sync.checksum import tensor_checksum
from tidal.weight_sync.disk import DiskStrategy
from tidal.weight_sync.local_checkpoint import load_folder, newest_version, pull, read_applied
from tidal.weight_sync.receiver import WeightReceiver

# ------------------------------------------------------------------ helpers


class DictEngine:
    """Holds named tensors; ``load_weights`` copies into them in place, like an engine's parameters."""

    device = "cpu"

    def __init__(self, like: dict[str, torch.Tensor]):
        self.params = {k: torch.full_like(v, 7) for k, v in like.items()}

    def load_weights(self, pairs) -> int:
        for name, t in pairs:
            self.params[name].copy_(t)
        return 0


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layers.0.proj.weight": torch.randn(48, 32, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.ones(32, dtype=torch.bfloat16),
        "head.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
    }


def _step(w: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A sparse update: a few elements of two tensors change, the rest stay."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in w.items()}
    for name in ("embed.weight", "head.weight"):
        flat = out[name].view(-1)
        idx = torch.randint(0, flat.numel(), (20,), generator=g)
        flat[idx] += 0.5
    return out


def _cfg(tmp_path, **kw) -> WeightSyncConfig:
    base = dict(
        update_weight_mode="delta",
        update_weight_transport="disk",
        update_weight_buffer_size=3000,  # several shards for these ~16 KB of weights
        update_weight_disk_dir=str(tmp_path / "disk"),
        update_weight_local_checkpoint_dir=str(tmp_path / "local"),
    )
    return WeightSyncConfig(**{**base, **kw})


def _base(tmp_path, w) -> str:
    folder = tmp_path / "base"
    folder.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    return str(folder)


def _equal_files(folder: str, w: dict[str, torch.Tensor]) -> bool:
    locs = _locations(folder)
    return all(
        np.array_equal(np.fromfile(locs[k][0], np.uint8, count=locs[k][2], offset=locs[k][1]), _raw(v))
        for k, v in w.items()
    )


# ------------------------------------------------------------------ tidal writes, slime's rules read


@pytest.mark.parametrize(
    ("encoding", "algo"), [("xor", "xxh3-128"), ("overwrite", "adler32"), ("overwrite", "blake3"), ("xor", "blake3")]
)
def test_tidal_stream_applies_with_slimes_rules(tmp_path, encoding, algo):
    if algo == "blake3":
        pytest.importorskip("blake3")
    w0 = _weights()
    base = _base(tmp_path, w0)
    s = DiskStrategy(
        _cfg(tmp_path, update_weight_delta_encoding=encoding, update_weight_checksum=algo), [], base_dir=base
    )
    disk = s.disk_dir
    assert s.write(w0.items(), 1) == base and s.stream_version == 0  # the first sync publishes nothing
    assert os.listdir(disk) == []
    local = tmp_path / "slime-local"
    shutil.copytree(base, local)  # version 0: the engines' own checkpoint
    w = w0
    for v in (1, 2, 3):
        w = _step(w, v) if v != 2 else w  # v2: nothing changed
        s.write(w.items(), v + 1)
        folder = os.path.join(disk, f"weight_v{v:06d}")
        index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
        assert index["metadata"] == {
            "version": f"{v:06d}",
            "base_version": f"{v - 1:06d}",
            "delta_encoding": encoding,
            "compression_format": "zstd",
            "checksum_format": algo,
        }
        shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        assert sorted(set(index["weight_map"].values())) == shards
        if v == 2:
            assert shards == [] and index["weight_map"] == {}
        else:
            assert set(index["weight_map"]) == {"embed.weight", "head.weight"}  # unchanged tensors omitted
            assert shards[0] == f"model-00000-of-{len(shards):05d}.safetensors"
            frame = open(os.path.join(folder, shards[0]), "rb").read()[-40:]
            assert frame  # content sizes are checked by slime_apply's one-shot decompress
        slime_apply(str(local), folder)
        assert _equal_files(str(local), w)


def test_preset_writes_the_base_once_as_a_full_version(tmp_path):
    w = _weights()
    s = DiskStrategy(_cfg(tmp_path), [], base_dir=None)
    p1 = s.write(w.items(), 1)
    assert os.path.basename(p1) == "weight_v000001" and "delta_encoding" not in fmt.index_metadata(p1)
    w2 = _step(w, 1)
    s.write(w2.items(), 2)
    local = tmp_path / "slime-local"
    local.mkdir()
    slime_apply(str(local), p1)
    slime_apply(str(local), os.path.join(s.disk_dir, "weight_v000002"))
    assert _equal_files(str(local), w2)
    # tidal's receiver on a fresh host replays from the full version, and the engine loads the result.
    result = pull(str(tmp_path / "local"), s.disk_dir, 2, base_dir=None)
    assert (result.version, result.seeded_from, result.applied) == (2, 1, [2])
    engine = DictEngine(w)
    load_folder(WeightReceiver(engine, None), str(tmp_path / "local"))
    assert all(tensor_checksum(engine.params[k]) == tensor_checksum(v) for k, v in w2.items())


# ------------------------------------------------------------------ slime's rules write, tidal reads


@pytest.mark.parametrize(("encoding", "algo"), [("xor", "adler32"), ("overwrite", "xxh3-128"), ("xor", "blake3")])
def test_slime_stream_applies_with_tidals_receiver(tmp_path, encoding, algo):
    if algo == "blake3":
        pytest.importorskip("blake3")
    disk = str(tmp_path / "disk")
    os.makedirs(disk)
    w = [_weights()]
    for v in (1, 2, 3):
        w.append(_step(w[-1], v) if v != 2 else w[-1])
        slime_publish(disk, v, w[v - 1], w[v], encoding, algo)
    base = _base(tmp_path, w[0])
    local = str(tmp_path / "local")
    assert newest_version(disk) == 3  # what pull_weights targets when no target_version is given
    first = pull(local, disk, 0, base_dir=base)
    assert (first.version, first.seeded_from) == (0, 0) and read_applied(local) == 0
    assert os.path.exists(os.path.join(local, "config.json"))
    assert json.load(open(os.path.join(local, ".weight_sync", "state.json"))) == {"version": "000000"}
    r = pull(local, disk, 2, base_dir=base)
    assert (r.seeded_from, r.applied) == (None, [1, 2]) and _equal_files(local, w[2])
    assert pull(local, disk, 2, base_dir=base).applied == []  # already applied: a no-op
    pull(local, disk, 3, base_dir=base)
    assert _equal_files(local, w[3]) and read_applied(local) == 3
    # A fresh host replays the whole chain from version 0.
    fresh = pull(str(tmp_path / "fresh"), disk, 3, base_dir=base)
    assert (fresh.seeded_from, fresh.applied) == (0, [1, 2, 3]) and _equal_files(str(tmp_path / "fresh"), w[3])


# ------------------------------------------------------------------ refusals and failures


def _stream(tmp_path, encoding="overwrite", n=2):
    w = [_weights()]
    base = _base(tmp_path, w[0])
    s = DiskStrategy(_cfg(tmp_path, update_weight_delta_encoding=encoding), [], base_dir=base)
    s.write(w[0].items(), 1)
    for v in range(1, n + 1):
        w.append(_step(w[-1], v))
        s.write(w[-1].items(), v + 1)
    return s, base, w


def test_out_of_order_delta_is_refused(tmp_path):
    s, base, w = _stream(tmp_path)
    local = str(tmp_path / "local")
    pull(local, s.disk_dir, 1, base_dir=base)
    # A version whose base is not what the host holds (here: v2 re-labelled as building on v0).
    v2 = fmt.version_dir(s.disk_dir, 2)
    index = json.load(open(os.path.join(v2, fmt.INDEX)))
    index["metadata"]["base_version"] = "000000"
    json.dump(index, open(os.path.join(v2, fmt.INDEX), "w"))
    with pytest.raises(WeightSyncError, match="out-of-order delta.*local at 1, the delta builds on 0"):
        pull(local, s.disk_dir, 2, base_dir=base)
    assert read_applied(local) == 1 and _equal_files(local, w[1])


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_flipped_byte_applies_nothing_and_keeps_the_state(tmp_path, encoding):
    s, base, w = _stream(tmp_path, encoding)
    local = str(tmp_path / "local")
    pull(local, s.disk_dir, 1, base_dir=base)
    folder = fmt.version_dir(s.disk_dir, 2)
    shard = sorted(glob.glob(os.path.join(folder, "*.safetensors")))[-1]
    with open(shard, "r+b") as f:
        f.seek(-3, os.SEEK_END)  # inside the last tensor's compressed diff
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x5A]))
    with pytest.raises(WeightSyncError, match="checksum mismatch for 1 tensors"):
        pull(local, s.disk_dir, 2, base_dir=base)
    assert read_applied(local) == 1 and _equal_files(local, w[1])


def test_reapplied_delta_overwrite_is_idempotent_xor_reverts(tmp_path):
    new, old = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    for encoding in ("overwrite", "xor"):
        _, d = fmt.diff(new, old, encoding)
        blob = fmt.compress(d)
        once = fmt.apply(old, blob, encoding)
        twice = fmt.apply(once, blob, encoding)
        assert np.array_equal(once, new)
        assert np.array_equal(twice, new) == (encoding == "overwrite")
    # Through the receiver, a pull of a version already applied changes nothing (slime's no-op rule).
    s, base, w = _stream(tmp_path, "xor")
    local = str(tmp_path / "local")
    pull(local, s.disk_dir, 2, base_dir=base)
    assert pull(local, s.disk_dir, 2, base_dir=base).applied == [] and _equal_files(local, w[2])


def test_patch_interrupted_before_the_state_is_written_resets_on_the_next_pull(tmp_path):
    s, base, w = _stream(tmp_path, "xor")
    local = str(tmp_path / "local")
    pull(local, s.disk_dir, 2, base_dir=base)
    # What a process killed between patching v2 and writing its state leaves: new bytes, no state.
    os.remove(os.path.join(local, ".weight_sync", "state.json"))
    r = pull(local, s.disk_dir, 2, base_dir=base)
    assert (r.seeded_from, r.applied) == (0, [1, 2]) and _equal_files(local, w[2])


_KILLED_WRITER = """
import os, sys, torch
from tidal.config.schema import WeightSyncConfig
from tidal.weight_sync.disk import DiskStrategy
cfg = WeightSyncConfig(update_weight_mode="delta", update_weight_transport="disk", update_weight_buffer_size=3000,
                       update_weight_disk_dir=sys.argv[1], update_weight_local_checkpoint_dir=sys.argv[2])
s = DiskStrategy(cfg, [], base_dir=None)
w = {f"w{i}": torch.randn(40, 40) for i in range(4)}
s.write(w.items(), 1)
s.fault_hook = lambda index, attempt, path: os.kill(os.getpid(), 9) if index == 1 else None
s.write([(k, v + 1) for k, v in w.items()], 2)
"""


def test_killed_writer_leaves_nothing_a_reader_takes_for_a_version(tmp_path):
    disk, local = tmp_path / "disk", tmp_path / "local"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(disk), str(local)], capture_output=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    entries = sorted(os.listdir(disk))
    assert entries[0].startswith(".tmp-weight_v000002") and entries[1:] == ["weight_v000001"]
    with pytest.raises(WeightSyncError, match="published weight version missing"):
        pull(str(local), str(disk), 2)
    assert pull(str(local), str(disk), 1).version == 1  # the published versions still apply
    DiskStrategy(_cfg(tmp_path), []).connect()  # the next writer clears the leftovers
    assert os.listdir(disk) == ["weight_v000001"]


def test_overwrite_of_a_4gib_tensor_is_refused_not_wrapped():
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape=(1 << 32,), strides=(0,))  # 4 GiB, no memory
    with pytest.raises(UserError, match=r"lm_head.weight: 4294967296 bytes .* use --update-weight-delta-encoding xor"):
        fmt.diff(huge, huge, "overwrite", "lm_head.weight")
    fmt.check_overwrite_size("lm_head.weight", (1 << 32) - 1)  # the largest tensor u32 positions cover


def test_old_tidal_folders_are_refused_in_one_line(tmp_path):
    disk = tmp_path / "disk"
    old = disk / "weight_v000002"
    old.mkdir(parents=True)
    meta = {"format": "delta", "version": "2", "base_version": "1", "delta_encoding": "overwrite"}
    (old / fmt.INDEX).write_text(json.dumps({"metadata": meta, "weight_map": {}}))
    with pytest.raises(UserError, match="written by an older tidal.*start over") as e:
        DiskStrategy(_cfg(tmp_path), []).connect()
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="older tidal"):
        pull(str(tmp_path / "local"), str(disk), 2)
    stale = tmp_path / "stale-local"
    stale.mkdir()
    (stale / "state.json").write_text('{"version": 1, "full_version": 1}')
    with pytest.raises(UserError, match="local checkpoint .* older tidal"):
        pull(str(stale), str(disk), 2)


def test_rejected_delta_is_rewritten_as_a_full_version(tmp_path):
    s, base, w = _stream(tmp_path, n=1)
    s._write_full_version(
        1, __import__("tidal.weight_sync.base", fromlist=["SyncReport"]).SyncReport("delta", "disk", 2)
    )
    assert not fmt.is_delta(fmt.version_dir(s.disk_dir, 1))
    local = str(tmp_path / "local")
    r = pull(local, s.disk_dir, 1, base_dir=base)
    assert r.seeded_from == 1 and _equal_files(local, w[1])


def test_a_delta_denser_than_the_weights_is_written_full(tmp_path):
    w0 = _weights()
    base = _base(tmp_path, w0)
    s = DiskStrategy(_cfg(tmp_path), [], base_dir=base)  # overwrite: 5 bytes per changed byte
    s.write(w0.items(), 1)
    w1 = {k: v + 1 for k, v in w0.items()}  # every element changes
    folder = s.write(w1.items(), 2)
    assert os.path.basename(folder) == "weight_v000001" and not fmt.is_delta(folder)
    local = str(tmp_path / "local")
    assert pull(local, s.disk_dir, 1, base_dir=base).seeded_from == 1 and _equal_files(local, w1)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 13, 4099])
def test_overwrite_positions_are_every_changed_byte_in_order(n):
    rng = np.random.default_rng(n)
    old = rng.integers(0, 256, n, dtype=np.uint8)
    new = old.copy()
    if n:
        hit = rng.integers(0, n, n // 3 + 1)
        new[hit] ^= rng.integers(1, 256, hit.size, dtype=np.uint8)
    changed, d = fmt.diff(new, old, "overwrite")
    mask = new != old
    assert changed == int(mask.sum())
    if changed:
        count = int(d[:4].view("<u4")[0])
        assert count == changed and np.array_equal(d[4 : 4 + 4 * count].view("<u4"), np.flatnonzero(mask))
        assert np.array_equal(d[4 + 4 * count :], new[mask])


def test_multithreaded_compression_of_a_large_diff_is_still_one_frame_with_its_size():
    import zstandard

    d = np.zeros(40 << 20, np.uint8)  # past the size where several zstd threads compress it
    d[::4099] = 1
    frame = fmt.compress(d, threads=-1)
    assert zstandard.get_frame_parameters(bytes(frame[:18])).content_size == d.size
    assert np.array_equal(np.frombuffer(zstandard.ZstdDecompressor().decompress(bytes(frame)), np.uint8), d)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_large_tensors_diffed_span_by_span_give_the_same_stream(tmp_path, monkeypatch, encoding):
    from tidal.weight_sync import disk_codec

    monkeypatch.setattr(disk_codec, "LARGE", 2048)
    monkeypatch.setattr(disk_codec, "SPAN", 1000)  # not a multiple of 8: spans end inside words
    w0 = _weights()
    base = _base(tmp_path, w0)
    s = DiskStrategy(_cfg(tmp_path, update_weight_delta_encoding=encoding), [], base_dir=base)
    s.write(w0.items(), 1)
    local = tmp_path / "slime-local"
    shutil.copytree(base, local)
    w = w0
    for v in (1, 2):
        w = _step(w, v)
        slime_apply(str(local), s.write(w.items(), v + 1))
        assert _equal_files(str(local), w)


def test_a_corrupt_full_version_is_refused_and_leaves_a_fresh_host(tmp_path):
    s = DiskStrategy(_cfg(tmp_path), [], base_dir=None)
    p1 = s.write(_weights().items(), 1)  # a preset: full version 1
    shard = sorted(glob.glob(os.path.join(p1, "*.safetensors")))[0]
    with open(shard, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    local = str(tmp_path / "local")
    with pytest.raises(WeightSyncError, match="checksum mismatch for 1 tensors"):
        pull(local, s.disk_dir, 1)
    assert read_applied(local) is None  # the next pull copies it again


def test_a_chain_as_heavy_as_full_versions_is_closed_by_a_full_version(tmp_path, monkeypatch):
    from tidal.weight_sync import disk

    monkeypatch.setattr(disk, "CHAIN_FULLS", 0.01)  # one small delta is enough to close the chain
    w = [_weights()]
    base = _base(tmp_path, w[0])
    s = DiskStrategy(_cfg(tmp_path), [], base_dir=base)
    s.write(w[0].items(), 1)
    for v in (1, 2):
        w.append(_step(w[-1], v))
        path = s.write(w[-1].items(), v + 1)
    assert fmt.is_delta(fmt.version_dir(s.disk_dir, 1)) and not fmt.is_delta(path)  # v2 closes the chain
    s._cleanup(path)
    assert sorted(os.listdir(s.disk_dir)) == ["weight_v000002"]  # a fresh host starts at v2
    local = str(tmp_path / "local")
    assert pull(local, s.disk_dir, 2, base_dir=base).seeded_from == 2 and _equal_files(local, w[2])


def test_blake3_without_its_package_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "blake3", None)  # import blake3 -> ImportError
    with pytest.raises(UserError, match=r"blake3 needs the blake3 package: pip install 'tidal\[blake3\]'"):
        fmt.checksum("blake3", b"abc")


@pytest.mark.parametrize("cut", ["truncated", "flipped"])
def test_a_frame_corrupt_midway_leaves_the_tensor_as_it_was(monkeypatch, cut):
    from tidal.weight_sync import disk_codec

    monkeypatch.setattr(disk_codec, "SPAN", 4096)  # several spans are patched before the damage is reached
    rng = np.random.default_rng(0)
    old = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    new = old.copy()
    new[rng.integers(0, old.size, 3000)] ^= 0x55
    blob = disk_codec.encode_tensor("w", new, old.copy(), "xor", "xxh3-128").blob.copy()
    if cut == "truncated":
        blob = blob[: blob.size * 3 // 4]
    else:
        blob[blob.size * 3 // 4] ^= 0xFF
    region = old.copy()
    try:
        _, digest = disk_codec.patch(region, blob, "xor", "w", "xxh3-128")
    except WeightSyncError:
        assert np.array_equal(region, old)  # refused: the spans already patched were reverted
    else:  # the damage decoded without a zstd error: the checksum tells, and unpatch restores
        assert digest != fmt.checksum("xxh3-128", new)
        disk_codec.unpatch(region, blob, "xor", "w", None)
        assert np.array_equal(region, old)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_spans_and_pool_give_what_the_one_shot_rules_give(monkeypatch, encoding):
    from tidal.weight_sync import disk_codec
    from tidal.weight_sync.delta import pool

    monkeypatch.setattr(disk_codec, "SPAN", 1000)  # not a multiple of 8
    monkeypatch.setattr(disk_codec, "LARGE", 20_000)
    rng = np.random.default_rng(1)
    for n in (0, 5, 999, 1000, 4099, 50_001):
        old = rng.integers(0, 256, n, dtype=np.uint8)
        new = old.copy()
        new[rng.integers(0, max(n, 1), n // 20)] ^= 3
        snap = old.copy()
        e = disk_codec.submit_encode(pool(), "w", new, snap, encoding, "adler32").result()
        assert np.array_equal(snap, new)
        _, d = fmt.diff(new, old, encoding)
        if d is None:
            assert e.blob is None and e.changed == 0
            continue
        assert np.array_equal(fmt.decompress(e.blob, "w"), d) and e.digest == fmt.checksum("adler32", new)
        region = old.copy()
        _, digest = disk_codec.patch(region, e.blob, encoding, "w", "adler32")
        assert np.array_equal(region, new) and digest == e.digest
