"""Estimators, off-policy corrections and policy objectives against values worked out by hand.

Derivations are in the comments; each function's docstring names the equation it implements.
"""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algos.correction import (
    CorrectionInputs,
    apply_correction,
    log_ratio,
    mismatch_metrics,
    sequence_mask,
    sequence_tis,
    token_mask,
    token_tis,
)
from tidal.algos.estimators import (
    discounted_returns,
    gae,
    masked_whiten,
    outcome_token_rewards,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
    sample_advantages,
)
from tidal.algos.objectives import RLInputs, overlong_penalty, policy_terms, rl_loss, value_loss
from tidal.config.schema import AlgorithmConfig

LN2 = math.log(2.0)


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol)


# --- estimators ---------------------------------------------------------------------------------


def test_rloo_hand_values():
    # group [1, 0, 0, 1]: others' means 1/3, 2/3, 2/3, 1/3 -> [2/3, -2/3, -2/3, 2/3]
    # group [0, 1, 2, 3]: others' means 2, 5/3, 4/3, 1 -> [-2, -2/3, 2/3, 2] (= 4/3 * (r - 1.5))
    r = torch.tensor([1.0, 0, 0, 1, 0, 1, 2, 3])
    assert close(rloo_advantages(r, 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3, -2, -2 / 3, 2 / 3, 2])
    assert close(rloo_advantages(torch.tensor([3.0, 5.0]), 1), [0.0, 0.0])  # nobody to leave out


def test_outcome_rewards_and_discounted_returns():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    tok = outcome_token_rewards(torch.tensor([2.0, 3.0, 5.0]), mask)
    assert close(tok, [[0, 0, 2, 0], [0, 0, 0, 3], [0, 0, 0, 0]])  # last valid token; an empty row gets nothing
    # gamma 0.5: row 0 [_, 0 + .5 * 2, 2, _]; row 1 [.375, .75, 1.5, 3]
    assert close(discounted_returns(tok, mask, 0.5), [[0, 1, 2, 0], [0.375, 0.75, 1.5, 3], [0, 0, 0, 0]])


def test_reinforce_plus_plus_hand_values():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # gamma 1: returns [[1, 1, _], [0, 0, 0]]; valid values [1, 1, 0, 0, 0]: mean .4, unbiased var 1.2 / 4 = .3,
    # std .547723 -> .6 / .547723 = 1.095445, -.4 / .547723 = -.730297
    adv = reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), mask)
    assert close(adv, [[1.095445, 1.095445, 0], [-0.730297] * 3])
    # gamma .5: row 0 returns [.5, 1]; values [.5, 1, 0, 0, 0]: mean .3, var .8 / 4 = .2, std .447214
    adv = reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), mask, gamma=0.5)
    assert close(adv, [[0.447214, 1.565248, 0], [-0.670820] * 3])


def test_reinforce_plus_plus_baseline_hand_values():
    # groups of 2: [1, 0] -> [.5, -.5]; [3, 3] -> [0, 0]; lengths 2, 1, 1, 2 -> token values
    # [.5, .5, -.5, 0, 0, 0]: mean 1/12 = .083333, squares of deviations sum .708333, /5 -> std .376386
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]])
    adv = reinforce_plus_plus_baseline_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, mask)
    assert close(adv, [[1.107019, 1.107019], [-1.549826, 0], [-0.221404, 0], [-0.221404, -0.221404]])


def test_masked_whiten_edge_cases():
    assert close(masked_whiten(torch.tensor([[5.0, 9.0]]), torch.tensor([[1, 0]])), [[0.0, 0.0]])  # one value: centred
    assert close(masked_whiten(torch.tensor([[5.0]]), torch.tensor([[0]])), [[0.0]])


