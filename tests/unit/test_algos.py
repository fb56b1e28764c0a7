"""Advantages and losses against values worked out by hand (derivations in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algos import (
    RLInputs,
    aggregate_sum,
    dynamic_sampling_keep,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    loss_normalizer,
    masked_mean,
    policy_loss,
    rl_loss,
    token_logprobs,
    zero_variance_groups,
)
from tidal.config.schema import AlgorithmConfig


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol)


# --- advantages -------------------------------------------------------------------------------


def test_grpo_advantages_hand_values():
    # group 0: [1, 0, 0, 1] mean 0.5; centred +-0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.577350
    #          -> +-0.5 / 0.577350 = +-0.866025
    # group 1: [1, 1, 1, 1] -> all zero (std 0, eps keeps it finite)
    # group 2: [0, 1, 2, 3] mean 1.5; centred [-1.5, -0.5, 0.5, 1.5]; std = sqrt((2.25+0.25)*2/3) = 1.290994
    #          -> [-1.161895, -0.387298, 0.387298, 1.161895]
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 2, 3])
    adv = grpo_advantages(r, 4)
    expected = [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0, -1.161895, -0.387298, 0.387298, 1.161895]
    assert close(adv, expected)
    # Dr.GRPO: mean-centred only
    assert close(grpo_advantages(r, 4, std_normalize=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -1.5, -0.5, 0.5, 1.5])


def test_grpo_advantages_edge_cases():
    # a group of one has nothing to compare with: zero, not nan
    assert close(grpo_advantages(torch.tensor([3.0, 5.0]), 1), [0.0, 0.0])
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(torch.ones(4), 3)


def test_zero_variance_and_dynamic_sampling():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    # groups of 2: [1,1] equal, [0,1] differ, [0,0] equal, [.5,.5] equal
    assert zero_variance_groups(r, 2).tolist() == [True, False, True, True]
    assert dynamic_sampling_keep(r, 2).tolist() == [False, False, True, True, False, False, False, False]
    # groups of 4: [1,1,0,1] differ, [0,0,.5,.5] differ
    assert dynamic_sampling_keep(r, 4).tolist() == [True] * 8


# --- policy loss ------------------------------------------------------------------------------


def _ratios(*rs):
    """logprobs whose ratio to old_logprobs = 0 is exactly rs."""
    return torch.tensor([[math.log(r) for r in rs]], requires_grad=True)


def test_policy_loss_positive_advantage():
    # old = 0, ratios r = [1.5, 0.5, 1.1], A = 1, eps = 0.2:
    #   t0: max(-1.5, -clip(1.5)=-1.2) = -1.2 (clipped: no gradient)
    #   t1: max(-0.5, -clip(0.5)=-0.8) = -0.5
    #   t2: max(-1.1, -1.1) = -1.1
    #   mean = -2.8 / 3 = -0.933333; clipfrac = 1/3; ratio_mean = 3.1 / 3 = 1.033333
    #   approx_kl = mean(old - logp) = -(ln1.5 + ln0.5 + ln1.1) / 3 = 0.192372 / 3 = 0.064124
    logp = _ratios(1.5, 0.5, 1.1)
    loss, m = policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3), eps_clip=0.2)
    assert close(loss, -0.933333)
    assert close(m["clipfrac"], 1 / 3) and close(m["ratio_mean"], 1.033333) and close(m["approx_kl"], 0.064124)
    loss.backward()
    # d/dlogp of -A * r / 3 is -r / 3 where unclipped, 0 where clipped
    assert close(logp.grad, [[0.0, -0.5 / 3, -1.1 / 3]])


def test_policy_loss_negative_advantage_and_high_clip():
    # A = -1: t0: max(1.5, 1.2) = 1.5; t1: max(0.5, 0.8) = 0.8 (clipped); t2: 1.1 -> mean 3.4 / 3
    logp = _ratios(1.5, 0.5, 1.1)
    loss, m = policy_loss(logp, torch.zeros(1, 3), torch.tensor([-1.0]), torch.ones(1, 3), eps_clip=0.2)
    assert close(loss, 3.4 / 3) and close(m["clipfrac"], 1 / 3)
    # eps_clip_high = 0.6 with A = 1: t0 max(-1.5, -1.5) = -1.5 unclipped; t1 -0.5; t2 -1.1 -> -3.1 / 3
    loss, m = policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3), 0.2, eps_clip_high=0.6)
    assert close(loss, -3.1 / 3) and close(m["clipfrac"], 0.0)


def test_masked_tokens_contribute_nothing():
    # Row 0 has two valid tokens; masked positions hold garbage that would poison an unmasked sum.
    logp = torch.tensor([[math.log(1.5), 0.0, 50.0], [float("nan"), 0.0, float("inf")]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, -50.0], [0.0, float("-inf"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    adv = torch.tensor([1.0, 7.0])
    loss, m = policy_loss(logp, old, adv, mask, eps_clip=0.2)
    # valid: ratio 1.5 -> -1.2 (clipped), ratio 1 -> -1; mean = -1.1
    assert close(loss, -1.1) and close(m["ratio_mean"], 1.25) and close(m["clipfrac"], 0.5)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 2] == 0 and (logp.grad[1] == 0).all()
    ent = torch.tensor([[0.3, 0.3, float("nan")], [float("inf")] * 3])
    cfg = AlgorithmConfig(entropy_coef=0.1)
    loss, m = rl_loss(RLInputs(logp.detach(), old, adv, mask, entropy=ent), cfg)
    # -1.1 - 0.1 * 0.3
    assert close(loss, -1.13) and close(m["entropy"], 0.3) and m["num_tokens"] == 2 and m["num_seqs"] == 1


def test_seq_mean_token_mean():
    # ratio 1 everywhere, so token loss = -A. Seq 0: A = 1 over 2 tokens; seq 1: A = -2 over 1 token.
    # token-mean: (-1 - 1 + 2) / 3 = 0.  seq-mean-token-mean: (mean(-1, -1) + mean(2)) / 2 = 0.5
    logp = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -2.0])
    assert close(policy_loss(logp, logp, adv, mask, agg="token-mean")[0], 0.0)
    assert close(policy_loss(logp, logp, adv, mask, agg="seq-mean-token-mean")[0], 0.5)
    assert loss_normalizer(mask, "token-mean") == 3 and loss_normalizer(mask, "seq-mean-token-mean") == 2
    assert close(aggregate_sum(torch.tensor([[1.0, 3.0], [5.0, 100.0]]), mask, "seq-mean-token-mean"), 2.0 + 5.0)
    with pytest.raises(ValueError, match="aggregation"):
        loss_normalizer(mask, "sum")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_global_normalizer_over_micro_batches(agg):
    # Splitting a batch into micro-batches and dividing each sum by the global normaliser must give
    # the same loss and gradient as the whole batch at once.
    torch.manual_seed(0)
    b, t = 6, 5
    logp = (torch.randn(b, t) * 0.1).requires_grad_()
    old = torch.randn(b, t) * 0.1
    adv = torch.randn(b)
    mask = torch.rand(b, t) > 0.3
    mask[2] = False  # an empty row counts for nothing in either mode
    cfg = AlgorithmConfig(loss_agg_mode=agg)
    full, _ = rl_loss(RLInputs(logp, old, adv, mask), cfg)
    (g_full,) = torch.autograd.grad(full, logp)
    norm = loss_normalizer(mask[:2], agg) + loss_normalizer(mask[2:], agg)
    parts = [
        rl_loss(RLInputs(logp[s], old[s], adv[s], mask[s]), cfg, normalizer=norm)[0] for s in (slice(0, 2), slice(2, 6))
    ]
    (g_parts,) = torch.autograd.grad(parts[0] + parts[1], logp)
    assert close(parts[0] + parts[1], full, 1e-6) and close(g_parts, g_full, 1e-6)
    # per-micro-batch means averaged would differ whenever the micro-batches differ in size
    naive = sum(rl_loss(RLInputs(logp[s], old[s], adv[s], mask[s]), cfg)[0] for s in (slice(0, 2), slice(2, 6))) / 2
    assert not close(naive, full, 1e-4)


def test_rl_loss_combines_kl_and_entropy():
    # ratio 1, A = 1 -> pg = -1 per token. k1 with logp - ref = [0.5, -0.1]; entropy [1, 2].
    # kl_coef 0.1, entropy_coef 0.01: t0 = -1 + 0.05 - 0.01 = -0.96; t1 = -1 - 0.01 - 0.02 = -1.03
    # sum -1.99, token-mean -0.995
    logp = torch.zeros(1, 2)
    ref = torch.tensor([[-0.5, 0.1]])
    cfg = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1", entropy_coef=0.01)
    inputs = RLInputs(
        logp, logp, torch.tensor([1.0]), torch.ones(1, 2), ref_logprobs=ref, entropy=torch.tensor([[1.0, 2.0]])
    )
    loss, m = rl_loss(inputs, cfg)
    assert close(loss, -0.995) and close(m["loss_sum"], -1.99) and close(m["normalizer"], 2)
    assert close(m["kl"], 0.2) and close(m["entropy"], 1.5) and close(m["pg_loss"], -1.0)
    # KL is reported even when not in the loss; a KL loss without reference log-probs is a bug
    loss2, m2 = rl_loss(inputs, AlgorithmConfig(kl_loss_type="k1"))
    assert close(loss2, -1.0) and close(m2["kl"], 0.2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        rl_loss(RLInputs(logp, logp, torch.tensor([1.0]), torch.ones(1, 2)), cfg)


def test_kl_estimators():
    # logp = ln 0.5, ref = ln 0.25: d = logp - ref = ln 2 = 0.693147
    # k1 = 0.693147; k2 = 0.5 * 0.480453 = 0.240227; k3 = exp(-d) + d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    assert close(kl_penalty(logp, ref, "k1"), [[0.693147]])
    assert close(kl_penalty(logp, ref, "k2"), [[0.240227]])
    assert close(kl_penalty(logp, ref, "k3"), [[0.193147]])
    assert close(kl_penalty(ref, ref, "k3"), [[0.0]])
    with pytest.raises(ValueError, match="KL"):
        kl_penalty(logp, ref, "k4")


# --- log-probs, entropy, masked mean ----------------------------------------------------------


def test_entropy_hand_values_and_gradient():
    # uniform over 4: ln 4 = 1.386294. logits [0, ln 3] -> p = [.25, .75]:
    # H = -(.25 ln .25 + .75 ln .75) = 0.346574 + 0.215762 = 0.562335
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]]])
    assert close(entropy_from_logits(logits), [[1.386294, 0.562335]])
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, chunk_rows=4), (x,))
    ref = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)
    assert close(entropy_from_logits(x, chunk_rows=2), ref, 1e-10)


@pytest.mark.parametrize("chunk_rows", [None, 1, 5])
def test_token_logprobs_match_log_softmax(chunk_rows):
    torch.manual_seed(1)
    logits = (torch.randn(3, 7, 50) * 4).requires_grad_()
    targets = torch.randint(0, 50, (3, 7))
    ref = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    out = token_logprobs(logits, targets, chunk_rows=chunk_rows)
    assert out.dtype == torch.float32 and (out - ref).abs().max() < 1e-6
    w = torch.randn(3, 7)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
    (g_out,) = torch.autograd.grad((out * w).sum(), logits)
    assert (g_out - g_ref).abs().max() < 1e-6
    # temperature divides the logits (log-probs reach -20 here, so compare to fp32 relative precision)
    ref_t = torch.log_softmax(logits / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    out_t = token_logprobs(logits, targets, temperature=0.7, chunk_rows=chunk_rows)
    assert torch.allclose(out_t, ref_t, rtol=1e-6, atol=1e-6)


def test_token_logprobs_gradcheck_and_bf16():
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 6, (2, 3))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, t, temperature=0.5, chunk_rows=4), (x,))
    xb = torch.randn(2, 3, 6).to(torch.bfloat16).requires_grad_()
    out = token_logprobs(xb, t)
    assert out.dtype == torch.float32  # computed in fp32 even from bf16 logits
    ref = torch.log_softmax(xb.float(), -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    assert (out - ref).abs().max() < 1e-6
    out.sum().backward()
    assert xb.grad.dtype == torch.bfloat16


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # (1 + 2 + 4) / 3; per row: [1.5, 4]; per column: [2.5, 2, 0 (nothing valid)]
    assert close(masked_mean(x, mask), 7 / 3)
    assert close(masked_mean(x, mask, dim=1), [1.5, 4.0])
    assert close(masked_mean(x, mask, dim=0), [2.5, 2.0, 0.0])


# --- the pieces together ----------------------------------------------------------------------


def _bandit(sign: float, std_normalize: bool, agg: str, steps: int = 60) -> float:
    """GRPO on a contextual bandit: 6 contexts, 10 actions, the right action depends on the context.

    Returns the policy's mean probability of the right action after ``steps`` updates. ``sign=-1``
    flips the advantages (a policy trained to be wrong), which must drive it towards 0.
    """
    gen = torch.Generator().manual_seed(0)
    contexts, actions, n = 6, 10, 8
    right = torch.tensor([(3 * c + 1) % actions for c in range(contexts)])
    logits_table = torch.zeros(contexts, actions, requires_grad=True)
    opt = torch.optim.Adam([logits_table], lr=0.1)
    ctx = torch.arange(contexts).repeat_interleave(n)  # group-major, as make_rollout_samples lays out
    for _ in range(steps):
        with torch.no_grad():
            act = torch.multinomial(torch.softmax(logits_table[ctx], -1), 1, generator=gen)  # [B, 1]
        rewards = (act[:, 0] == right[ctx]).float()
        adv = sign * grpo_advantages(rewards, n, std_normalize=std_normalize)
        logp = token_logprobs(logits_table[ctx].unsqueeze(1), act)  # [B, T=1]
        loss, _ = rl_loss(RLInputs(logp, logp.detach(), adv, torch.ones_like(act)), AlgorithmConfig(loss_agg_mode=agg))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.softmax(logits_table.detach(), -1)[torch.arange(contexts), right].mean().item()


@pytest.fixture
def one_thread():
    # 120 tiny steps: intra-op threads only add contention (50x slower on a loaded 2-core machine).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("std_normalize, agg", [(True, "token-mean"), (False, "seq-mean-token-mean")])
def test_grpo_learns_a_contextual_bandit(std_normalize, agg, one_thread):
    # From uniform (p = 0.1), the advantage + PPO-clip loss must teach the context-dependent action.
    assert _bandit(1.0, std_normalize, agg) > 0.9
    assert _bandit(-1.0, std_normalize, agg) < 0.05
