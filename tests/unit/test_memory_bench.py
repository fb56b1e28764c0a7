"""The memory benchmark runs end to end on a small state and reports what it promises (figures are not judged)."""

from __future__ import annotations

import argparse

import pytest
import torch

from tidal.bench.memory import fingerprint, run_policy


def test_fingerprint_sees_any_single_changed_word():
    t = torch.randn(1 << 16)
    base = fingerprint([t])
    for i in (0, 12345, t.numel() - 1):
        u = t.clone()
        u.view(torch.int32)[i] ^= 1  # one flipped bit
        assert fingerprint([u]) != base
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # same words, other places
    assert fingerprint([swapped]) != base
    assert fingerprint([t.clone()]) == base


@pytest.mark.parametrize("policy", ["release", "retain", "disk"])
def test_bench_policy_line(policy, tmp_path):
    args = argparse.Namespace(
        gib=0.0625, cycles=2, device="cpu", backend="auto", hook_mode="torch", disk_dir=str(tmp_path)
    )
    out = run_policy(args, policy)
    gib = 1024**3
    assert out["backend"] == "portable" and out["policy"] == policy
    # 16 bytes per parameter: weights + AdamW moments backed up (12), grads discarded (4); the engine's
    # weights and KV cache (4 + 4) discarded.
    assert out["backup_bytes"] == pytest.approx(0.75 * 0.0625 * gib, abs=64)
    assert out["discarded_bytes"] == pytest.approx(0.75 * 0.0625 * gib, abs=64)
    assert len(out["pause_s"]) == len(out["resume_s"]) == 2
    for key in ("pause_gbps_by_class", "resume_gbps_by_class"):
        classes = out[key]
        assert set(classes) == {"weights", "optimizer"}, key  # grads are discarded: no figure
        assert all(len(v) == 2 and all(g > 0 for g in v) for v in classes.values()), classes
    assert out["contents_intact"] is True
    assert out["device_used_paused_bytes"] == 0  # nothing registered stays allocated while paused
    assert out["pinned_copy_gbps"] > 0
    if policy == "disk":
        assert out["disk_backup_bytes"] == pytest.approx(2 * out["host_backup_bytes"], abs=64)  # moments, weights
    assert list(tmp_path.rglob("*.bin")) == []
