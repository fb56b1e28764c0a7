"""The trainer on one CUDA GPU: bf16 compute over fp32 masters, torch_memory_saver pause/resume, NCCL rebuild.

Run on the GPU host: ``pytest -m gpu -s tests/gpu/test_trainer_gpu.py``. Prints the measured figures
(train tokens/s, pause/resume seconds and GB/s, device memory before/after pause).
"""

from __future__ import annotations

import math
import random
import sys

import pytest

from tidal.config.schema import AlgorithmConfig, MemoryConfig, ModelConfig, TrainerConfig, WeightSyncConfig
from tidal.rollout.types import Sample

pytestmark = pytest.mark.gpu

MODEL = "qwen2.5-0.5b-shape"


def _free_port() -> int:
    # Where the driver picks rank 0's rendezvous port: outside the kernel's ephemeral range, which Ray's
    # processes draw from while the ranks start (a port-0 pick collided with one: EADDRINUSE at init).
    from tidal.cluster.groups import _free_port as rendezvous_port

    return rendezvous_port()


def _start(ray, *, backend="tms", host_memory=None):
    from tidal.trainer.actor import TrainerActor

    cls = ray.remote(num_gpus=1, num_cpus=1)(TrainerActor)
    actor = cls.remote(
        0,
        1,
        "127.0.0.1",
        _free_port(),
        model=ModelConfig(model=MODEL),
        trainer=TrainerConfig(lr=1e-5, lr_warmup_steps=1, global_batch_size=8, max_tokens_per_gpu=2048),
        algorithm=AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01),
        memory=MemoryConfig(
            offload_train=True, memory_backend=backend, tms_hook_mode="torch", offload_host_memory=host_memory
        ),
        weight_sync=WeightSyncConfig(),
        device="cuda",
    )
    info = ray.get(actor.init.remote(), timeout=600)
    return actor, info


def _samples(seed: int, n: int = 16) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append(
            Sample(
                index=i,
                group=i // 4,
                prompt="",
                prompt_ids=[rng.randint(4, 48) for _ in range(rng.randint(32, 200))],
                response_ids=[rng.randint(4, 48) for _ in range(rng.randint(16, 128))],
                advantage=1.0 if i % 2 == 0 else -1.0,
            )
        )
    return out


def _adopted(self) -> tuple[int, int]:
    state = self._optimizer_tensors()
    return len(state), sum(map(self.optimizer_home.holds, state))


def test_the_shared_cluster_offers_the_hosts_gpus(ray_cluster):
    """The test session's cluster (tests/conftest.py) has this host's GPUs: the actors below ask for one each, and
    a cluster started with none never places them (the tests then wait, then fail)."""
    import torch

    assert ray_cluster.cluster_resources().get("GPU", 0) == torch.cuda.device_count() >= 1


