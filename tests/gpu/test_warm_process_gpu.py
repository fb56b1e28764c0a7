"""``--warm-process on`` on a GPU host: the actors are forks of the warm process, CUDA initialised in each fork.

pytest -m gpu tests/gpu/test_warm_process_gpu.py -s
"""

from __future__ import annotations

import json
import os

import psutil
import pytest

from tidal.config import parse, resolve
from tidal.driver import train

pytestmark = pytest.mark.gpu


def test_actors_are_forks_of_the_warm_process_and_train(tmp_path):
    argv = ["--device", "cuda", "--no-progress", "--warm-process", "on", "--num-rollout", "2"]
    cfg, prov = parse([*argv, "--output-dir", str(tmp_path / "run")])
    cfg = resolve(cfg, prov)
    parents = {}

    def on_step(s, rollout_id, row):
        (engine,) = s.engines.call("pid")
        for name, pid in (("engine", engine),):
            parent = psutil.Process(psutil.Process(pid).ppid())
            parents[name] = " ".join(parent.cmdline())

    train(cfg, on_step=on_step)
    print(json.dumps(parents))
    assert "tidal.cluster.warm" in parents["engine"], parents
    rows = [json.loads(x) for x in open(os.path.join(cfg.logging.output_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1] and rows[-1]["logprob_diff"] < 0.05, rows[-1]
