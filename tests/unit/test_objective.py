"""The trainer's per-micro-batch objective: old policy choice, correction, custom correction, loss weights."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tidal.config.schema import AlgorithmConfig
from tidal.rollout.types import Sample
from tidal.trainer.microbatch import MicroBatch
from tidal.trainer.objective import RolloutObjective, load_custom_correction

PLUGINS = os.path.join(os.path.dirname(__file__), "correction_plugins.py")


def _mb() -> MicroBatch:
    samples = [
        # response [7, 8] at target positions 1, 2; engine log-probs given
        Sample(index=0, group=0, prompt="", prompt_ids=[5, 6], response_ids=[7, 8], advantage=1.0,
               response_logprobs=[-1.0, -2.0]),
        # no engine log-probs: nothing to correct, the trainer's own are the old policy
        Sample(index=1, group=0, prompt="", prompt_ids=[9], response_ids=[10], advantage=-1.0),
    ]  # fmt: skip
    return MicroBatch(samples, [0, 1], pad_id=0, device=torch.device("cpu"))


# trainer old log-probs [B, T-1 = 3]: row 0 targets 1, 2 -> rho = exp(-1 + 1) = 1 and exp(-1.2 + 2) = exp(.8) = 2.225541
TRAINER_OLD = torch.tensor([[0.0, -1.0, -1.2], [-0.7, 0.0, 0.0]])


def test_tis_weights_and_old_policy():
    mb = _mb()
    obj = RolloutObjective(AlgorithmConfig(use_tis=True, tis_clip=2.0), torch.device("cpu"))
    obj.prepare(mb, TRAINER_OLD)
    assert torch.equal(mb.old_logprobs, TRAINER_OLD)
    w = mb.correction.weights
    assert math.isclose(float(w[0, 1]), 1.0, abs_tol=1e-6) and math.isclose(float(w[0, 2]), 2.0, abs_tol=1e-6)
    assert float(w[1, 0]) == 1.0  # no engine log-prob: weight 1
    assert mb.correction.truncated.tolist() == [[False, False, True], [False, False, False]]
    # k3 sums: (1 - 1 - 0) + (2.225541 - 1 - .8) = .425541 over 2 tokens
    assert math.isclose(float(obj.sums[0]), 0.425541, abs_tol=1e-5) and float(obj.sums[2]) == 2.0
    # the loss is weighted: with ratio 1, A = +1 on row 0 and -1 on row 1, token-mean over 3 tokens
    logp = TRAINER_OLD.clone().requires_grad_(True)
    loss, _ = obj.loss(mb, logp, None, normalizer=3.0)
    assert math.isclose(float(loss.detach()), (-1.0 * 1.0 - 1.0 * 2.0 + 1.0) / 3, abs_tol=1e-6)


def test_rollout_logprobs_are_the_old_policy_where_present():
    mb = _mb()
    RolloutObjective(AlgorithmConfig(use_rollout_logprobs=True), torch.device("cpu")).prepare(mb, TRAINER_OLD)
    assert mb.old_logprobs.tolist() == [[0.0, -1.0, -2.0], [pytest.approx(-0.7), 0.0, 0.0]]
    assert mb.correction is None


def test_custom_correction_by_path():
    mb = _mb()
    cfg = AlgorithmConfig(use_tis=True, custom_tis_function_path=PLUGINS + ":halve")
    obj = RolloutObjective(cfg, torch.device("cpu"), load_custom_correction(cfg.custom_tis_function_path))
    obj.prepare(mb, TRAINER_OLD)
    assert mb.correction.weights.tolist() == [[0.5] * 3] * 2
    bad = RolloutObjective(cfg, torch.device("cpu"), load_custom_correction(PLUGINS + ":not_a_correction"))
    with pytest.raises(TypeError, match="must return tidal.algos.correction.Correction"):
        bad.prepare(_mb(), TRAINER_OLD)