def test_gpu_train_pause_resume_bitwise_and_nccl_rebuilt(ray_cluster, tmp_path):
    ray = ray_cluster
    actor, info = _start(ray)
    assert info["param_dtype"] == "bfloat16"
    m = ray.get(actor.train.remote(_samples(0), 0))
    assert all(math.isfinite(m[k]) for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"))
    print(
        f"\ntrain: {m['tokens']} tokens in {m['train_s']:.2f} s = {m['tokens_per_s']:.0f} tokens/s, grad_norm {m['grad_norm']:.3g}"
    )

    # AdamW's moments, created by the first step outside any region, were moved into OPTIMIZER (by identity).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    n_state, n_adopted = ray.get(actor.__ray_call__.remote(_adopted))
    assert n_state > 0 and n_adopted == n_state, (n_state, n_adopted)

    state = ray.get(actor.state_checksums.remote())
    live_bf16 = ray.get(actor.weight_checksums.remote("bfloat16"))
    p = ray.get(actor.pause.remote()).metrics
    kept = p["memory/trainer_pause/weights/backup_bytes"] + p["memory/trainer_pause/optimizer/backup_bytes"]
    freed = p["memory/trainer_pause/device_used_before"] - p["memory/trainer_pause/device_used_after"]
    rss = p["memory/trainer_pause/host_rss_after"] - p["memory/trainer_pause/host_rss_before"]
    print(
        f"pause: {p['memory/trainer_pause/total_s']:.2f} s, backed up {kept / 2**30:.2f} GiB, device used "
        f"{p['memory/trainer_pause/device_used_before'] / 2**30:.2f} -> {p['memory/trainer_pause/device_used_after'] / 2**30:.2f} GiB, "
        f"host RSS +{rss / 2**30:.2f} GiB; optimizer state adopted {n_adopted} of {n_state}"
    )
    assert p["memory/trainer_pause/groups_released"] == 1
    assert freed >= 0.9 * kept, (freed, kept)
    # Weight source while paused reads the host backups: the same bf16 bytes as the live weights.
    assert ray.get(actor.weight_checksums.remote("bfloat16")) == live_bf16
    ckpt = str(tmp_path / "ckpt")
    ray.get(actor.save.remote(ckpt, {"rollout_id": 0}))  # saved while paused, from host backups

    r = ray.get(actor.resume.remote()).metrics
    print(
        f"resume: {r['memory/trainer_resume/total_s']:.2f} s, groups rebuilt {r['memory/trainer_resume/groups_rebuilt']}"
    )
    assert r["memory/trainer_resume/groups_rebuilt"] == 1
    assert ray.get(actor.state_checksums.remote()) == state
    m2 = ray.get(actor.train.remote(_samples(1), 1))  # FSDP over the rebuilt NCCL group
    assert math.isfinite(m2["loss"])
    # The loop's order: optimizer state and gradients paused first, the weights read live and then paused.
    live_bf16 = ray.get(actor.weight_checksums.remote("bfloat16"))
    trained = ray.get(actor.state_checksums.remote())
    ray.get(actor.pause.remote(keep_weights=True))
    assert ray.get(actor.weight_checksums.remote("bfloat16")) == live_bf16
    both = ray.get(actor.pause.remote()).metrics
    assert both["memory/trainer_pause/weights/backup_bytes"] > 0
    assert both["memory/trainer_pause/optimizer/backup_bytes"] > 0
    assert both["memory/trainer_pause/device_used_after"] < both["memory/trainer_pause/device_used_before"]
    ray.get(actor.resume.remote())
    assert ray.get(actor.state_checksums.remote()) == trained
    ray.kill(actor)

    fresh, _ = _start(ray)
    ray.get(fresh.load.remote(ckpt))
    assert ray.get(fresh.state_checksums.remote()) == state
    # CUDA backward is not bitwise deterministic (atomics in the embedding gradient), so the step
    # after loading is compared by its metrics; the loaded state itself is compared bit for bit above.
    m3 = ray.get(fresh.train.remote(_samples(1), 1))
    assert abs(m3["loss"] - m2["loss"]) <= 1e-3 * max(1.0, abs(m2["loss"])), (m3["loss"], m2["loss"])
    after = ray.get(fresh.state_checksums.remote())
    out = str(tmp_path / "hf")
    ray.get(fresh.export.remote(out))
    ray.kill(fresh)

    from transformers import AutoModelForCausalLM

    from tidal.weight_sync.checksum import tensor_checksum

    model = AutoModelForCausalLM.from_pretrained(out)
    got = {f"{n}": tensor_checksum(p.detach()) for n, p in model.named_parameters()}
    assert {k: after[k] for k in got} == got
    print(f"checkpoint: loaded state bit-identical, next loss {m3['loss']:.6f} vs {m2['loss']:.6f}; export loads")


def test_retained_optimizer_state_resumes_deferred_and_bit_exact(ray_cluster, tmp_path):
    """Under retain the optimizer state has tidal's own backup: its release is left to the second pause stage
    (``pause()``, or ``settle_pause()`` where the weights stay) and its resume is deferred (the copy beside the
    next train's passes), and what a settled read, a checkpoint saved while paused and the next pause see is the
    state as it was paused."""
    ray = ray_cluster
    actor, _ = _start(ray, host_memory="retain")
    ckpt = str(tmp_path / "ckpt")
    try:
        assert "train_reserved_bytes" not in ray.get(actor.train.remote(_samples(2), 0))  # no pause before it
        for rollout in (1, 2):
            state = ray.get(actor.state_checksums.remote())
            first = ray.get(actor.pause.remote(keep_weights=True)).metrics
            # A small model on a large device: room for the engines' weights beside the optimizer state, whose
            # release waits for the second stage (its copy out beside the sync).
            assert first["memory/trainer_pause/optimizer/deferred"] == 1
            if rollout == 1:
                ray.get(actor.pause.remote())
                saved = state
                ray.get(actor.save.remote(ckpt, {"rollout_id": 0}))  # the moments read from tidal's own backup
            else:
                # The sync's second stage where the weights stay (settle_pause): the late release finished, the
                # optimizer state's device memory handed back, the weights kept.
                kept = ray.get(actor.settle_pause.remote()).metrics
                assert (
                    kept["memory/trainer_pause/weights_kept"] == 1 and "memory/trainer_pause/weights/bytes" not in kept
                )
                freed = kept["memory/trainer_pause/device_used_before"] - kept["memory/trainer_pause/device_used_after"]
                assert freed >= kept["memory/trainer_pause/optimizer/bytes"], kept
            r = ray.get(actor.resume.remote()).metrics
            assert (
                r["memory/trainer_resume/optimizer/deferred"] == 1 and "memory/trainer_resume/weights/deferred" not in r
            )
            assert ray.get(actor.state_checksums.remote()) == state  # settled first
            m = ray.get(actor.train.remote(_samples(2 + rollout), rollout))  # settled before its optimizer step
            assert all(math.isfinite(m[k]) for k in ("loss", "grad_norm")), m
            # What the last train needed of the blocks the pause freed came back first, as one block.
            assert m["train_reserved_bytes"] >= 2**26 and m["train_reserve_s"] < m["train_s"], m
        # A deferred state paused again before anything settled it: the pause settles, then backs up.
        trained = ray.get(actor.state_checksums.remote())
        ray.get(actor.pause.remote())
        ray.get(actor.resume.remote())
        ray.get(actor.pause.remote())
        ray.get(actor.resume.remote())
        assert ray.get(actor.state_checksums.remote()) == trained
        ray.get(actor.load.remote(ckpt))
        assert ray.get(actor.state_checksums.remote()) == saved
    finally:
        ray.kill(actor)


def _bench_trainer_row(*flags: str) -> dict:
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tidal.bench.trainer", "--device", "cuda", "--model", MODEL, "--samples", "32"]
    cmd += ["--prompt-len", "64", "--response-len", "128", "--max-tokens-per-gpu", "4096", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd[2:])} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return json.loads([line for line in done.stdout.splitlines() if line.startswith('{"model"')][-1])


