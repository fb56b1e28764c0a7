"""``--compile-cache-dir``: the environment that points torch.compile's caches at one folder.

That a second process then reuses the first one's compiled graphs is checked on the GPU host
(``tests/gpu/test_compile_cache_gpu.py``): a cold inductor compile costs minutes on 2 CPU cores.
"""

from __future__ import annotations

import os

from tidal.compile_cache import cache_env, use


def test_cache_env_points_inductor_at_the_folder(monkeypatch, tmp_path):
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    env = cache_env("~/.cache/tidal/compile")
    assert env == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / ".cache/tidal/compile/inductor"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }
    assert cache_env("") == {} and cache_env(None) == {}
    # A variable the user set wins.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    assert cache_env("~/x")["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    applied = use(str(tmp_path / "c"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == applied["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c/inductor")
    assert os.path.isdir(tmp_path / "c/inductor")


def test_inductor_reads_the_folder_at_compile_time(monkeypatch, tmp_path):
    """inductor looks the variable up when it compiles (not at import), so setting it in a process that
    already imported torch still moves its caches (the benchmarks do that)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "x"))
    assert cache_dir() == str(tmp_path / "x")
    assert triton_cache_dir(0).startswith(str(tmp_path / "x"))
