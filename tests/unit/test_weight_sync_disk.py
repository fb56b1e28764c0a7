"""Disk weight versions without Ray: full and delta folders, the per-host local checkpoint, atomic publication.

The engine side here is a real ``WeightReceiver`` over a minimal engine (a dict of tensors and a
``load_weights`` that copies by name); the engine actors are covered in ``test_weight_sync.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tidal.config.schema import WeightSyncConfig
from tidal.errors import WeightSyncError
from tidal.weight_sync.checksum import tensor_checksum
from tidal.weight_sync.disk import INDEX, DiskStrategy, LocalCheckpoint, newest_full, version_dir
from tidal.weight_sync.receiver import WeightReceiver


class DictEngine:
    """Holds named tensors; ``load_weights`` copies into them in place, like an engine's parameters."""

    device = "cpu"

    def __init__(self, like: dict[str, torch.Tensor]):
        self.params = {k: torch.full_like(v, 7) for k, v in like.items()}

    def load_weights(self, pairs) -> int:
        n = 0
        for name, t in pairs:
            self.params[name].copy_(t)
            n += t.numel() * t.element_size()
        return n


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),
        "layers.0.proj.weight": torch.randn(48, 32, generator=g),
        "layers.0.norm.weight": torch.ones(32),
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
        update_weight_buffer_size=6000,  # several shards for these ~30 KB of weights
        update_weight_disk_dir=str(tmp_path / "disk"),
        update_weight_local_checkpoint_dir=str(tmp_path / "local"),
    )
    return WeightSyncConfig(**{**base, **kw})


def _equal(engine: DictEngine, w: dict[str, torch.Tensor]) -> bool:
    return all(tensor_checksum(engine.params[k]) == tensor_checksum(v) for k, v in w.items())


def test_full_then_delta_layout_and_apply(tmp_path):
    cfg = _cfg(tmp_path)
    s = DiskStrategy(cfg, [])
    w1 = _weights()
    p1 = s.write(w1.items(), 1)
    engine = DictEngine(w1)
    rx = WeightReceiver(engine, cfg)
    assert rx.from_disk(p1)["complete"]
    assert _equal(engine, w1)
    w2 = _step(w1, 1)
    p2 = s.write(w2.items(), 2)
    index = json.load(open(os.path.join(p2, INDEX)))
    meta = index["metadata"]
    assert (meta["format"], meta["version"], meta["base_version"]) == ("delta", "2", "1")
    assert {"delta_encoding", "compression_format", "checksum_format"} <= set(meta)
    # Unchanged tensors are absent from a delta.
    assert set(index["weight_map"]) == {"embed.weight", "head.weight"}
    stats = rx.from_disk(p2)
    assert stats["version"] == 2 and _equal(engine, w2)
    assert json.load(open(tmp_path / "local" / "state.json"))["version"] == 2
    assert os.path.basename(p1) == "weight_v000001" and newest_full(cfg.update_weight_disk_dir)[0] == 1


def test_out_of_order_refused_and_fresh_host_starts_from_full(tmp_path):
    cfg = _cfg(tmp_path)
    s = DiskStrategy(cfg, [])
    w = _weights()
    p1 = s.write(w.items(), 1)
    w2 = _step(w, 1)
    p2 = s.write(w2.items(), 2)
    w3 = _step(w2, 2)
    p3 = s.write(w3.items(), 3)
    engine = DictEngine(w)
    rx = WeightReceiver(engine, cfg)
    rx.from_disk(p1)
    with pytest.raises(WeightSyncError, match="out of order"):
        rx.from_disk(p3)
    assert json.load(open(tmp_path / "local" / "state.json"))["version"] == 1
    rx.from_disk(p2)
    rx.from_disk(p3)
    assert _equal(engine, w3)
    # A host that never saw a version starts from the newest full one (v1), then applies v2.
    fresh_cfg = _cfg(tmp_path, update_weight_local_checkpoint_dir=str(tmp_path / "fresh"))
    fresh = DictEngine(w)
    WeightReceiver(fresh, fresh_cfg).from_disk(p2)
    assert _equal(fresh, w2)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_flipped_byte_aborts_without_advancing(tmp_path, compression):
    cfg = _cfg(tmp_path, update_weight_compression=compression)
    s = DiskStrategy(cfg, [])
    w = _weights()
    rx = WeightReceiver(DictEngine(w), cfg)
    rx.from_disk(s.write(w.items(), 1))
    p2 = s.write(_step(w, 1).items(), 2)
    local = LocalCheckpoint(str(tmp_path / "local"))
    before = {n: tensor_checksum(local.tensor(n)) for n in local.names()}
    shard = sorted(f for f in os.listdir(p2) if f.endswith(".safetensors"))[0]
    with open(os.path.join(p2, shard), "r+b") as f:
        f.seek(-3, os.SEEK_END)  # inside the last tensor's encoded bytes
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x5A]))
    with pytest.raises(WeightSyncError):
        rx.from_disk(p2)
    assert json.load(open(tmp_path / "local" / "state.json"))["version"] == 1
    assert {n: tensor_checksum(local.tensor(n)) for n in local.names()} == before
    assert not os.path.exists(local.pending)


def test_reapplying_overwrite_is_harmless_xor_is_not(tmp_path):
    for enc in ("overwrite", "xor"):
        cfg = _cfg(tmp_path / enc, update_weight_delta_encoding=enc)
        s = DiskStrategy(cfg, [])
        w = _weights()
        rx = WeightReceiver(DictEngine(w), cfg)
        rx.from_disk(s.write(w.items(), 1))
        w2 = _step(w, 1)
        p2 = s.write(w2.items(), 2)
        rx.from_disk(p2)
        local = LocalCheckpoint(cfg.update_weight_local_checkpoint_dir)
        index = json.load(open(os.path.join(p2, INDEX)))
        # A crash after writing the bytes but before advancing the state: the delta is applied again.
        if enc == "overwrite":
            local._apply_locked(p2, index)
            assert all(tensor_checksum(local.tensor(n)) == tensor_checksum(w2[n]) for n in w2)
        else:
            with pytest.raises(WeightSyncError, match="checksum"):
                local._apply_locked(p2, index)


_KILLED_WRITER = """
import os, sys, torch
from tidal.config.schema import WeightSyncConfig
from tidal.weight_sync.disk import DiskStrategy
cfg = WeightSyncConfig(update_weight_mode="full", update_weight_transport="disk", update_weight_buffer_size=6000, update_weight_disk_dir=sys.argv[1])
s = DiskStrategy(cfg, [])
s.fault_hook = lambda index, attempt, path: os.kill(os.getpid(), 9) if index == 1 else None
s.write([(f"w{i}", torch.randn(40, 40)) for i in range(4)], 2)
"""


def test_killed_writer_leaves_nothing_loadable(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(disk)], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    leftovers = os.listdir(disk)
    assert leftovers and all(e.startswith(".tmp-weight_v000002") for e in leftovers)
    assert newest_full(str(disk)) is None
    rx = WeightReceiver(DictEngine({"w0": torch.zeros(40, 40)}), _cfg(tmp_path, update_weight_mode="full"))
    with pytest.raises(WeightSyncError, match="not a published|incomplete"):
        rx.from_disk(version_dir(str(disk), 2))
    with pytest.raises(WeightSyncError, match="not a published"):
        rx.from_disk(str(disk / leftovers[0]))
    # The next writer clears the leftovers.
    DiskStrategy(_cfg(tmp_path, update_weight_mode="full"), []).connect()
    assert os.listdir(disk) == []
