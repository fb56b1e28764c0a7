"""Multi-turn loss masks: tokens the environment supplied are out of every loss term, estimator and metric.

Hand-made trajectories on the tiny preset's model (CPU, no Ray): the trainer's micro-batch, its
objective (PPO-clip with TIS, KL and entropy all on) and a backward pass through the real model.
"""

from __future__ import annotations

import pytest
import torch

from tidal.algos.estimators import sample_advantages
from tidal.config.schema import AlgorithmConfig
from tidal.rollout.orchestrate import policy_masks
from tidal.rollout.types import Sample, Turn
from tidal.trainer.microbatch import MicroBatch
from tidal.trainer.objective import RolloutObjective
from tidal.trainer.step import TRAIN_SDPA, check_samples, token_stats

CPU = torch.device("cpu")


def _trajectories() -> list[Sample]:
    # prompt [5, 6]; response: policy [7, 8], tool [9, 10, 11], policy [12]
    a = Sample(
        index=0,
        group=0,
        prompt="",
        prompt_ids=[5, 6],
        response_ids=[7, 8, 9, 10, 11, 12],
        advantage=1.0,
        response_logprobs=[-1.0, -2.0, 0.0, 0.0, 0.0, -0.5],
        loss_mask=[1, 1, 0, 0, 0, 1],
        turns=[Turn("assistant", 0, 2), Turn("tool", 2, 5), Turn("assistant", 5, 6)],
    )
    # single-turn: no mask, every response token trained
    b = Sample(
        index=1,
        group=0,
        prompt="",
        prompt_ids=[13],
        response_ids=[14, 15],
        advantage=-1.0,
        response_logprobs=[-0.3, -0.4],
    )
    return [a, b]  # fmt: skip


def test_microbatch_masks_environment_tokens():
    mb = MicroBatch(_trajectories(), [0, 1], pad_id=0, device=CPU)
    # row 0: response tokens at targets 1..6; targets 3, 4, 5 are the tool's
    assert mb.mask.tolist() == [
        [False, True, True, False, False, False, True],
        [True, True, False, False, False, False, False],
    ]
    assert torch.equal(mb.has_engine_logprobs, mb.mask)  # the tool's tokens have no engine log-prob
    assert (mb.num_response_tokens, mb.num_engine_logprobs) == (5, 5)
    assert mb.tokens == 8 + 3


def test_environment_tokens_get_zero_gradient():
    from tidal.model.load import build_model, resolve_model

    model = build_model(resolve_model("tiny"), seed=0)
    samples = _trajectories()
    mb = MicroBatch(samples, [0, 1], pad_id=0, device=CPU)
    seen = {}

    def keep_logits(_m, _inp, out):
        out.retain_grad()
        seen["logits"] = out

    handle = model.lm_head.register_forward_hook(keep_logits)
    algo = AlgorithmConfig(use_tis=True, use_kl_loss=True, kl_loss_coef=0.5, entropy_coef=0.1)
    obj = RolloutObjective(algo, CPU)
    logp, ent = token_stats(model, mb, entropy=True, entropy_grad=True, compile=False)
    handle.remove()
    obj.prepare(mb, logp.detach() + 0.05)  # an old policy that differs, so the ratio is not 1
    mb.ref_logprobs = logp.detach() - 0.1
    loss, metrics = obj.loss(mb, logp, ent, normalizer=float(mb.num_response_tokens))
    loss.backward()
    grad = seen["logits"].grad  # [B, T, V]; position t predicts target t
    per_pos = grad.abs().sum(-1)
    trained = torch.zeros_like(per_pos, dtype=torch.bool)
    trained[:, :-1] = mb.mask
    assert torch.all(per_pos[~trained] == 0), "a token the environment supplied (or a pad) got a gradient"
    assert torch.all(per_pos[trained] > 0)
    # metrics count only trained tokens: the mismatch count is the policy's 5 tokens, not the 8 response tokens
    assert float(obj.sums[2]) == 5.0 and float(metrics["num_tokens"]) == 5.0


