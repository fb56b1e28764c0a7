"""PPO's critic inside the FSDP2 trainer (2 ranks over gloo, paused with the portable backend).

The critic trains next to the policy (its weights and moments change, its value metrics are
reported), pauses and resumes with the trainer's memory classes bit for bit, and is saved and
loaded with the trainer's checkpoint so a resumed run continues the same curve exactly.
"""

from __future__ import annotations

import json
import os

from test_trainer import call, make_samples, start_group

from tidal.config.schema import AlgorithmConfig

PPO = AlgorithmConfig(advantage_estimator="ppo", use_critic=True, gamma=0.9, lambd=0.8, value_clip=0.2, critic_lr=1e-2)


def _samples(seed: int):
    samples = make_samples(seed)
    for i, s in enumerate(samples):
        s.reward, s.advantage = float(i % 2), 0.0  # ppo's advantages come from the critic, not the driver
    return samples


def _critic(checksums: dict) -> dict:
    return {k: v for k, v in checksums.items() if "critic." in k}


def test_critic_trains_pauses_and_checkpoints_with_the_policy(ray_cluster, tmp_path):
    ray = ray_cluster
    ckpt = str(tmp_path / "ckpt")
    a = start_group(ray, algorithm=PPO)
    try:
        init = call(ray, a, "state_checksums")[0]
        critic0 = _critic(init)
        assert (
            any(k.startswith("critic.") for k in critic0) and any(k.startswith("optim/critic.") for k in init) is False
        )
        m = call(ray, a, "train", _samples(10), 0)[0]
        for key in ("value_loss", "value_mean", "value_clipfrac", "critic_grad_norm"):
            assert key in m, key
        assert m["value_loss"] > 0 and m["critic_grad_norm"] > 0
        after1 = call(ray, a, "state_checksums")[0]
        changed = [k for k in critic0 if after1[k] != critic0[k]]
        assert changed, "the critic did not train"
        assert any(k.startswith("optim/critic.") for k in after1)  # its own AdamW moments
        # Paused and resumed with the policy: every critic tensor comes back bit for bit.
        call(ray, a, "pause")
        call(ray, a, "save", ckpt, {"rollout_id": 0})
        call(ray, a, "resume")
        assert call(ray, a, "state_checksums")[0] == after1
        m_a = call(ray, a, "train", _samples(11), 1)[0]
        state_a = call(ray, a, "state_checksums")[0]
    finally:
        for x in a:
            ray.kill(x)

    with open(os.path.join(ckpt, "iter_0000000", "meta.json")) as f:
        meta = json.load(f)
    assert any(k.startswith("critic.") for k in meta["model_index"])

    b = start_group(ray, algorithm=PPO)
    try:
        call(ray, b, "load", ckpt)
        assert call(ray, b, "state_checksums")[0] == after1
        m_b = call(ray, b, "train", _samples(11), 1)[0]
        state_b = call(ray, b, "state_checksums")[0]
        # The Hugging Face export is the policy alone.
        call(ray, b, "export", str(tmp_path / "hf"))
    finally:
        for x in b:
            ray.kill(x)
    assert state_b == state_a, [k for k in state_a if state_a[k] != state_b.get(k)]
    assert m_a["value_loss"] == m_b["value_loss"] and m_a["loss"] == m_b["loss"]
    from safetensors import safe_open

    names = set()
    for f in os.listdir(tmp_path / "hf"):
        if f.endswith(".safetensors"):
            with safe_open(str(tmp_path / "hf" / f), framework="pt") as h:
                names |= set(h.keys())
    assert names and not any(n.startswith("critic.") for n in names)
