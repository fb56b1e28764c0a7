"""The loop with HTTP engines on a GPU: tidal starts ``tidal serve`` beside the trainer on one device.

Run on the GPU host: ``pytest -m gpu tests/gpu/test_http_engine_gpu.py -v`` (each test about a minute and a half).
Colocated, tensor transport (CUDA IPC handles inside SGLang's ForkingPickler payload), the engine's
memory released and resumed through the server's tms backend every step, weights bitwise equal to
the trainer's after every sync; then the same loop with the server killed mid-run (restarted,
resynced, the same samples per step); then an embedded engine actor (``ProbedEngineActor``: its
calls in Ray's default-group thread, ``health`` in its own) killed mid-run on CUDA: a new actor
captures its CUDA graphs and releases through tms again (the decode step uncompiled, to fit
about 90 s), and the resync over CUDA IPC lands bitwise.
"""

from __future__ import annotations

import json
import os

import pytest

from tidal.config import parse, resolve
from tidal.weight_sync.verify import compare_checksums

pytestmark = pytest.mark.gpu


def _run(tmp_path, *flags, on_step=None):
    from tidal.driver import train

    argv = [
        "--model", "tiny-qwen2", "--device", "cuda", "--num-rollout", "2", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8", "--output-dir", str(tmp_path / "run"),
        "--no-progress", "--update-weight-transport", "tensor", "--offload", "--check-weight-update-equal", *flags,
    ]  # fmt: skip
    cfg, prov = parse(argv)
    cfg = resolve(cfg, prov)
    seen = []

    def check(s, rollout_id, row):
        want = s.trainer.call("weight_checksums")
        for got in s.engines.call("weight_checksums"):
            assert compare_checksums(want, got) == [], f"engine differs after sync {rollout_id}"
        seen.append(row["sync/version"])
        if on_step is not None:
            on_step(s, rollout_id, row)

    train(cfg, on_step=check)
    rows = [json.loads(x) for x in open(os.path.join(cfg.logging.output_dir, "metrics.jsonl"))]
    return rows, seen


def test_started_tidal_serve_cuda_ipc_and_tms(ray_cluster, tmp_path):
    rows, seen = _run(tmp_path, "--rollout-engine", "sglang")
    assert seen == [1, 2, 3]
    assert all(r["gen_samples"] == 16 and r["engine_restarts"] == 0 for r in rows)
    print({k: rows[-1][k] for k in ("sync/seconds", "sync/bytes_total", "generate_s", "release_s") if k in rows[-1]})


def _kill_after_first_step(pid_of):
    import signal

    def kill(s, rollout_id, row):
        if rollout_id == 0:
            os.kill(pid_of(s), signal.SIGKILL)

    return kill


def test_started_tidal_serve_killed_mid_run(ray_cluster, tmp_path):
    import ray

    kill = _kill_after_first_step(lambda s: ray.get(s.engines.actors[0].server_pid.remote()))
    rows, seen = _run(tmp_path, "--rollout-engine", "sglang", on_step=kill)
    assert [r["engine_restarts"] for r in rows] == [0, 1]
    assert [r["gen_samples"] for r in rows] == [16, 16]
    assert seen == [1, 2, 3]  # the resync into the new server kept version 2; the step then synced 3


def test_embedded_engine_killed_mid_run(ray_cluster, tmp_path):
    """About 90 s: the decode step is not compiled here (two engine starts each compiling it took most of
    three minutes); the restarted actor still captures its CUDA graphs and releases through tms."""
    import ray

    kill = _kill_after_first_step(lambda s: ray.get(s.engines.actors[0].pid.remote()))
    rows, seen = _run(tmp_path, "--rollout-engine", "embedded", "--no-rollout-compile", on_step=kill)
    assert [r["engine_restarts"] for r in rows] == [0, 1]
    assert [r["gen_samples"] for r in rows] == [16, 16]
    assert seen == [1, 2, 3]
