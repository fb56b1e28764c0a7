"""The embedded engine on a CUDA GPU: bf16 generation, policy log-probs, release/resume with real device memory.

pytest -m gpu tests/gpu/test_engine_gpu.py -s
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig, WeightSyncConfig
from tidal.errors import ResidencyError
from tidal.model import build_model, resolve_model
from tidal.rollout.embedded import EmbeddedEngine
from tidal.rollout.generate import teacher_forced_logprobs
from tidal.rollout.types import Sample, SamplingParams
from tidal.weight_sync.bucket import BucketHeader, pack, plan_buckets
from tidal.weight_sync.checksum import tensor_checksum
from tidal.weight_sync.stream import Bucket

pytestmark = pytest.mark.gpu


def samples_for(engine: EmbeddedEngine, rows: int, prompt_len: int = 24, seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        ids = torch.randint(4, 49, (prompt_len - i % 5,), generator=gen).tolist()  # ordinary char tokens, ragged
        out.append(Sample(index=i, group=i // 4, prompt=None, prompt_ids=ids))
    return out


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def payloads(named: dict[str, torch.Tensor], version: int, limit: int) -> list[BucketHeader]:
    import ray

    groups = list(plan_buckets(named.items(), limit))
    out = []
    for i, group in enumerate(groups):
        data, entries = pack(group)
        b = Bucket(i, "full", entries, data, [n for n, _ in group], last=i == len(groups) - 1, all_names=list(named))
        out.append(dataclasses.replace(b.header(version, None, False, {}), data=("object", ray.put(data.numpy()))))
    return out


@pytest.mark.parametrize("dtype, tol_max, tol_mean", [("float32", 1e-3, 1e-4), ("bfloat16", 0.5, 0.05)])
def test_generate_on_cuda_and_policy_logprobs(dtype, tol_max, tol_mean):
    eng = EmbeddedEngine(ModelConfig(model="tiny-qwen2"), RolloutConfig(), MemoryConfig(), device="cuda", dtype=dtype)
    sp = SamplingParams(temperature=0.8, top_k=16, top_p=0.95, max_new_tokens=32, seed=3)
    out = eng.generate(samples_for(eng, 64), sp)
    assert all(1 <= len(s.response_ids) == len(s.response_logprobs) <= 32 for s in out)
    assert {s.status for s in out} <= {"completed", "truncated"}
    forced = teacher_forced_logprobs(eng.model, [s.prompt_ids for s in out], [s.response_ids for s in out])
    diff = torch.tensor([abs(a - b) for s, f in zip(out, forced) for a, b in zip(s.response_logprobs, f)])
    print(
        f"{dtype}: logprob diff vs teacher-forced max {diff.max():.2e} mean {diff.mean():.2e} over {diff.numel()} tokens"
    )
    assert diff.max() < tol_max and diff.mean() < tol_mean
    again = eng.generate(samples_for(eng, 64), sp)
    assert [s.response_ids for s in again] == [s.response_ids for s in out]  # seeded: reproducible


def test_release_frees_device_memory_and_sync_restores_generation(ray_cluster):
    eng = EmbeddedEngine(
        ModelConfig(model="qwen2.5-0.5b-shape"), RolloutConfig(), MemoryConfig(memory_backend="portable"), device="cuda"
    )
    sp = SamplingParams(temperature=0.0, max_new_tokens=16)
    before = eng.generate(samples_for(eng, 32), sp)
    named = eng.named_weights()
    weights = eng.param_bytes()

    used = device_used()
    report = eng.release_memory()
    freed = used - device_used()
    print(
        f"release: weights {weights / 2**20:.0f} MiB, device memory freed {freed / 2**20:.0f} MiB in {report['memory/engine_release/seconds']:.3f} s"
    )
    assert freed >= 0.9 * weights
    with pytest.raises(ResidencyError):
        eng.generate(samples_for(eng, 2), sp)

    eng.resume_memory(["weights"])
    for p in payloads(named, 1, limit=256 << 20):
        eng.update_weights_from_tensor(p, 1)
    eng.resume_memory(["kv_cache"])
    after = eng.generate(samples_for(eng, 32), sp)
    assert [s.response_ids for s in after] == [s.response_ids for s in before]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_engine_actor_with_torch_memory_saver(ray_cluster, compiled):
    """An engine actor on the GPU with the tms backend: release frees the weights, a sync restores them bitwise,
    and the decode step (compiled or not) is built after the resume."""
    from tidal.rollout.actor import EngineActor
    from tidal.weight_sync.tensor import TensorStrategy

    ray = ray_cluster
    cfgs = dict(
        model=ModelConfig(model="qwen2.5-0.5b-shape"),
        rollout=RolloutConfig(rollout_compile=compiled),
        memory=MemoryConfig(memory_backend="tms"),
        weight_sync=WeightSyncConfig(),
    )
    actor = ray.remote(EngineActor).options(num_gpus=1, num_cpus=1).remote(0, device="cuda", **cfgs)
    info = ray.get(actor.init.remote())
    assert info["memory_backend"] == "tms" and info["dtype"] == "bfloat16"

    trainer = build_model(resolve_model("qwen2.5-0.5b-shape"), dtype=torch.bfloat16, seed=1234)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.01)
    want = {n: tensor_checksum(p) for n, p in trainer.named_parameters()}

    ray.get(actor.randomize_weights.remote(7))
    rel = ray.get(actor.release_memory.remote()).metrics
    print({k: v for k, v in rel.items() if k.endswith(("bytes", "seconds", "device_used_before", "device_used_after"))})
    assert (
        rel["memory/engine_release/device_used_before"] - rel["memory/engine_release/device_used_after"]
        >= 0.9 * info["param_bytes"]
    )
    ray.get(actor.resume_memory.remote(["weights"]))
    strategy = TensorStrategy(WeightSyncConfig(update_weight_transport="tensor"), [actor], device="cpu")
    strategy.connect()
    report = strategy.sync([(n, p.detach()) for n, p in trainer.named_parameters()], 1)
    print(f"sync: {report.bytes_total / 2**20:.0f} MiB in {report.seconds:.3f} s")
    assert ray.get(actor.weight_checksums.remote()) == want
    ray.get(actor.resume_memory.remote(["kv_cache"]))
    samples = [Sample(index=i, group=0, prompt=None, prompt_ids=[5, 6, 7, 8 + i]) for i in range(8)]
    out = ray.get(actor.generate.remote(samples, SamplingParams(max_new_tokens=8, seed=0)))
    assert all(len(s.response_ids) == 8 and s.weight_version == 1 for s in out)
    # The policy after release -> resume -> sync is the trainer's: buffers a sync does not carry (rotary
    # inv_freq) must survive the release, so the engine's log-probs match a teacher-forced pass of the
    # trainer's model within bf16 noise (a zeroed inv_freq gave a mean |diff| of 0.17 on this shape).
    forced = teacher_forced_logprobs(trainer.cuda(), [s.prompt_ids for s in out], [s.response_ids for s in out])
    diff = torch.tensor([abs(a - b) for s, f in zip(out, forced) for a, b in zip(s.response_logprobs, f)])
    print(f"after release/resume/sync: log-prob |diff| max {diff.max():.3f} mean {diff.mean():.4f}")
    assert diff.mean() < 0.03
    ray.kill(actor)


def test_preset_drawn_on_the_device_matches_the_trainers_draw():
    """--init-on-device: the engine's bf16 weights equal the bf16 cast of the fp32 model the trainer draws on
    the same GPU from the same seed (before any sync), two engines draw the same, and the device draw is
    faster than the host's (printed)."""
    import time

    spec = resolve_model("qwen2.5-0.5b-shape")
    times = {}
    sums = []
    for on in (True, True, False):
        t0 = time.perf_counter()
        engine = EmbeddedEngine(
            ModelConfig(model=spec.name, init_on_device=on), RolloutConfig(), MemoryConfig(), device="cuda", seed=7
        )
        times.setdefault(on, time.perf_counter() - t0)
        sums.append(engine.weight_checksums())
        del engine
        torch.cuda.empty_cache()
    print(f"\n[init] engine built in {times[True]:.1f} s on the device, {times[False]:.1f} s on the host")
    assert sums[0] == sums[1]
    assert sums[0] != sums[2]  # a different generator: different (equally random) numbers
    trainer_side = build_model(spec, dtype=torch.float32, seed=7, device="cuda")
    want = {n: tensor_checksum(p.detach().to(torch.bfloat16)) for n, p in trainer_side.named_parameters()}
    assert want == sums[0]


def test_a_warm_up_captures_what_the_first_generate_needs_and_changes_no_token():
    """On CUDA the warm-up compiles the decode step and captures the graph of the first wave's batch bucket:
    the first generate at those rows then captures nothing, and it samples what an engine that never
    warmed samples."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=16)
    warmed = EmbeddedEngine(ModelConfig(model="tiny-qwen2"), RolloutConfig(), MemoryConfig(), device="cuda")
    cold = EmbeddedEngine(ModelConfig(model="tiny-qwen2"), RolloutConfig(), MemoryConfig(), device="cuda")
    report = warmed.warm_up(48, sp)
    assert report.warmed == ["decode step"] and report.rows == 48 and report.graph_captures >= 1
    a = warmed.generate(samples_for(warmed, 48), sp)
    assert warmed._decoder().last_stats["graph_captures"] == 0
    b = cold.generate(samples_for(cold, 48), sp)
    assert cold._decoder().last_stats["graph_captures"] >= 1
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
