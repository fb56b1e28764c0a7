"""Multi-turn rollouts on CUDA: prefix reuse in the fast decode path (CUDA graphs, bf16) gives the policy's
log-probs, and the guess task's loop runs on the device.

Run on the GPU host: ``pytest -m gpu tests/gpu/test_multiturn_gpu.py -s -v``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig, TidalConfig
from tidal.rollout.agent import AgentLoop
from tidal.rollout.embedded import EmbeddedEngine
from tidal.rollout.envs import GuessEnv
from tidal.rollout.generate import teacher_forced_logprobs
from tidal.rollout.types import Sample, SamplingParams

pytestmark = pytest.mark.gpu


class Replies:
    """Answers every turn with 12 fixed ids; never done (every trajectory runs every turn)."""

    stop: list[str] = []
    role = "env"

    def reset(self, sample):
        return None

    def step(self, action):
        return (list(range(10, 22)), 0.0, False)


def _loop(engine, env, turns=4):
    cfg = TidalConfig()
    cfg.rollout = dataclasses.replace(cfg.rollout, max_turns=turns, max_trajectory_tokens=512)
    cfg.data = dataclasses.replace(cfg.data, apply_chat_template=False)
    text = engine.model.config.get_text_config()
    return AgentLoop("test", env, cfg, engine.tokenizer, text.max_position_embeddings, text.vocab_size)


def test_prefix_reuse_on_cuda_keeps_policy_logprobs():
    engine = EmbeddedEngine(
        ModelConfig(model="tiny-qwen2"),
        RolloutConfig(rollout_prefix_cache_mb=256, rollout_compile=False),
        MemoryConfig(),
        device="cuda",
    )
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(index=i, group=i, prompt="", prompt_ids=torch.randint(4, 50, (int(n),), generator=gen).tolist())
        for i, n in enumerate(torch.randint(8, 40, (64,), generator=gen))
    ]
    out = _loop(engine, Replies).run(
        engine.generate, samples, SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)
    )
    stats = engine._fast_decoder.prefixes.stats()
    print("\n[prefix] " + json.dumps(stats), flush=True)
    assert stats["prefix/hits"] == 3 * len(out) and stats["prefix/reused_frac"] > 0.3
    forced = teacher_forced_logprobs(engine.model, [x.prompt_ids for x in out], [x.response_ids for x in out])
    diffs = [abs(a - b) for x, f in zip(out, forced) for a, b, m in zip(x.response_logprobs, f, x.loss_mask) if m]
    mean = sum(diffs) / len(diffs)
    print(f"[prefix] policy tokens {len(diffs)}, mean |engine - forward| {mean:.4f}, max {max(diffs):.4f}")
    assert mean < 0.05  # bf16: the same tolerance as single-turn decoding against a forward pass


def test_guess_loop_on_cuda():
    engine = EmbeddedEngine(
        ModelConfig(model="tiny"),
        RolloutConfig(rollout_prefix_cache_mb=64, rollout_compile=False),
        MemoryConfig(),
        device="cuda",
    )
    tok = engine.tokenizer
    samples = [
        Sample(index=i, group=i, prompt="guess:", label=str(i % 3), prompt_ids=tok.encode("guess:")) for i in range(48)
    ]
    out = _loop(engine, GuessEnv, turns=2).run(engine.generate, samples, SamplingParams(max_new_tokens=1, seed=1))
    assert all(x.status == "completed" and len(x.loss_mask) == len(x.response_ids) for x in out)
    assert all(x.turns[0].role == "assistant" for x in out)
