"""Weight sync between real actors: a trainer-side source and real engine actors, tiny model, real Ray.

Every (mode, transport) pair must leave the engines bitwise equal to the trainer after randomising
them first; delta syncs after real optimizer steps send only changed bytes; a bucket corrupted in
flight is re-sent once, and one corrupted on every attempt fails loudly. One source and two engines
serve the whole module (starting actors dominates the cost on a small machine).
"""

from __future__ import annotations

import pytest
import torch

from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig, WeightSyncConfig
from tidal.errors import WeightSyncError
from tidal.weight_sync.verify import compare_checksums

MODEL = "tiny"
# Small buckets: the tiny model (~400 KB) spans a few buckets, and its embedding (64 KB) exceeds none.
BUFFER = 150_000


@pytest.fixture(scope="module")
def actors(ray_cluster):
    from tidal.bench.weight_sync import SyncSource
    from tidal.rollout.actor import EngineActor

    ray = ray_cluster
    cfg = WeightSyncConfig(update_weight_transport="tensor", update_weight_buffer_size=BUFFER)
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
        for i in range(2)
    ]
    ray.get([e.init.remote() for e in engines])
    source = ray.remote(SyncSource).options(num_cpus=0.25).remote(MODEL, cfg, engines, lr=1e-3)
    yield ray, source, engines
    ray.get(source.close.remote())
    for a in [source, *engines]:
        ray.kill(a)


def _use(actors, seed: int, tmp_path=None, **kw):
    """Switch the source to a new strategy and randomise the engines (a missed tensor keeps random bytes)."""
    ray, source, engines = actors
    if kw.get("update_weight_transport") == "disk":
        kw.setdefault("update_weight_disk_dir", str(tmp_path / "disk"))
        kw.setdefault("update_weight_local_checkpoint_dir", str(tmp_path / "local"))
    cfg = WeightSyncConfig(update_weight_buffer_size=BUFFER, **kw)
    ray.get(source.reconfigure.remote(cfg, colocated=kw.get("update_weight_transport") == "tensor"))
    ray.get(source.connect.remote())
    ray.get([e.randomize_weights.remote(seed + i) for i, e in enumerate(engines)])
    return ray, source, engines


def _mismatches(ray, source, engines) -> list[str]:
    trainer = ray.get(source.checksums.remote())
    out = []
    for i, sums in enumerate(ray.get([e.weight_checksums.remote() for e in engines])):
        out += [f"engine {i}: {m}" for m in compare_checksums(trainer, sums)]
    return out


def _versions(ray, engines) -> list[int]:
    return ray.get([e.get_weight_version.remote() for e in engines])


@pytest.mark.parametrize("transport", ["tensor", "broadcast", "disk"])
@pytest.mark.parametrize("mode", ["full", "delta"])
def test_sync_is_bitwise_equal(actors, tmp_path, transport, mode):
    ray, source, engines = _use(actors, 11, tmp_path, update_weight_mode=mode, update_weight_transport=transport)
    assert _mismatches(ray, source, engines), "randomised engines should differ before the first sync"
    first = ray.get(source.sync.remote())
    assert _mismatches(ray, source, engines) == []
    assert first["sync/bytes_sent"] >= first["sync/bytes_total"] > 0
    assert first["sync/changed_bytes"] == first["sync/bytes_total"]
    assert _versions(ray, engines) == [1, 1]
    ray.get(source.rl_steps.remote(1))
    second = ray.get(source.sync.remote())
    assert _mismatches(ray, source, engines) == []
    assert _versions(ray, engines) == [2, 2]
    assert second["sync/transport"] == transport and second["sync/mode"] == mode
    assert not second["sync/retried"]
    if mode == "delta":
        assert 0 < second["sync/changed_bytes"] <= second["sync/bytes_total"]
        # Nothing changed: only the commit travels, and the engines still move to the new version.
        third = ray.get(source.sync.remote())
        assert third["sync/changed_bytes"] == 0
        if transport != "disk":  # a disk version always has its index file
            assert third["sync/bytes_sent"] == 0
        assert _mismatches(ray, source, engines) == []
        assert _versions(ray, engines) == [3, 3]


@pytest.mark.parametrize(("transport", "mode"), [("tensor", "full"), ("broadcast", "delta"), ("disk", "delta")])
def test_bucket_corrupted_in_flight_is_resent_in_full(actors, tmp_path, transport, mode):
    ray, source, engines = _use(actors, 21, tmp_path, update_weight_mode=mode, update_weight_transport=transport)
    if mode == "delta":
        ray.get(source.sync.remote())  # baseline; the corrupted bucket is then a delta one
        ray.get(source.rl_steps.remote(1))
    ray.get(source.inject_fault.remote(bucket=0, attempts=(0,)))
    report = ray.get(source.sync.remote())
    ray.get(source.clear_fault.remote())
    assert report["sync/retried"]
    assert _mismatches(ray, source, engines) == []


