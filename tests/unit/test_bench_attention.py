"""`tidal bench attention`: each SDPA backend's first call at new lengths beside its steady one, on the CPU's kernels."""

from __future__ import annotations

import json

import pytest
import torch

from tidal.bench import attention


def test_attention_bench_reports_each_backend_or_why_it_cannot_run(capsys):
    attention.main(["--rows", "2", "--heads", "2", "--lengths", "24,40", "--warm-length", "16", "--iters", "2"])
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["backend"] for r in rows] == ["cudnn", "flash", "efficient", "math"]
    for r in rows:
        assert r["trainer_order"] == ["flash", "efficient", "cudnn", "math"] and r["backward"] is True
    math = rows[-1]  # runs everywhere
    assert math["available"] and len(math["first_ms"]) == len(math["steady_ms"]) == 2
    assert all(x > 0 for x in math["first_ms"] + math["steady_ms"])
    mean = sum(f - s for f, s in zip(math["first_ms"], math["steady_ms"])) / 2
    assert abs(math["setup_ms"] - mean) < 2e-3
    if not torch.cuda.is_available():  # cuDNN's attention needs CUDA: said, not raised
        assert rows[0]["available"] is False and rows[0]["reason"]


def test_attention_bench_refuses_bad_input_with_one_line(capsys):
    for argv in (["--backends", "cudnn,nope"], ["--dtype", "int9"], ["--lengths", "256"]):
        with pytest.raises(SystemExit) as exc:
            attention.main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tidal bench attention: ") and "\n" not in err, err