def test_gae_hand_values():
    # gamma .9, lambda .8, gamma * lambda = .72. Row 0: rewards [0, 0, 1], values [.5, .6, .7]
    #   t2: delta = 1 - .7 = .3                    A = .3
    #   t1: delta = .9 * .7 - .6 = .03              A = .03 + .72 * .3 = .246
    #   t0: delta = .9 * .6 - .5 = .04              A = .04 + .72 * .246 = .21712
    # Row 1 (first position is prompt): rewards [_, 0, 2], values [9, .2, .4]
    #   t2: delta = 2 - .4 = 1.6; t1: delta = .9 * .4 - .2 = .16, A = .16 + .72 * 1.6 = 1.312
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    rewards = torch.tensor([[0.0, 0, 1], [0, 0, 2]])
    values = torch.tensor([[0.5, 0.6, 0.7], [9.0, 0.2, 0.4]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lambd=0.8)
    assert close(adv, [[0.21712, 0.246, 0.3], [0, 1.312, 1.6]])
    assert close(ret, [[0.71712, 0.846, 1.0], [0, 1.512, 2.0]])  # A + V
    # gamma = lambda = 1: Monte-Carlo return minus the value
    adv, ret = gae(rewards, values, mask, gamma=1.0, lambd=1.0)
    assert close(adv, [[0.5, 0.4, 0.3], [0, 1.8, 1.6]]) and close(ret, [[1, 1, 1], [0, 2, 2]])


@pytest.mark.parametrize(
    "estimator, per_seq, per_token",
    [
        # groups of 2: [1, 0] and [1, 1]
        ("grpo", [0.707107, -0.707107, 0, 0], None),  # +-.5 / std(1, 0) = +-.5 / .707107
        ("gspo", [0.707107, -0.707107, 0, 0], None),
        ("cispo", [0.707107, -0.707107, 0, 0], None),
        ("dr_grpo", [0.5, -0.5, 0, 0], None),
        ("rloo", [1.0, -1.0, 0, 0], None),  # 1 - 0, 0 - 1, 1 - 1
        ("ppo", [0, 0, 0, 0], None),
        # lengths 1, 2, 1, 1 -> token returns [1], [0, 0], [1], [1]: mean .6, std .547723 -> .730297, -1.095445
        ("reinforce_plus_plus", [0.730297, -1.095445, 0.730297, 0.730297], [[0.730297, 0], [-1.095445] * 2]),
        # centred [.5, -.5, 0, 0] on tokens [.5], [-.5, -.5], [0], [0]: mean -.1, std .418330 -> 1.434274, -0.956183
        ("reinforce_plus_plus_baseline", [1.434274, -0.956183, 0.239046, 0.239046], [[1.434274, 0], [-0.956183] * 2]),
    ],
)
def test_sample_advantages_per_estimator(estimator, per_seq, per_token):
    cfg = AlgorithmConfig(advantage_estimator=estimator)
    seq, tok = sample_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([1, 2, 1, 1]), 2, cfg)
    assert close(seq, per_seq)
    assert (tok is None) == (per_token is None)
    if per_token is not None:
        assert close(tok[:2], per_token)


# --- corrections -------------------------------------------------------------------------------

# rho = exp(old - engine): row 0 [1, 2, .5]; row 1 [4, 1, (masked, garbage)]
OLD = torch.tensor([[-1.0, -1.0, -2.0], [-0.5, -3.0, float("nan")]])
ENGINE = torch.tensor([[-1.0, -1.0 - LN2, -2.0 + LN2], [-0.5 - 2 * LN2, -3.0, float("-inf")]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
INPUTS = CorrectionInputs(OLD, ENGINE, MASK)


def test_log_ratio_ignores_masked_garbage():
    assert close(log_ratio(INPUTS), [[0, LN2, -LN2], [2 * LN2, 0, 0]])


@pytest.mark.parametrize(
    "fn, bounds, weights, keep, truncated",
    [
        # TIS, clip to [.6, 1.5]: [1, 2 -> 1.5, .5 -> .6], [4 -> 1.5, 1]
        (token_tis, (1.5, 0.6), [[1, 1.5, 0.6], [1.5, 1, 1]], [[1, 1, 1], [1, 1, 1]], [[0, 1, 1], [1, 0, 0]]),
        # IcePop, keep [.6, 3]: .5 and 4 are dropped; kept tokens keep their ratio as weight
        (token_mask, (3.0, 0.6), [[1, 2, 1], [1, 1, 1]], [[1, 1, 0], [0, 1, 1]], [[0, 0, 0], [0, 0, 0]]),
        # sequence ratios: row 0 exp(mean(0, ln2, -ln2)) = 1; row 1 exp(mean(2 ln2, 0)) = 2 -> clipped to 1.5
        (sequence_tis, (1.5, 0.0), [[1, 1, 1], [1.5, 1.5, 1]], [[1, 1, 1], [1, 1, 1]], [[0, 0, 0], [1, 1, 0]]),
        # sequence mask [0, 1.5]: row 1 (ratio 2) is dropped whole, row 0 kept with weight 1
        (sequence_mask, (1.5, 0.0), [[1, 1, 1], [1, 1, 1]], [[1, 1, 1], [0, 0, 1]], [[0, 0, 0], [0, 0, 0]]),
    ],
)
def test_corrections_hand_values(fn, bounds, weights, keep, truncated):
    c = fn(log_ratio(INPUTS), MASK, *bounds)
    assert close(c.weights, weights)
    assert c.keep.tolist() == [[bool(x) for x in row] for row in keep]
    assert c.truncated.tolist() == [[bool(x) for x in row] for row in truncated]


def test_apply_correction_follows_the_config():
    cfg = AlgorithmConfig(use_tis=True, tis_mode="mask", tis_level="token", tis_clip=3.0, tis_clip_low=0.6)
    assert apply_correction(INPUTS, cfg).keep.tolist() == [[True, True, False], [False, True, True]]
    cfg.tis_level = "sequence"
    cfg.tis_clip = 1.5
    assert apply_correction(INPUTS, cfg).keep.tolist() == [[True, True, True], [False, False, True]]


def test_mismatch_metrics_hand_values():
    # k3 = rho - 1 - ln rho: rho 1 -> 0; 2 -> 1 - ln 2 = .306853; .5 -> ln 2 - .5 = .193147; 4 -> 3 - 2 ln 2 = 1.613706
    c = token_tis(log_ratio(INPUTS), MASK, 1.5, 0.6)
    m = mismatch_metrics(INPUTS, c)
    assert close(m["mismatch_k3_sum"], 0.306853 + 0.193147 + 1.613706)
    assert close(m["ratio_sum"], 8.5) and close(m["ratio_min"], 0.5) and close(m["ratio_max"], 4.0)
    assert m["count"] == 5 and m["truncated_sum"] == 3 and m["masked_sum"] == 0
    m = mismatch_metrics(INPUTS, token_mask(log_ratio(INPUTS), MASK, 3.0, 0.6))
    assert m["masked_sum"] == 2 and m["truncated_sum"] == 0
    # no engine/trainer difference: no KL, ratio exactly 1
    same = mismatch_metrics(CorrectionInputs(OLD, OLD, MASK))
    assert close(same["mismatch_k3_sum"], 0.0) and close(same["ratio_min"], 1.0) and close(same["ratio_max"], 1.0)


# --- policy objectives -----------------------------------------------------------------------------


def test_gspo_clips_the_sequence_ratio():
    # old - new per token: [.2, .4] -> sequence ratio exp(.3) = 1.349859 for both tokens; eps .2 -> clip at 1.2
    # A = +1: max(-1.349859, -1.2) = -1.2 (clipped, no gradient); A = -1: max(1.349859, 1.2) unclipped.
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.4], [-1.2, -1.4]])
    loss, clipped, ratio = policy_terms("gspo", logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2), 0.2, 0.2)
    assert close(ratio, [[1.349859] * 2] * 2)
    assert close(loss, [[-1.2, -1.2], [1.349859, 1.349859]])
    assert clipped.tolist() == [[True, True], [False, False]]
    # d/dlogp_t of sum_t s = 2 * s / 2 = s: every token of the sequence gets the same gradient
    loss.sum().backward()
    assert close(logp.grad, [[0, 0], [1.349859, 1.349859]])


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # r = [exp(.5) = 1.648721, exp(-.1) = .904837]; no lower bound (eps_low 1), upper 1.2.
    # loss = -sg(clip(r)) * A * logp with A = 2: [-1.2 * 2 * -1, -.904837 * 2 * -1] = [2.4, 1.809675]
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -0.9]])
    loss, clipped, _ = policy_terms("cispo", logp, old, torch.tensor([2.0]), torch.ones(1, 2), 1.0, 0.2)
    assert close(loss, [[2.4, 1.809675]]) and clipped.tolist() == [[True, False]]
    loss.sum().backward()
    assert close(logp.grad, [[-2.4, -1.809675]])  # the clipped token still has a gradient (PPO's would be 0)


