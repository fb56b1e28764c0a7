"""End to end: the real loop (real Ray on CPU, 2 FSDP2 trainer ranks over gloo, 1 engine).

After every sync the engine's weights must equal the trainer's bit for bit, the weight version must
advance, and by the end every trainable parameter must have changed. Colocated (tensor transport,
memory paused with the portable backend) and disaggregated (broadcast transport).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tidal.config import parse, resolve
from tidal.driver import train
from tidal.weight_sync.verify import compare_checksums


def _run(tmp_path, *flags):
    argv = [
        "--num-rollout",
        "2",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--actor-num-gpus-per-node",
        "2",
        "--device",
        "cpu",
        "--output-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--check-weight-update-equal",
        "--rollout-max-response-len",
        "3",
        "--custom-rm-path",
        os.path.join(os.path.dirname(__file__), "reward_plugins.py") + ":parity",
        *flags,
    ]
    cfg, prov = parse(argv)
    cfg = resolve(cfg, prov)
    seen = {}

    def on_step(s, rollout_id, row):
        want = s.trainer.call("weight_checksums")
        for got in s.engines.call("weight_checksums"):
            assert compare_checksums(want, got) == [], f"engine differs from trainer after sync {rollout_id}"
        assert s.engines.call("get_weight_version") == [row["sync/version"]] * len(s.engines)
        # memory.png gets one reading per step, paused or not (the disaggregated run pauses nothing).
        assert sum(p.phase == "step" for p in s.timeline.points) == rollout_id + 1
        seen.setdefault("first", want)
        seen["last"] = want
        seen.setdefault("versions", []).append(row["sync/version"])
        seen["switch"] = sys.getswitchinterval()  # the start's shorter GIL switch interval is over
        # From the first step on, matplotlib is being imported beside the steps (the end draws the charts).
        assert (s._plotting is not None) == (rollout_id >= 0)

    switch = sys.getswitchinterval()
    train(cfg, on_step=on_step)
    assert seen["switch"] == switch == sys.getswitchinterval()
    # The initial sync is version 1; each step syncs once more.
    assert seen["versions"] == [1, 2, 3]
    unchanged = [n for n, c in seen["first"].items() if seen["last"][n] == c]
    assert unchanged == [], f"parameters not changed by training: {unchanged}"
    rows = [json.loads(x) for x in open(os.path.join(cfg.logging.output_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1]
    for key in ("reward_mean", "elapsed_s", "generate_s", "train_s", "sync_s", "loss"):
        assert key in rows[0], key
    # Step 0 says where the time before it went (Ray up, actors built, first sync) and only step 0 does.
    # Ray was up before this run (the shared cluster), so that mark counts only the inputs' check.
    marks = [rows[0][k] for k in ("startup_ray_s", "startup_actors_s", "startup_synced_s")]
    assert marks == sorted(marks) and marks[-1] <= rows[0]["elapsed_s"], rows[0]
    assert 0 < rows[0]["startup_trainer_build_s"] <= rows[0]["startup_trainer_init_s"]
    assert rows[0]["startup_engine_build_s"] > 0
    assert not any(k.startswith("startup_") for k in rows[1])
    # Where each rollout's generate went: the fast decoder's own stats (on CPU no graph is captured).
    for r in rows:
        assert r["decode/prefill_s"] > 0 and r["decode/steps"] >= 0 and r["decode/graph_captures"] == 0, r
        # The engine's whole calls hold the decoder's, and the rollout's generate holds the engine's calls.
        assert r["decode/call_s"] <= r["decode/engine_s"] <= r["generate_s"], r
    assert os.path.exists(os.path.join(cfg.logging.output_dir, "curves.png"))
    _check_samples(cfg.logging.output_dir, steps=[0, 1], versions={0: 1, 1: 2})
    assert os.path.getsize(os.path.join(cfg.logging.output_dir, "memory.png")) > 0
    return cfg


def _check_samples(run_dir, steps, versions):
    """samples.jsonl: --log-samples (default 4) readable samples per step, spread over the prompts."""
    records = [json.loads(x) for x in open(os.path.join(run_dir, "samples.jsonl"))]
    assert [r["step"] for r in records] == [s for s in steps for _ in range(4)]
    for r in records:
        assert set(r) >= {"prompt", "response", "label", "reward", "weight_version", "finish_reason", "response_length"}
        assert r["weight_version"] == versions[r["step"]], r
        assert r["finish_reason"] in ("stop", "length") and 0 < r["response_length"] <= 3
        assert r["reward"] in (0.0, 1.0) and isinstance(r["response"], str)
    assert len({r["group"] for r in records if r["step"] == 0}) == 4, "the 4 samples come from 4 prompts"


def test_a_rollout_that_trains_nothing_pauses_a_trainer_resumed_early_again(ray_cluster, tmp_path):
    """--train-resume-early all with every group dropped (a reward of 0 for all, dynamic sampling): the trainer
    resumed beside the generate has nothing to train, so it is paused again and the sync reads its backups;
    the next rollout resumes it early again (a trainer left resumed would refuse that resume)."""
    argv = ["--colocate", "--offload", "--train-resume-early", "all", "--dynamic-sampling", "--num-rollout", "3"]
    argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "3"]
    argv += ["--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "run"), "--custom-rm-path"]
    argv += [os.path.join(os.path.dirname(__file__), "reward_plugins.py") + ":nothing"]
    cfg, prov = parse(argv)
    cfg = resolve(cfg, prov)
    versions = []

    def on_step(s, rollout_id, row):
        if rollout_id >= 0:
            assert row["train_samples"] == 0 and row["sync/from_backup"] == 1, row
            # Resumed beside the generate (not on the first rollout), then paused again.
            assert row.get("memory/trainer_pause/effective", 0) == (rollout_id > 0), row
            versions.append(row["sync/version"])

    train(cfg, on_step=on_step)
    assert versions == [2, 3, 4]


def test_the_sync_keeps_the_trainers_weights_unless_an_evaluation_or_the_end_follows(ray_cluster, tmp_path):
    """--offload --train-resume-early weights: a sync keeps the paused trainer's weights on the device where the
    next generate would resume them early (``keep_trainer_weights``), so nothing resumes beside that generate;
    before an evaluation (``--eval-interval 2``: after rollout 1) and after the last rollout it pauses them, and
    the generate after that evaluation resumes them early. The engine's weights equal the trainer's after every
    sync either way."""
    argv = ["--colocate", "--offload", "--train-resume-early", "weights", "--eval-interval", "2", "--num-rollout", "3"]
    argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "3"]
    argv += ["--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "run")]
    cfg, prov = parse(argv)
    cfg = resolve(cfg, prov)
    rows = []

    def on_step(s, rollout_id, row):
        s.check_weights_equal()
        if rollout_id >= 0:
            rows.append(row)

    train(cfg, on_step=on_step)
    kept = [r.get("memory/trainer_pause/weights_kept", 0) for r in rows]
    paused = ["memory/trainer_pause/weights/backup_bytes" in r for r in rows]
    early = [r.get("memory/trainer_resume/early", 0) for r in rows]
    resumed = ["memory/trainer_resume/weights/backup_bytes" in r for r in rows]
    assert (kept, paused) == ([1, 0, 0], [False, True, True])
    assert (early, resumed) == ([0, 0, 1], [True, False, True])
    assert "eval_accuracy" in rows[1] and all(r["sync/from_backup"] == 0 for r in rows)
    # The engines' resumes around the push, engine 0's seconds: part of the sync's time.
    for r in rows:
        assert 0 < r["sync/engine_resume_weights_s"] < r["sync_s"] and 0 < r["sync/engine_resume_kv_s"] < r["sync_s"]


def test_a_safe_stop_after_a_sync_that_kept_the_weights_saves_a_whole_trainer(ray_cluster, tmp_path):
    """SIGTERM's safe point after a sync that kept the trainer's weights (WEIGHTS_ONLY, which a save refuses):
    the weights are paused first, the checkpoint of the last finished rollout is written and loads."""
    from tidal.checkpoint.manifest import find_loadable
    from tidal.signals import Stopped

    ck = tmp_path / "ck"
    argv = ["--colocate", "--offload", "--train-resume-early", "weights", "--num-rollout", "4", "--save", str(ck)]
    argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "3"]
    argv += ["--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "run")]
    cfg, prov = parse(argv)
    cfg = resolve(cfg, prov)

    def on_step(s, rollout_id, row):
        if rollout_id == 1:
            assert row["memory/trainer_pause/weights_kept"] == 1, row
            s.stop.requested = True  # what SIGTERM's handler sets

    with pytest.raises(Stopped, match="checkpoint of rollout 1"):
        train(cfg, on_step=on_step)
    assert find_loadable(str(ck)).path == str(ck / "iter_0000001")


@pytest.mark.slow
def test_debug_rollout_only_generates_and_scores_without_a_trainer(ray_cluster, tmp_path):
    """--debug-rollout-only: no trainer actor (no trainer memory), engines keep their initial weights."""
    cfg, prov = parse(
        ["--debug-rollout-only", "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]
        + ["--rollout-max-response-len", "3", "--device", "cpu", "--no-progress", "--eval-interval", "2"]
        + ["--output-dir", str(tmp_path / "run")]
    )
    cfg = resolve(cfg, prov)
    seen = []

    def on_step(s, rollout_id, row):
        assert s.trainer is None and s._placement.trainers == []
        seen.append(row)

    train(cfg, on_step=on_step)
    assert [r["step"] for r in seen] == [0, 1]
    assert all(r["trainer_host_rss_bytes"] == 0 and "train_s" not in r and "loss" not in r for r in seen)
    assert "eval_accuracy" in seen[1] and "reward_mean" in seen[0]
    _check_samples(cfg.logging.output_dir, steps=[0, 1], versions={0: -1, 1: -1})


@pytest.mark.slow
def test_colocated_two_ranks_paused_and_synced(ray_cluster, tmp_path):
    # Where the next generate would resume the trainer's weights early (--train-resume-early weights), the sync
    # keeps them on the device instead (not after the last rollout); the rest comes back after the generate.
    cfg = _run(tmp_path, "--colocate", "--offload", "--profile-rollouts", "1", "--train-resume-early", "weights")
    assert cfg.weight_sync.update_weight_transport == "tensor"
    assert cfg.memory.offload_train and cfg.memory.offload_rollout
    # Each step's row says what the trainer's pause and resume moved, per state class (grads: discarded).
    rows = [json.loads(x) for x in open(os.path.join(cfg.logging.output_dir, "metrics.jsonl"))]
    for r in rows:
        kept_before, kept_after = r["step"] > 0, r["step"] < len(rows) - 1
        for op in ("pause", "resume"):
            p = f"memory/trainer_{op}"
            assert r[f"{p}/effective"] == 1 and r[f"{p}/total_s"] > 0 and r[f"{p}/grads/backup_bytes"] == 0, r
        assert ("memory/trainer_resume/weights/backup_bytes" in r) == (not kept_before), r
        assert ("memory/trainer_pause/weights/backup_bytes" in r) == (not kept_after), r
        assert r.get("memory/trainer_pause/weights_kept", 0) == kept_after, r
        assert "memory/trainer_resume/early" not in r, r  # the weights were there: nothing to resume beside it
        assert r["memory/trainer_pause/optimizer/backup_bytes"] > 0, r  # AdamW's moments exist after a step
        # Paused in two stages around the sync: it read the live weights, not their host backups.
        assert r["sync/from_backup"] == 0, r
    # --profile-rollouts 1: rollout 1's generate on every engine and its train on trainer rank 0, profiled.
    folder = os.path.join(cfg.logging.output_dir, "profiles")
    names = sorted(os.listdir(folder))
    engines = cfg.cluster.rollout_num_gpus // cfg.cluster.rollout_num_gpus_per_engine
    want = [f"rollout1-generate-engine{i}" for i in range(engines)] + ["rollout1-train"]
    assert names == sorted(n + ext for n in want for ext in (".json", ".trace.json")), names
    for n in want:
        summary = json.load(open(os.path.join(folder, n + ".json")))
        assert summary["profile"] == n and summary["clock"] == "cpu" and summary["launches"] > 0, summary
        assert summary["total_s"] > 0 and sum(summary["by_category"].values()) > 0, summary
        # The labelled phases (the decoder's; the trainer's), each with its wall and longest operators.
        phases = summary["phases"]
        want = {"tidal.prefill", "tidal.decode"} if "generate" in n else {"tidal.micro_batch", "tidal.optimizer"}
        assert want <= set(phases), phases
        assert all(p["wall_s"] > 0 and p["calls"] >= 1 for p in phases.values()), phases
        trace = json.load(open(os.path.join(folder, n + ".trace.json")))
        assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"]), n


@pytest.mark.slow
def test_disaggregated_broadcast_with_over_sampling_and_dynamic_sampling(ray_cluster, tmp_path):
    cfg = _run(tmp_path, "--no-colocate", "--dynamic-sampling", "--over-sampling-batch-size", "6")
    assert cfg.weight_sync.update_weight_transport == "broadcast"
    # slime's over-sampling: rounds of 6 prompts until 4 groups with a gradient are kept; those 4 are trained.
    rows = [json.loads(x) for x in open(os.path.join(cfg.logging.output_dir, "metrics.jsonl"))]
    for r in rows:
        assert r["train_samples"] == 16 and r["rollout_rounds"] >= 1 and r["gen_samples"] == 24 * r["rollout_rounds"]
