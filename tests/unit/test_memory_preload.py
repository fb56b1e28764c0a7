"""torch_memory_saver wiring: preload library resolution, actor env, allocator checks, the removed margin flag.

Library resolution runs against fake library files in a temp dir: each holds the bytes a real
build carries for its CUDA runtime dependency (``libcudart.so.N``), which is all the resolver reads.
"""

from __future__ import annotations

import pytest

import tidal.memory.preload as preload
from tidal.config.schema import MemoryConfig
from tidal.errors import ConfigError
from tidal.memory.preload import (
    actor_env,
    check_allocator_conf,
    check_nccl_user_buffers,
    find_preload_library,
    linked_cudart_major,
)

STEM = "torch_memory_saver_hook_mode_preload"


def _lib(d, name, cudart_major):
    path = d / name
    path.write_bytes(b"\x7fELF\x02\x01\x01" + b"\0" * 57 + f"libcuda.so.1\0libcudart.so.{cudart_major}\0".encode())
    return path


def test_picks_library_by_torch_cuda_major_not_file_order(tmp_path):
    _lib(tmp_path, f"{STEM}.abi3.so", 12)
    cu12 = _lib(tmp_path, f"{STEM}_cu12.abi3.so", 12)
    cu13 = _lib(tmp_path, f"{STEM}_cu13.abi3.so", 13)
    assert find_preload_library("13.0", [tmp_path]) == str(cu13)
    assert find_preload_library("12.8", [tmp_path]) == str(cu12)
    assert find_preload_library(13, [tmp_path]) == str(cu13)


def test_unsuffixed_library_only_when_its_cudart_matches(tmp_path):
    legacy = _lib(tmp_path, f"{STEM}.abi3.so", 12)
    assert linked_cudart_major(legacy) == 12
    assert find_preload_library("12.4", [tmp_path]) == str(legacy)
    with pytest.raises(ConfigError) as err:
        find_preload_library("13.0", [tmp_path])
    msg = str(err.value)
    assert "CUDA 13" in msg and str(tmp_path) in msg and "links libcudart 12" in msg and "\n" not in msg


def test_searches_every_directory_and_reports_them(tmp_path):
    a, b = tmp_path / "site", tmp_path / "pkg"
    a.mkdir()
    b.mkdir()
    _lib(a, f"{STEM}_cu12.abi3.so", 12)
    cu13 = _lib(b, f"{STEM}_cu13.abi3.so", 13)
    assert find_preload_library("13.0", [a, b]) == str(cu13)
    with pytest.raises(ConfigError, match=f"searched {a}, {b}.*found {STEM}_cu12.abi3.so, {STEM}_cu13.abi3.so"):
        find_preload_library("11.8", [a, b])
    with pytest.raises(ConfigError, match="needs a CUDA build of torch"):
        find_preload_library(None, [a, b])


def test_no_preload_variables_without_a_cuda_driver():
    """This machine has no driver: even asking for preload on cuda must not set LD_PRELOAD."""
    assert not preload.cuda_driver_available()
    cfg = MemoryConfig(offload_train=True, tms_hook_mode="preload")
    env = actor_env(cfg, {"OMP_NUM_THREADS": 2}, "cuda")
    assert env == {"OMP_NUM_THREADS": "2"}
    assert actor_env(cfg, {}, "cpu") == {}
    with pytest.raises(ConfigError, match="memory-backend tms cannot run"):
        actor_env(MemoryConfig(memory_backend="tms"), {}, "cuda")


@pytest.fixture
def cuda_host(monkeypatch, tmp_path):
    """What a CUDA 13 host with torch_memory_saver installed looks like to the wiring code."""
    import torch

    _lib(tmp_path, f"{STEM}.abi3.so", 12)
    _lib(tmp_path, f"{STEM}_cu12.abi3.so", 12)
    lib = _lib(tmp_path, f"{STEM}_cu13.abi3.so", 13)
    monkeypatch.setattr(preload, "cuda_driver_available", lambda: True)
    monkeypatch.setattr(preload, "tms_installed", lambda: True)
    monkeypatch.setattr(preload, "default_search_dirs", lambda: [tmp_path])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    return str(lib)


def test_actor_env_preload_wiring(cuda_host):
    cfg = MemoryConfig(offload_train=True, tms_hook_mode="preload")
    env = actor_env(cfg, {"NCCL_DEBUG": "WARN", "LD_PRELOAD": "/opt/libjemalloc.so"}, "cuda")
    assert env == {
        "NCCL_DEBUG": "WARN",
        "LD_PRELOAD": f"{cuda_host}:/opt/libjemalloc.so",
        "TMS_INIT_ENABLE": "1",
        "TMS_INIT_ENABLE_CPU_BACKUP": "1",
    }
    # torch hook mode needs nothing at process start.
    assert actor_env(MemoryConfig(tms_hook_mode="torch"), {"A": 1}, "cuda") == {"A": "1"}
    # The portable backend never gets preload variables, even on a CUDA host.
    assert actor_env(MemoryConfig(memory_backend="portable", tms_hook_mode="preload"), {}, "cuda") == {}


def test_train_env_vars_cannot_override_memory_saver_variables(cuda_host):
    cfg = MemoryConfig(offload_train=True, tms_hook_mode="preload")
    with pytest.raises(ConfigError, match="TMS_INIT_ENABLE_CPU_BACKUP=0, which tidal manages"):
        actor_env(cfg, {"TMS_INIT_ENABLE_CPU_BACKUP": "0"}, "cuda")
    with pytest.raises(ConfigError, match="LD_PRELOAD names a torch_memory_saver library"):
        actor_env(cfg, {"LD_PRELOAD": "/x/torch_memory_saver_hook_mode_preload_cu12.abi3.so"}, "cuda")
    with pytest.raises(ConfigError, match="expandable_segments"):
        actor_env(cfg, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"}, "cuda")
    with pytest.raises(ConfigError, match="NCCL user-buffer registration"):
        actor_env(cfg, {"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"}, "cuda")
    # Without --offload-train grads are backed up, so user buffers are allowed.
    env = actor_env(
        MemoryConfig(tms_hook_mode="preload"), {"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"}, "cuda"
    )
    assert env["TMS_INIT_ENABLE"] == "1"


def test_allocator_conf_check():
    check_allocator_conf({})
    check_allocator_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    check_allocator_conf({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        with pytest.raises(ConfigError, match=f"{key}=expandable_segments:True"):
            check_allocator_conf({key: "expandable_segments:True"})
    check_nccl_user_buffers({"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"}, grads_backup=True)
    with pytest.raises(ConfigError):
        check_nccl_user_buffers({"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "true"}, grads_backup=False)


def test_memory_margin_flag_is_rejected_with_what_replaced_it():
    from tidal.config.args import parse

    with pytest.raises(ConfigError) as err:
        parse(["--train-memory-margin-bytes", "1073741824"])
    msg = str(err.value)
    assert "--train-memory-margin-bytes was removed" in msg and "memory" in msg and "\n" not in msg