def test_value_loss_hand_values():
    # t0: (1 - 0)^2 = 1 vs clipped V .8 + .1 = .9 -> .81; max 1 -> .5
    # t1: (.9 - 1)^2 = .01 vs clipped .3 + .1 = .4 -> .36; max .36 -> .18 (the clip stops the jump)
    v, old, ret = torch.tensor([[1.0, 0.9, 0.5]]), torch.tensor([[0.8, 0.3, 0.5]]), torch.tensor([[0.0, 1.0, 0.5]])
    mask = torch.tensor([[1, 1, 0]])
    assert close(value_loss(v, old, ret, mask, 0.1), [[0.5, 0.18, 0]])
    assert close(value_loss(v, old, ret, mask, None), [[0.5, 0.005, 0]])


def test_overlong_penalty_hand_values():
    # max 20, buffer 5: free up to 15, then (15 - n) / 5, -1 from 20 on
    lens = torch.tensor([10, 15, 16, 18, 20, 25])
    assert close(overlong_penalty(lens, 20, 5), [0, 0, -0.2, -0.6, -1.0, -1.0])
    assert close(overlong_penalty(lens, 20, 5, factor=0.5), [0, 0, -0.1, -0.3, -0.5, -0.5])


def test_rl_loss_applies_correction_weights_and_drops():
    # on-policy (ratio 1), A = 1: per-token loss -1; weights [2, .5], token 1 dropped -> sum -2, token-mean over
    # the 2 valid tokens -> -1; the gradient of logp is -w / 2 on the kept token and 0 on the dropped one
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inputs = RLInputs(
        logp,
        logp.detach(),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        weights=torch.tensor([[2.0, 0.5]]),
        keep=torch.tensor([[True, False]]),
    )
    loss, m = rl_loss(inputs, AlgorithmConfig())
    assert close(loss, -1.0) and m["num_tokens"] == 2
    loss.backward()
    assert close(logp.grad, [[-1.0, 0.0]])
    # without a correction it is the plain PPO-clip loss
    loss, _ = rl_loss(RLInputs(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2)), AlgorithmConfig())
    assert close(loss, -1.0)
