"""Safe starts and stops through real processes: SIGTERM saves and exits 143, damaged checkpoints are
refused naming the file or skipped for the newest intact one, a save that runs out of room leaves the
previous checkpoint loadable, ``--keep-checkpoints`` prunes only after a new one is complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tidal.checkpoint.manifest import find_loadable, verify

ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
SMALL = ("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--no-progress")


def tidal(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "tidal", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


def _lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def _wait_for(predicate, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and not predicate():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    assert predicate(), "timed out"


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path):
    ck, run = tmp_path / "ck", tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal", "train", "--num-rollout", "10000", *SMALL, "--save", str(ck)]
        + ["--output-dir", str(run)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = _lines(err)[-1]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    done = rows[-1]["step"]
    # A fresh process on a local cluster: the warm process started before Ray did (step 0 says when).
    assert 0 < rows[0]["startup_warm_s"] < rows[0]["startup_ray_s"], rows[0]
    assert last == f"tidal: SIGTERM: checkpoint of rollout {done} in {ck}; continue with --load {ck}", err[-2000:]
    found = find_loadable(str(ck))
    assert found.path == str(ck / f"iter_{done:07d}") and found.skipped == []

    # A truncated file is refused by name, on the driver, before anything starts (exit 2, no run folder).
    weights = ck / f"iter_{done:07d}" / "model-00001.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    r = tidal("train", "--load", str(ck / f"iter_{done:07d}"), *SMALL, "--output-dir", str(tmp_path / "b"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(_lines(r.stderr)) == 1 and "model-00001.safetensors has" in r.stderr and "truncated" in r.stderr
    assert not (tmp_path / "b").exists()


def _trainer_process(proc: subprocess.Popen) -> psutil.Process | None:
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "TrainerActor" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    return None


@pytest.mark.slow
def test_fallback_keep_and_a_save_that_runs_out_of_room(ray_cluster, tmp_path):
    from tidal.config import parse, resolve
    from tidal.driver import train

    ck = tmp_path / "ck"
    # The checkpoints to damage come from a run in this process (on the session's Ray cluster).
    argv = ["--num-rollout", "3", *SMALL, "--save", str(ck), "--save-interval", "1", "--keep-checkpoints", "2"]
    cfg, prov = parse([*argv, "--device", "cpu", "--output-dir", str(tmp_path / "a")])
    train(resolve(cfg, prov))
    assert sorted(d for d in os.listdir(ck) if d.startswith("iter_")) == ["iter_0000001", "iter_0000002"]

    # The newest is damaged (one flipped byte): the run says so in one line and resumes from the one before.
    optim = ck / "iter_0000002" / "optim-00001.safetensors"
    data = bytearray(optim.read_bytes())
    data[-1] ^= 0xFF
    optim.write_bytes(bytes(data))
    # The resumed run's save cannot write more than 64 KiB per file (as if the disk were full).
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal", "train", "--num-rollout", "3", *SMALL, "--load", str(ck), "--save", str(ck)]
        + ["--output-dir", str(tmp_path / "b")],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(lambda: _trainer_process(proc) is not None, proc)
    trainer = _trainer_process(proc)
    trainer.rlimit(psutil.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))  # Python ignores SIGXFSZ: writes fail with EFBIG
    out, err = proc.communicate(timeout=300)
    assert f"--load {ck}: iter_0000002 damaged (optim-00001.safetensors does not match" in out, out[-2000:]
    assert "loading iter_0000001" in out and "resumed from" in out
    assert proc.returncode == 2, err[-3000:]
    assert _lines(err)[-1].startswith(f"tidal: error: --save {ck}: writing the checkpoint of rollout 2 failed"), err
    assert "iter_0000001 is intact" in err and "Traceback" not in err
    # Nothing half-written is left, and the previous checkpoint still verifies and is what --load picks.
    assert not [d for d in os.listdir(ck) if d.startswith(".tmp")]
    assert verify(str(ck / "iter_0000001")) is None
    assert find_loadable(str(ck)).path == str(ck / "iter_0000001")


@pytest.mark.slow
def test_a_continued_run_keeps_one_row_per_step_in_its_folder(ray_cluster, tmp_path):
    from tidal.config import parse, resolve
    from tidal.driver import train
    from tidal.errors import ConfigError

    ck, out = tmp_path / "ck", tmp_path / "run"
    flags = [*SMALL, "--device", "cpu", "--save", str(ck), "--output-dir", str(out)]
    train(resolve(*parse(["--num-rollout", "2", *flags])))  # its checkpoint: rollout 1
    # As if that process had gone on past its checkpoint: rollout 2 reported, then a death mid-line.
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward_mean": 9.0}\n{"step": 3, "rew')
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"step": 2, "response": "from the lost rollout"}\n')

    # A new run into the folder is refused before anything starts; a continued one drops the rows it redoes.
    with pytest.raises(ConfigError, match="already holds a run's steps"):
        resolve(*parse(["--num-rollout", "3", *flags]))
    train(resolve(*parse(["--num-rollout", "3", *flags, "--load", str(ck)])))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["reward_mean"] <= 1.0, rows
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [0, 1, 2]
    assert all(s["response"] != "from the lost rollout" for s in samples)
