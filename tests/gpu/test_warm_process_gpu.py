"""The warm process on a GPU host (``--warm-process auto``, the default, and ``on``): the actors are forks of the
warm process, CUDA initialised in each fork, and the run trains.

pytest -m gpu tests/gpu/test_warm_process_gpu.py -s

The run goes in a fresh interpreter: a pytest process where an earlier test started Ray joins that cluster,
which has no warm process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

DRIVER = textwrap.dedent(
    """
    import json, sys

    import psutil

    from tidal.config import parse, resolve
    from tidal.driver import train

    cfg, prov = parse(sys.argv[1:])
    cfg = resolve(cfg, prov)
    parents = {}

    def on_step(s, rollout_id, row):
        (engine,) = s.engines.call("pid")
        parents["engine"] = " ".join(psutil.Process(psutil.Process(engine).ppid()).cmdline())

    train(cfg, on_step=on_step)
    print("PARENTS " + json.dumps(parents))
    """
)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_actors_are_forks_of_the_warm_process_and_train(tmp_path, mode):
    run = tmp_path / "run"
    argv = ["--device", "cuda", "--no-progress", "--warm-process", mode, "--num-rollout", "2", "--output-dir", str(run)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", DRIVER, *argv], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("PARENTS ")]
    parents = json.loads(line[len("PARENTS ") :])
    assert "tidal.cluster.warm" in parents["engine"], parents
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1] and rows[-1]["logprob_diff"] < 0.05, rows[-1]
