"""PPO's critic and TIS on one CUDA GPU: bf16 compute, torch_memory_saver pause/resume of both models.

Run on the GPU host: ``pytest -m gpu -s tests/gpu/test_critic_gpu.py``. Prints the measured figures
(train seconds and tokens/s with and without the critic, device memory freed by a pause).
"""

from __future__ import annotations

import math
import sys

import pytest
from test_trainer_gpu import MODEL, _adopted, _free_port, _samples

from tidal.config.schema import AlgorithmConfig, MemoryConfig, ModelConfig, TrainerConfig, WeightSyncConfig

pytestmark = pytest.mark.gpu


def _start(ray, algorithm: AlgorithmConfig):
    from tidal.trainer.actor import TrainerActor

    cls = ray.remote(num_gpus=1, num_cpus=1)(TrainerActor)
    actor = cls.remote(
        0,
        1,
        "127.0.0.1",
        _free_port(),
        model=ModelConfig(model=MODEL),
        trainer=TrainerConfig(lr=1e-5, lr_warmup_steps=1, global_batch_size=8, max_tokens_per_gpu=2048),
        algorithm=algorithm,
        memory=MemoryConfig(offload_train=True, memory_backend="tms", tms_hook_mode="torch"),
        weight_sync=WeightSyncConfig(),
        device="cuda",
    )
    return actor, ray.get(actor.init.remote(), timeout=600)


def _with_rewards_and_engine_logprobs(seed: int):
    samples = _samples(seed)
    for i, s in enumerate(samples):
        s.reward = float(i % 2)
        # An engine that disagrees with the trainer by up to ~0.1 nats per token.
        s.response_logprobs = [-3.0 - 0.1 * ((i + t) % 3 - 1) for t in range(len(s.response_ids))]
    return samples


def test_ppo_critic_and_tis_train_pause_and_resume_on_cuda(ray_cluster):
    ray = ray_cluster
    algo = AlgorithmConfig(advantage_estimator="ppo", use_critic=True, use_tis=True, tis_clip=2.0, critic_lr=1e-5)
    actor, info = _start(ray, algo)
    assert info["critic_params"] > 0 and info["param_dtype"] == "bfloat16"
    m = ray.get(actor.train.remote(_with_rewards_and_engine_logprobs(0), 0))
    for key in ("loss", "value_loss", "critic_grad_norm", "mismatch/k3", "mismatch/ratio_max"):
        assert math.isfinite(m[key]), key
    assert m["mismatch/k3"] > 0
    # The policy's and the critic's AdamW moments were moved into OPTIMIZER after their first step.
    ray.cloudpickle.register_pickle_by_value(sys.modules["test_trainer_gpu"])
    n_state, n_adopted = ray.get(actor.__ray_call__.remote(_adopted))
    assert n_state > 0 and n_adopted == n_state, (n_state, n_adopted)
    state = ray.get(actor.state_checksums.remote())
    p = ray.get(actor.pause.remote()).metrics
    freed = p["memory/trainer_pause/device_used_before"] - p["memory/trainer_pause/device_used_after"]
    r = ray.get(actor.resume.remote()).metrics
    assert ray.get(actor.state_checksums.remote()) == state  # policy and critic back bit for bit
    m2 = ray.get(actor.train.remote(_with_rewards_and_engine_logprobs(1), 1))
    assert math.isfinite(m2["value_loss"])
    ray.kill(actor)

    plain, _ = _start(ray, AlgorithmConfig())
    ray.get(plain.train.remote(_with_rewards_and_engine_logprobs(0), 0))
    g = ray.get(plain.train.remote(_with_rewards_and_engine_logprobs(1), 1))
    gp = ray.get(plain.pause.remote()).metrics
    ray.kill(plain)
    freed_plain = gp["memory/trainer_pause/device_used_before"] - gp["memory/trainer_pause/device_used_after"]
    print(
        f"\nppo+critic+tis: train {m2['train_s']:.2f} s ({m2['tokens_per_s']:.0f} tok/s), pause frees "
        f"{freed / 2**30:.2f} GiB in {p['memory/trainer_pause/total_s']:.2f} s, resume {r['memory/trainer_resume/total_s']:.2f} s; "
        f"grpo: train {g['train_s']:.2f} s ({g['tokens_per_s']:.0f} tok/s), pause frees {freed_plain / 2**30:.2f} GiB; "
        f"mismatch/k3 {m2['mismatch/k3']:.4f} truncated {m2['mismatch/truncated_frac']:.3f}"
    )
    # The critic's weights and AdamW moments are paused with the policy's: about twice the memory freed.
    assert freed > 1.6 * freed_plain, (freed, freed_plain)
