"""Weight sync on a GPU: the CUDA IPC path of the tensor transport and the paused-trainer path.

Run on the GPU host: ``pytest -m gpu tests/gpu/test_weight_sync_gpu.py -v``. The trainer-side source
and the engine share one GPU (``num_gpus=0.5`` each), as colocated actors do.
"""

from __future__ import annotations

import pytest
import torch

from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig, WeightSyncConfig
from tidal.weight_sync.verify import compare_checksums

pytestmark = pytest.mark.gpu

MODEL = "tiny-qwen2"


def _actors(ray, cfg: WeightSyncConfig):
    from tidal.bench.weight_sync import SyncSource
    from tidal.rollout.actor import EngineActor

    engine = (
        ray.remote(EngineActor)
        .options(num_cpus=1, num_gpus=0.5)
        .remote(
            0,
            model=ModelConfig(model=MODEL),
            rollout=RolloutConfig(),
            memory=MemoryConfig(),
            weight_sync=cfg,
            device="cuda",
        )
    )
    ray.get(engine.init.remote())
    source = (
        ray.remote(SyncSource)
        .options(num_cpus=1, num_gpus=0.5)
        .remote(MODEL, cfg, [engine], device="cuda", colocated=True, engine_dtype="bfloat16", lr=1e-3)
    )
    ray.get(source.connect.remote())
    ray.get(engine.randomize_weights.remote(5))
    return source, engine


def _mismatches(ray, source, engine) -> list[str]:
    return compare_checksums(ray.get(source.checksums.remote()), ray.get(engine.weight_checksums.remote()))


def test_device_checksum_catches_a_flipped_byte():
    from tidal.weight_sync.bucket import device_checksum, pack

    group = [("a", torch.randn(1000, dtype=torch.bfloat16)), ("b", torch.randn(77, 3))]
    flat, entries = pack(group, "cuda")
    before = device_checksum(flat)
    assert before == device_checksum(flat.clone())
    flat[entries[1]["offset"] + 5] ^= 1
    assert device_checksum(flat) != before


@pytest.mark.parametrize("mode", ["full", "delta"])
def test_cuda_ipc_sync_is_bitwise_equal(ray_cluster, mode):
    ray = ray_cluster
    cfg = WeightSyncConfig(update_weight_mode=mode, update_weight_transport="tensor", update_weight_buffer_size=100_000)
    source, engine = _actors(ray, cfg)
    try:
        assert _mismatches(ray, source, engine)
        first = ray.get(source.sync.remote())
        assert _mismatches(ray, source, engine) == []
        ray.get(source.rl_steps.remote(2))
        second = ray.get(source.sync.remote())
        assert _mismatches(ray, source, engine) == []
        assert ray.get(engine.get_weight_version.remote()) == 2
        assert not first["sync/retried"] and not second["sync/retried"]
        # Corrupt a device bucket in flight: the engine refuses it, the re-send repairs it.
        ray.get(source.inject_fault.remote(bucket=0, attempts=(0,)))
        ray.get(source.rl_steps.remote(1))
        third = ray.get(source.sync.remote())
        assert third["sync/retried"] and _mismatches(ray, source, engine) == []
    finally:
        for a in (source, engine):
            ray.kill(a)


def test_paused_trainer_syncs_from_host_backup(ray_cluster):
    ray = ray_cluster
    cfg = WeightSyncConfig(update_weight_transport="tensor", update_weight_buffer_size=100_000)
    source, engine = _actors(ray, cfg)
    try:
        ray.get(source.rl_steps.remote(1))
        ray.get(source.pause.remote())  # host backup in the engine dtype (pinned)
        ray.get(source.poison_device_weights.remote())  # device memory of a paused trainer is garbage
        ray.get(source.sync.remote())
        assert _mismatches(ray, source, engine) == []  # equal to the host backup, bit for bit
        sums = ray.get(engine.weight_checksums.remote())
        nan = ray.get(source.checksums_of_nan.remote())
        assert not set(sums.values()) & set(nan.values()), "the engine received the poisoned device weights"
    finally:
        for a in (source, engine):
            ray.kill(a)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_delta_over_disk_in_slimes_format_is_bitwise_equal(ray_cluster, tmp_path, encoding):
    from tidal.weight_sync.disk_format import is_delta, version_dir

    ray = ray_cluster
    cfg = WeightSyncConfig(
        update_weight_mode="delta",
        update_weight_transport="disk",
        update_weight_disk_dir=str(tmp_path / "disk"),
        update_weight_local_checkpoint_dir=str(tmp_path / "local"),
        update_weight_delta_encoding=encoding,
        update_weight_disk_keep_files=True,
    )
    source, engine = _actors(ray, cfg)
    try:
        ray.get(source.sync.remote())  # a preset: the base is written once as the full version 1
        assert _mismatches(ray, source, engine) == [] and not is_delta(version_dir(cfg.update_weight_disk_dir, 1))
        for step in (2, 3):
            ray.get(source.rl_steps.remote(1))
            rep = ray.get(source.sync.remote())
            assert _mismatches(ray, source, engine) == [] and ray.get(engine.get_weight_version.remote()) == step
            assert not rep["sync/retried"] and rep["sync/changed_bytes"] > 0
    finally:
        for a in (source, engine):
            ray.kill(a)
