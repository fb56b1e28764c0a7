"""Asynchronous training on one GPU: trainer and engine resident side by side (no offload), generating while training.

Run on the GPU host: ``pytest -m gpu tests/gpu/test_async_gpu.py -v``. Colocated on the one device
(the ``async`` rule keeps them together there and turns offload off), tensor transport over CUDA
IPC while the engine has generate calls queued; after every sync the engine's weights equal the
trainer's bit for bit, and the samples trained are one version behind (one-step) or within the
staleness bound (full).
"""

from __future__ import annotations

import pytest

from tidal.config import parse, resolve
from tidal.weight_sync.verify import compare_checksums

pytestmark = pytest.mark.gpu


def _run(tmp_path, *flags):
    from tidal.driver import train

    argv = [
        "--model", "tiny-qwen2", "--device", "cuda", "--num-rollout", "4", "--rollout-batch-size", "8",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "16", "--output-dir", str(tmp_path / "run"),
        "--no-progress", *flags,
    ]  # fmt: skip
    cfg, prov = parse(argv)
    cfg = resolve(cfg, prov)
    assert cfg.cluster.colocate and not cfg.memory.offload_train and not cfg.memory.offload_rollout
    rows = []

    def check(s, rollout_id, row):
        want = s.trainer.call("weight_checksums")
        for got in s.engines.call("weight_checksums"):
            assert compare_checksums(want, got) == [], f"engine differs after sync {rollout_id}"
        if rollout_id >= 0:
            rows.append(row)

    train(cfg, on_step=check)
    return rows


def test_one_step_resident_on_one_gpu(ray_cluster, tmp_path):
    rows = _run(tmp_path, "--async", "one-step")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert all(r["train_samples"] == 32 for r in rows)
    print({k: rows[-1][k] for k in ("samples_per_s", "trainer_busy_frac", "engine_busy_frac", "sync/seconds")})


def test_full_resident_on_one_gpu(ray_cluster, tmp_path):
    rows = _run(tmp_path, "--async", "full", "--max-staleness", "1")
    assert all(r["async/staleness_max"] <= 1 and r["train_samples"] == 32 for r in rows)
    print({k: rows[-1][k] for k in ("samples_per_s", "async/dropped_total", "engine_busy_frac")})
