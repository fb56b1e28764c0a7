"""Trainer checkpoints on CPU: save (while paused), load into a fresh 2-rank group, continue bit for bit.

Also the pieces that make it atomic: half-written folders are ignored, ``latest`` is followed, a
complete folder newer than ``latest`` (crash before the pointer was written) is still found.
"""

from __future__ import annotations

import json
import os

from test_trainer import call, make_samples, start_group

from tidal.checkpoint.store import ShardedReader, ShardedWriter, find_latest, write_text_atomic


def test_find_latest_ignores_half_written(tmp_path):
    root = str(tmp_path)
    assert find_latest(root) is None
    assert find_latest(str(tmp_path / "missing")) is None
    for name in ("iter_0000001", "iter_0000003"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "meta.json").write_text("{}")
    os.makedirs(tmp_path / "iter_0000007")  # no meta.json: never finished
    os.makedirs(tmp_path / ".tmp-iter_0000009-abcd1234")
    (tmp_path / ".tmp-iter_0000009-abcd1234" / "meta.json").write_text("{}")
    assert find_latest(root) == str(tmp_path / "iter_0000003")
    write_text_atomic(str(tmp_path / "latest"), "iter_0000001\n")
    assert find_latest(root) == str(tmp_path / "iter_0000001")
    write_text_atomic(str(tmp_path / "latest"), "iter_0000007\n")  # points at an incomplete one
    assert find_latest(root) == str(tmp_path / "iter_0000003")


def test_sharded_writer_splits_and_reads_back(tmp_path):
    import torch

    w = ShardedWriter(str(tmp_path), "model", max_bytes=1000)
    tensors = {f"t{i}": torch.randn(100) for i in range(5)}  # 400 bytes each -> 2 per file
    for k, v in tensors.items():
        w.add(k, v)
    index = w.close()
    assert len(set(index.values())) == 3
    r = ShardedReader(str(tmp_path), index)
    for k, v in tensors.items():
        assert torch.equal(r.get(k), v)


def test_save_load_resume_is_bit_identical(ray_cluster, tmp_path):
    ray = ray_cluster
    ckpt = str(tmp_path / "ckpt")
    s1, s2 = make_samples(10), make_samples(11)

    a = start_group(ray)
    try:
        assert call(ray, a, "load", ckpt)[0] == {}  # nothing saved yet: start from scratch
        call(ray, a, "train", s1, 0)
        state_after_s1 = call(ray, a, "state_checksums")[0]
        # The driver saves while the trainer is paused: the checkpoint is read from host backups.
        call(ray, a, "pause")
        info = call(ray, a, "save", ckpt, {"rollout_id": 0, "data": {"epoch": 0, "offset": 8}})[0]
        call(ray, a, "resume")
        assert info["checkpoint/path"].endswith("iter_0000000")
        metrics_a = call(ray, a, "train", s2, 1)[0]
        state_a = call(ray, a, "state_checksums")[0]
    finally:
        for x in a:
            ray.kill(x)

    assert sorted(os.listdir(ckpt)) == ["iter_0000000", "latest"]
    with open(os.path.join(ckpt, "iter_0000000", "meta.json")) as f:
        meta = json.load(f)
    assert meta["schedule"] == {"step": 2} and meta["world_size"] == 2
    assert {f"rng_rank{r}.pt" for r in range(2)} <= set(os.listdir(os.path.join(ckpt, "iter_0000000")))

    b = start_group(ray)
    try:
        extra = call(ray, b, "load", ckpt)[0]
        assert extra["data"] == {"epoch": 0, "offset": 8} and extra["rollout_id"] == 0
        assert extra["weight_version"] == 0
        assert call(ray, b, "state_checksums")[0] == state_after_s1
        metrics_b = call(ray, b, "train", s2, 1)[0]
        state_b = call(ray, b, "state_checksums")[0]
    finally:
        for x in b:
            ray.kill(x)
    assert state_b == state_a, [k for k in state_a if state_a[k] != state_b.get(k)]
    for key in ("loss", "pg_loss", "kl", "grad_norm", "lr"):
        assert metrics_a[key] == metrics_b[key], key
