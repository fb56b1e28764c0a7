"""Each estimator learns the default task in the real loop; TIS on a perturbed engine moves the mismatch metrics.

The default run (tiny model, digit-sum task, 32 prompts x 8 samples, colocated on the CPU) must
raise the 3-rollout mean reward by 0.3 within the default 60 rollouts, with every
``--advantage-estimator``. A run stops as soon as the rise is reached (31-33 rollouts with the
fixed seeds), which keeps the six runs within CI's time; one Ray cluster serves them all (the session
fixture). GRPO, the default, is the run on the perturbed engine with ``--use-tis``.
"""

from __future__ import annotations

import os

import pytest
from learning import RISE, learn

from tidal.config import parse, resolve

HERE = os.path.dirname(__file__)


def _learn(tmp_path, *flags) -> tuple[list[dict], bool]:
    cfg, prov = parse(["--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "run"), *flags])
    cfg = resolve(cfg, prov)
    assert cfg.rollout.num_rollout == 60  # the default budget
    return learn(cfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    "estimator",
    ["rloo", "reinforce_plus_plus", "gspo", "cispo", "ppo"],
)
def test_default_task_learns_with_each_estimator(ray_cluster, tmp_path, estimator):
    rows, reached = _learn(tmp_path, "--advantage-estimator", estimator)
    curve = [round(r["reward_mean"], 3) for r in rows]
    assert reached, f"{estimator}: no +{RISE} rise in {len(rows)} rollouts: {curve}"
    last = rows[-1]
    if estimator == "ppo":
        for key in ("value_loss", "value_mean", "critic_grad_norm"):
            assert key in last, key
        assert last["value_mean"] != 0.0  # the zero-initialised head has learned something
    else:
        assert "value_loss" not in last
    # An unperturbed engine: the trainer recomputes the engine's own log-probs (fp32 CPU), no mismatch.
    assert last["mismatch/k3"] < 1e-4 and last["mismatch/truncated_frac"] == 0.0


@pytest.mark.slow
def test_grpo_with_tis_on_a_perturbed_engine_moves_the_mismatch_metrics_and_learns(ray_cluster, tmp_path):
    rows, reached = _learn(
        tmp_path,
        "--advantage-estimator",
        "grpo",
        "--use-tis",
        "--tis-clip",
        "1.5",
        "--tis-clip-low",
        "0.5",
        "--custom-generate-function-path",
        os.path.join(HERE, "engine_plugins.py") + ":perturbed",
    )
    curve = [round(r["reward_mean"], 3) for r in rows]
    assert reached, f"TIS: no +{RISE} rise in {len(rows)} rollouts: {curve}"
    for row in rows:
        assert row["mismatch/k3"] > 1e-3, row["mismatch/k3"]
        assert 0.0 < row["mismatch/truncated_frac"] < 1.0
        assert row["mismatch/ratio_min"] < 1.0 < row["mismatch/ratio_max"]
        assert row["mismatch/masked_frac"] == 0.0  # truncation, not masking