def test_logits_at_trained_positions_only_give_the_same_loss_and_gradients():
    """--trained-logits-only: the head runs on the policy's response positions alone; the log-probs and the
    entropy there, the loss and every parameter's gradient equal the full pass's, and the other positions
    (prompt, the environment's tokens, pads) hold 0."""
    from tidal.model.load import build_model, resolve_model

    model = build_model(resolve_model("tiny"), seed=0)
    mb = MicroBatch(_trajectories(), [0, 1], pad_id=0, device=CPU)
    algo = AlgorithmConfig(use_tis=True, use_kl_loss=True, kl_loss_coef=0.5, entropy_coef=0.1)
    seen, out = [], {}

    def head_rows(_m, inp, _out):
        seen.append(inp[0].shape[:-1])

    from transformers import masking_utils

    checks = []  # transformers' packed-sequence check (a host sync on CUDA): never called by token_stats
    original = masking_utils.find_packed_sequence_indices
    handle = model.lm_head.register_forward_hook(head_rows)
    masking_utils.find_packed_sequence_indices = lambda *a: checks.append(1)
    # SDPA's kernels in the trainer's order inside its model calls (cuDNN after flash and memory-efficient: it
    # builds a graph per new shape); the process default outside.
    orders = []
    attn = model.model.layers[0].self_attn.register_forward_hook(
        lambda *_: orders.append(torch._C._get_sdp_priority_order()[:4])
    )
    default = torch._C._get_sdp_priority_order()
    for trained_only in (False, True):
        model.zero_grad(set_to_none=True)
        logp, ent = token_stats(model, mb, entropy=True, entropy_grad=True, compile=False, trained_only=trained_only)
        obj = RolloutObjective(algo, CPU)
        obj.prepare(mb, logp.detach() + 0.05)
        mb.ref_logprobs = logp.detach() - 0.1
        loss, _ = obj.loss(mb, logp, ent, normalizer=float(mb.num_response_tokens))
        loss.backward()
        out[trained_only] = (logp, ent, loss, {n: p.grad.clone() for n, p in model.named_parameters()})
    handle.remove()
    attn.remove()
    masking_utils.find_packed_sequence_indices = original
    assert checks == []
    assert orders == [[int(b) for b in TRAIN_SDPA]] * 2 and torch._C._get_sdp_priority_order() == default
    assert seen == [mb.input_ids.shape, (mb.num_response_tokens,)]  # [B, T] rows, then the 5 trained ones
    (lp_all, ent_all, loss_all, g_all), (lp, ent, loss, g) = out[False], out[True]
    m = mb.mask
    torch.testing.assert_close(lp[m], lp_all[m], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent[m], ent_all[m], rtol=1e-6, atol=1e-6)
    assert torch.all(lp[~m] == 0) and torch.all(ent[~m] == 0)
    torch.testing.assert_close(loss, loss_all, rtol=1e-6, atol=1e-7)
    for name, grad in g_all.items():
        torch.testing.assert_close(g[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_loss_ignores_environment_token_values():
    """Changing what the trainer computes at the tool's positions changes neither the loss nor its metrics."""
    mb = MicroBatch(_trajectories(), [0, 1], pad_id=0, device=CPU)
    algo = AlgorithmConfig(use_tis=True, use_kl_loss=True, kl_loss_coef=0.5, entropy_coef=0.1)
    base = torch.full(mb.mask.shape, -1.0)
    noisy = torch.where(mb.mask, base, torch.randn(mb.mask.shape) * 5)
    results = []
    for lp in (base, noisy):
        obj = RolloutObjective(algo, CPU)
        obj.prepare(mb, lp + 0.05)
        mb.ref_logprobs = lp - 0.1
        loss, m = obj.loss(mb, lp, lp.abs(), normalizer=5.0)
        results.append((float(loss), {k: float(v) for k, v in m.items()}, obj.sums.tolist()))
    assert results[0] == results[1]


def test_per_token_advantages_skip_environment_tokens():
    samples = _trajectories()
    mask = policy_masks(samples)
    assert mask.tolist() == [[True, True, False, False, False, True], [True, True, False, False, False, False]]
    assert policy_masks([samples[1]]) is None  # single-turn: the default mask
    lens = torch.tensor([6.0, 2.0])
    rewards = torch.tensor([1.0, 0.0])
    per_seq, tok = sample_advantages(rewards, lens, 2, AlgorithmConfig(advantage_estimator="reinforce_plus_plus"), mask)
    assert torch.all(tok[~mask] == 0) and torch.all(tok[mask] != 0)
    # the row mean is over the trained tokens only
    torch.testing.assert_close(per_seq, tok.sum(-1) / mask.sum(-1))


def test_bad_loss_mask_is_refused():
    s = _trajectories()[0]
    s.loss_mask = [1, 0]
    with pytest.raises(ValueError, match="loss mask of 2 entries for 6 response tokens"):
        check_samples([s], vocab=100, model_name="tiny", max_tokens=1000, warn=False)
    assert Sample(index=0, group=0, prompt="", response_ids=[1, 2], loss_mask=[0, 1]).num_policy_tokens == 1