def test_compiled_layers_give_the_same_loss():
    """--compile-layers: the same samples and seed give the same loss, entropy and gradient norm as the eager
    layers, up to bf16 rounding (the loss of an on-policy step hardly depends on the kernels; the
    entropy and the gradient norm do)."""
    eager = _bench_trainer_row()
    compiled = _bench_trainer_row("--compile-layers")
    for tag, r in (("eager", eager), ("compiled", compiled)):
        print(
            f"\n[{tag}] first call {r['first_train_s']:.1f} s, then {r['train_s']:.3f} s "
            f"({r['train_tokens_per_s']:.0f} tokens/s), losses {r['first_loss']:.6f} / {r['loss']:.6f}, "
            f"entropy {r['entropy']:.5f}, grad norm {r['grad_norm']:.5f}"
        )
    assert compiled["compile_layers"] and not eager["compile_layers"]
    for key, tol in (("first_loss", 2e-3), ("loss", 2e-3), ("entropy", 1e-2), ("grad_norm", 3e-2)):
        assert abs(compiled[key] - eager[key]) <= tol * max(1.0, abs(eager[key])), (key, eager[key], compiled[key])


def test_a_micro_batchs_loss_and_metrics_never_wait_for_the_device():
    """What the trainer runs per micro-batch besides the model (its arrays sent from a reused staging slot, the
    old policy and its correction, the loss, its metrics, the rollout sums, the backward) makes no
    synchronising CUDA call: under the sync debug mode's "error" any would raise. A tensor built from host data on the device (torch.tensor,
    as_tensor) is one; the rollout's one transfer of its sums at the end is the only wait."""
    import torch

    from tidal.trainer.microbatch import MicroBatch, StagingSlot
    from tidal.trainer.objective import RolloutObjective
    from tidal.trainer.step import RolloutSums

    dev = torch.device("cuda")
    samples = _samples(0, n=8)
    for s in samples:
        s.response_logprobs = [-1.0] * len(s.response_ids)
    slot = StagingSlot()
    first = MicroBatch(samples, list(range(8)), pad_id=0, device=dev, stage=slot)
    algo = AlgorithmConfig(use_tis=True, use_kl_loss=True, kl_loss_coef=0.01, entropy_coef=0.01)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        # Built again in its staging slot (reused, its last copy done): no wait either, and the same tensors.
        mb = MicroBatch(samples, list(range(8)), pad_id=0, device=dev, stage=slot)
        logits = torch.randn(*mb.mask.shape, device=dev, requires_grad=True)
        sums, objective = RolloutSums(dev), RolloutObjective(algo, dev)
        logprobs = torch.nn.functional.logsigmoid(logits)
        old = logprobs.detach().float()
        sums.engine_diff(mb, old)
        objective.prepare(mb, old)
        mb.ref_logprobs = old - 0.01
        loss, m = objective.loss(mb, logprobs, -logprobs, normalizer=float(mb.num_response_tokens))
        loss.backward()
        sums.add_loss(mb, m, float(mb.num_response_tokens))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss) and logits.grad is not None
    for name in (
        "input_ids",
        "next_ids",
        "attention_mask",
        "mask",
        "has_engine_logprobs",
        "engine_logprobs",
        "advantages",
        "trained_positions",
    ):
        assert torch.equal(getattr(mb, name), getattr(first, name)), name
