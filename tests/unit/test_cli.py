"""The ``tidal`` command as a user types it: bad input is one line and exit code 2; a run with
``--save`` resumes with ``--load`` and exports a folder that ``from_pretrained`` loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
# One rollout of 2 prompts x 2 samples: the smallest whole training run.
ONE_SMALL_ROLLOUT = ("--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--no-progress")


def tidal(*args, cwd=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "tidal", *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=timeout
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", "--train-memory-margin-bytes", "1"], "--train-memory-margin-bytes"),
        (["train", "--rollout-batch-sise", "4"], "did you mean --rollout-batch-size"),
        (["train", "--model", "/no/such/model"], "--model /no/such/model"),
        (["train", "--prompt-data", "/no/such.jsonl"], "--prompt-data /no/such.jsonl"),
        (["export", "--load", "/no/such/ckpt", "--out", "/tmp/never-written"], "--load /no/such/ckpt"),
        (["trian"], "did you mean 'train'"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, needle, tmp_path):
    r = tidal(*args, "--output-dir", str(tmp_path / "run")) if args[0] == "train" else tidal(*args)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "run").exists(), "a failed start must leave no run directory"


def test_reward_function_that_raises_is_a_user_error(tmp_path):
    plugin = tmp_path / "bad_reward.py"
    # It runs in the driver: the start-up's objects are frozen out of its collector, which is on again.
    plugin.write_text(
        "import gc\n"
        "def score(prompt, response, label):\n"
        "    raise ValueError(f'boom frozen={gc.get_freeze_count() > 0} collecting={gc.isenabled()}')\n"
    )
    r = tidal(
        "train",
        *ONE_SMALL_ROLLOUT,
        "--output-dir",
        str(tmp_path / "run"),
        "--custom-rm-path",
        f"{plugin}:score",
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "boom frozen=True collecting=True" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_ctrl_c_stops_ray_and_every_actor(tmp_path):
    """SIGINT during a run: exit code 130 and no process of that run (Ray, trainer, engine) left behind."""
    import signal
    import time

    import psutil

    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal", "train", "--num-rollout", "10000", "--no-progress", "--output-dir", str(run)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell without job control starts background jobs with SIGINT ignored, and Python keeps it
        # ignored: give the run the default disposition a terminal's foreground job has.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.5)
    family = psutil.Process(proc.pid).children(recursive=True)
    assert any("raylet" in " ".join(p.cmdline()) for p in family if p.is_running()), "the run should own its Ray"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err
    _, alive = psutil.wait_procs(family, timeout=30)
    assert alive == [], f"left running after Ctrl-C: {[p.pid for p in alive]}"


@pytest.mark.slow
def test_save_load_on_an_existing_ray_cluster_resumes_the_curve_and_export_loads(tmp_path):
    """``--ray-address``: two runs in a row on a cluster started outside tidal; the cluster survives both
    and the second run gets the resources the first one gave back. The second run resumes the first's
    ``--save`` with ``--load`` and continues its curve; ``tidal export`` of it loads with ``from_pretrained``."""
    import socket

    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--node-ip-address=127.0.0.1",
        ],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    common = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--no-progress", "--save", str(ckpt)]
    common += ["--ray-address", f"127.0.0.1:{port}"]
    try:
        r = tidal("train", "--num-rollout", "2", "--output-dir", str(tmp_path / "a"), *common, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        assert head.poll() is None, "the external cluster must outlive the run"
        r = tidal(
            "train",
            "--num-rollout",
            "3",
            "--load",
            str(ckpt),
            "--output-dir",
            str(tmp_path / "b"),
            *common,
            timeout=240,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert head.poll() is None, "the external cluster must outlive the run"
    finally:
        family = psutil.Process(head.pid).children(recursive=True)
        head.terminate()
        head.wait(timeout=60)
        for p in family:
            if p.is_running():
                p.kill()
    rows = [json.loads(x) for x in open(tmp_path / "b" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [2], "the resumed run continues at the next rollout"
    # The command exits without the interpreter's teardown once the charts (drawn while Ray stops) are written.
    assert all(os.path.getsize(tmp_path / run / png) > 0 for run in "ab" for png in ("curves.png", "memory.png"))
    # versions: v1 initial sync, v2 and v3 after steps 0-1 (saved); resumed: v4 initial, v5 after step 2
    assert rows[0]["sync/version"] == 5
    r = tidal("export", "--load", str(ckpt), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 0