@pytest.mark.parametrize(("transport", "mode"), [("tensor", "full"), ("broadcast", "full"), ("disk", "full")])
def test_bucket_corrupted_on_every_attempt_fails_loudly(actors, tmp_path, transport, mode):
    ray, source, engines = _use(actors, 31, tmp_path, update_weight_mode=mode, update_weight_transport=transport)
    ray.get(source.inject_fault.remote(bucket=0, attempts=(0, 1)))
    with pytest.raises(WeightSyncError):
        ray.get(source.sync.remote())
    ray.get(source.clear_fault.remote())
    # The engines refused the bad bucket and are still usable: the next sync repairs everything.
    ray.get(source.sync.remote())
    assert _mismatches(ray, source, engines) == []


@pytest.mark.parametrize("transport", ["tensor", "broadcast"])
def test_delta_restores_weights_the_engine_discarded_while_asleep(actors, tmp_path, transport):
    ray, source, engines = _use(actors, 41, tmp_path, update_weight_mode="delta", update_weight_transport=transport)
    ray.get(source.sync.remote())
    ray.get(source.rl_steps.remote(1))
    # Colocated order: engines release everything, the trainer trains, engines resume weights (undefined bytes), sync.
    ray.get([e.release_memory.remote(["kv_cache", "weights"]) for e in engines])
    ray.get([e.resume_memory.remote(["weights"]) for e in engines])
    report = ray.get(source.sync.remote())
    ray.get([e.resume_memory.remote(["kv_cache"]) for e in engines])
    assert report["sync/changed_bytes"] < report["sync/bytes_total"]  # only changes crossed...
    assert _mismatches(ray, source, engines) == []  # ...yet every weight, unchanged ones included, is back


def test_delta_over_disk_starts_from_the_engines_own_checkpoint(ray_cluster, tmp_path):
    """A model folder is version 0 of slime's stream: the first sync publishes nothing, yet engines
    that were randomised end bitwise equal (they reload the base from their local checkpoint)."""
    import os
    import shutil

    import numpy as np
    import xxhash
    from slime_rules import _locations, slime_apply

    from tidal.bench.weight_sync import SyncSource
    from tidal.model.load import build_model, resolve_model
    from tidal.model.tokenizer import char_tokenizer
    from tidal.rollout.actor import EngineActor
    from tidal.weight_sync.disk_format import is_delta
    from tidal.weight_sync.local_checkpoint import read_applied

    ray = ray_cluster
    folder = str(tmp_path / "model")
    build_model(resolve_model(MODEL), dtype=torch.float32, seed=1234).save_pretrained(folder)  # SyncSource's seed
    char_tokenizer().save_pretrained(folder)
    cfg = WeightSyncConfig(
        update_weight_mode="delta",
        update_weight_transport="disk",
        update_weight_buffer_size=BUFFER,
        update_weight_disk_dir=str(tmp_path / "disk"),
        update_weight_local_checkpoint_dir=str(tmp_path / "local"),
        update_weight_delta_encoding="xor",  # fp32 updates change most bytes: xor's diff still compresses below full
    )
    engine = (
        ray.remote(EngineActor)
        .options(num_cpus=0.25)
        .remote(
            0,
            model=ModelConfig(model=folder),
            rollout=RolloutConfig(),
            memory=MemoryConfig(),
            weight_sync=cfg,
            device="cpu",
        )
    )
    ray.get(engine.init.remote())
    source = ray.remote(SyncSource).options(num_cpus=0.25).remote(folder, cfg, [engine], lr=1e-3)
    try:
        ray.get(source.connect.remote())
        ray.get(engine.randomize_weights.remote(5))
        first = ray.get(source.sync.remote())
        assert first["sync/bytes_sent"] == 0 and os.listdir(tmp_path / "disk") == []  # version 0 is never written
        assert _mismatches(ray, source, [engine]) == [] and read_applied(str(tmp_path / "local")) == 0
        ray.get(source.rl_steps.remote(1))
        second = ray.get(source.sync.remote())
        assert 0 < second["sync/bytes_sent"] < second["sync/bytes_total"]
        assert os.listdir(tmp_path / "disk") == ["weight_v000001"] and read_applied(str(tmp_path / "local")) == 1
        assert is_delta(str(tmp_path / "disk" / "weight_v000001"))
        # slime's receiver rules (written out in the test, not tidal's) turn the base + v1 into the trainer's weights.
        slime_local = tmp_path / "slime-local"
        shutil.copytree(folder, slime_local)
        slime_apply(str(slime_local), str(tmp_path / "disk" / "weight_v000001"))
        trainer = ray.get(source.checksums.remote())
        locs = _locations(str(slime_local))
        got = {
            n: xxhash.xxh3_128_hexdigest(np.fromfile(p, np.uint8, count=k, offset=o)) for n, (p, o, k) in locs.items()
        }
        assert {n: got[n] for n in trainer} == trainer
        assert _mismatches(ray, source, [engine]) == [] and _versions(ray, [engine]) == [2]
    finally:
        ray.get(source.close.remote())
        for a in (source, engine):
            ray.kill(a)
