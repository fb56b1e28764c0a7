"""One home for each small rule: the dtype table and its default, the compile default, atomic publication,
the last line of a remote error."""

from __future__ import annotations

import os

import pytest
import torch

from tidal.atomic import publish_dir, write_text_atomic
from tidal.config.schema import rollout_compile_default
from tidal.dtypes import as_dtype, default_dtype, default_dtype_name, dtype_name, dtype_of, short_name
from tidal.errors import ConfigError, last_line


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.float32", torch.float32), ("fp16", torch.float16)],
)
def test_compute_dtype_names(name, dtype):
    assert as_dtype(name) is dtype and as_dtype(dtype) is dtype and as_dtype(None) is None


def test_wire_names_round_trip_and_compute_names_refuse_the_rest():
    for d in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn, torch.uint8):
        assert dtype_of(dtype_name(d)) is d
    with pytest.raises(ConfigError, match="dtype 'int8'"):
        as_dtype("int8")
    with pytest.raises(KeyError):
        dtype_of("complex64")


def test_bf16_on_cuda_else_fp32():
    assert default_dtype_name("cuda") == "bfloat16" and default_dtype("cpu") is torch.float32
    assert short_name(default_dtype_name("cuda")) == "bf16" and short_name("float32") == "fp32"
    assert rollout_compile_default("cuda") and not rollout_compile_default("cpu")


def test_publish_dir_replaces_whole_and_leaves_no_temp(tmp_path):
    final = tmp_path / "out"
    for version in ("a", "b"):
        tmp = tmp_path / f".tmp-{version}"
        tmp.mkdir()
        (tmp / "file").write_text(version)
        publish_dir(str(tmp), str(final))
        assert (final / "file").read_text() == version
    write_text_atomic(str(tmp_path / "latest"), "out\n")
    assert sorted(os.listdir(tmp_path)) == ["latest", "out"]


def test_last_line_is_the_cause_of_a_remote_error():
    e = RuntimeError("ray::EngineActor.update() (pid=1)\n  File x, line 2\nWeightSyncError: checksum mismatch\n")
    assert last_line(e) == "WeightSyncError: checksum mismatch"
    assert last_line(ValueError("")) == "ValueError"
