"""torch_memory_saver wiring for actor processes: which backend, which preload library, which env.

torch_memory_saver has two hook modes. ``torch`` installs a pluggable CUDA allocator in process
and only sees allocations made inside ``region()``. ``preload`` intercepts every ``cudaMalloc`` of
the process through ``LD_PRELOAD``; it must be set before the process starts, so the trainer
actors get it in their Ray runtime env (``actor_env``).

The wheel ships one preload library per CUDA runtime major (``..._cu12``, ``..._cu13``) and an
unsuffixed legacy build. Loading the wrong one fails deep inside CUDA, and picking "the first file
that exists" breaks whenever both are installed; ``find_preload_library`` chooses by the CUDA
major of the installed torch, and accepts the unsuffixed file only when the libcudart it links
has that major. Nothing here ever sets the preload variables where no CUDA driver can be loaded:
the child process would die loading ``libcuda.so.1`` before printing anything.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import re
from collections.abc import Mapping
from pathlib import Path

from tidal.errors import ConfigError

log = logging.getLogger("tidal.memory")

PRELOAD_STEM = "torch_memory_saver_hook_mode_preload"
# Variables that torch_memory_saver's preload mode reads at process start. tidal owns them:
# --train-env-vars may not set them to something else.
TMS_ENV_KEYS = ("LD_PRELOAD", "TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP")
# torch's switch that registers every CUDA allocation with NCCL (user-buffer registration).
NCCL_UB_ENV = "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"

_driver_cache: bool | None = None


def cuda_driver_available() -> bool:
    """Whether ``libcuda.so.1`` loads here (without initialising CUDA in this process)."""
    global _driver_cache
    if _driver_cache is None:
        try:
            ctypes.CDLL("libcuda.so.1")
            _driver_cache = True
        except OSError:
            _driver_cache = False
    return _driver_cache


def tms_installed() -> bool:
    """Whether torch_memory_saver is importable (found without importing it)."""
    return importlib.util.find_spec("torch_memory_saver") is not None


def resolve_backend(backend: str, device: str) -> tuple[str, str | None]:
    """(``"tms"`` or ``"portable"``, reason for a fallback or None) for the ``--memory-backend`` choice."""
    on_cuda = str(device).startswith("cuda")
    if backend == "portable":
        return "portable", None
    problem = None
    if not on_cuda:
        problem = f"device is {device}"
    elif not cuda_driver_available():
        problem = "no CUDA driver (libcuda.so.1) loads here"
    elif not tms_installed():
        problem = "torch_memory_saver is not installed"
    if problem is None:
        return "tms", None
    if backend == "tms":
        raise ConfigError(
            f"--memory-backend tms cannot run: {problem}; install torch_memory_saver on a CUDA host or use "
            "--memory-backend portable"
        )
    return "portable", problem


def _cuda_major(torch_cuda_version: str | int | None) -> int | None:
    if torch_cuda_version is None or torch_cuda_version == "":
        return None
    try:
        return int(str(torch_cuda_version).split(".", 1)[0])
    except ValueError:
        return None


def linked_cudart_major(path: str | Path) -> int | None:
    """CUDA runtime major a shared library links against (its ``libcudart.so.N`` dependency)."""
    data = Path(path).read_bytes()
    found = re.findall(rb"libcudart\.so\.(\d+)", data)
    return int(found[0]) if found else None


def default_search_dirs() -> list[Path]:
    """Where the torch_memory_saver wheel puts its libraries: next to the package, and inside it."""
    spec = importlib.util.find_spec("torch_memory_saver")
    if spec is None or not spec.submodule_search_locations:
        return []
    pkg = Path(next(iter(spec.submodule_search_locations)))
    return [pkg.parent, pkg]


def find_preload_library(torch_cuda_version: str | int | None, search_dirs=None) -> str:
    """Path of the preload library matching the CUDA runtime major of torch.

    Order: ``<stem>_cu<major>*.so`` in each directory, then the unsuffixed ``<stem>*.so`` only if it
    links ``libcudart.so.<major>``. Raises ``ConfigError`` listing what was searched when none fits.
    """
    major = _cuda_major(torch_cuda_version)
    dirs = [Path(d) for d in (search_dirs if search_dirs is not None else default_search_dirs())]
    if major is None:
        raise ConfigError(
            f"--tms-hook-mode preload needs a CUDA build of torch (torch.version.cuda is {torch_cuda_version!r}); "
            "install a CUDA torch or use --memory-backend portable"
        )
    seen: list[str] = []
    for d in dirs:
        for p in sorted(d.glob(f"{PRELOAD_STEM}_cu{major}*.so")):
            return str(p)
        seen += [p.name for p in sorted(d.glob(f"{PRELOAD_STEM}_cu*.so"))]
    for d in dirs:
        for p in sorted(d.glob(f"{PRELOAD_STEM}.*so")):
            linked = linked_cudart_major(p)
            if linked == major:
                return str(p)
            seen.append(f"{p.name} (links libcudart {linked})")
    raise ConfigError(
        f"no torch_memory_saver preload library for CUDA {major}: searched "
        f"{', '.join(str(d) for d in dirs) or 'no directories (torch_memory_saver not installed)'} for "
        f"{PRELOAD_STEM}_cu{major}*.so and a matching {PRELOAD_STEM}.*so, found "
        f"{', '.join(seen) or 'none'}; install the torch_memory_saver wheel for CUDA {major} or use --tms-hook-mode torch"
    )


def check_allocator_conf(env: Mapping[str, str]) -> None:
    """Refuse ``expandable_segments:True``: torch_memory_saver cannot manage expandable segments."""
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = str(env.get(key, "")).replace(" ", "")
        for item in conf.split(","):
            name, _, value = item.partition(":")
            if name == "expandable_segments" and value.lower() in ("true", "1"):
                raise ConfigError(
                    f"{key}={conf} enables expandable_segments, which torch_memory_saver cannot pause; remove it "
                    "from the environment / --train-env-vars or use --memory-backend portable"
                )


def check_nccl_user_buffers(env: Mapping[str, str], *, grads_backup: bool) -> None:
    """Gradient buffers without backup live in tms regions; NCCL user buffers cannot, so refuse both."""
    if not grads_backup and str(env.get(NCCL_UB_ENV, "0")).lower() in ("1", "true"):
        raise ConfigError(
            f"{NCCL_UB_ENV}=1 (NCCL user-buffer registration) cannot be combined with --offload-train, whose "
            "gradient buffers are paused without backup; unset it in --train-env-vars"
        )


def actor_env(memory_cfg, train_env_vars: Mapping[str, object] | None, device: str) -> dict[str, str]:
    """Environment variables for the trainer actors' Ray runtime env.

    ``--train-env-vars`` is merged in; the torch_memory_saver variables are tidal's: a user value for
    ``TMS_INIT_*`` raises, a user ``LD_PRELOAD`` is kept after the memory-saver library.
    """
    env = {str(k): str(v) for k, v in (train_env_vars or {}).items()}
    backend, problem = resolve_backend(memory_cfg.memory_backend, device)
    offload_train = bool(memory_cfg.offload_train or memory_cfg.offload)
    if backend == "portable":
        if problem is not None and str(device).startswith("cuda"):
            log.info("memory: portable backend for trainer actors (%s); no preload variables set", problem)
        return env
    check_allocator_conf(env)
    check_nccl_user_buffers(env, grads_backup=not offload_train)
    if memory_cfg.tms_hook_mode != "preload":
        return env
    for key in ("TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP"):
        if key in env and env[key] != "1":
            raise ConfigError(
                f"--train-env-vars sets {key}={env[key]}, which tidal manages for --tms-hook-mode preload; remove it"
            )
    import torch

    lib = find_preload_library(torch.version.cuda)
    user_preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if any("torch_memory_saver" in p for p in user_preload):
        raise ConfigError(
            "--train-env-vars LD_PRELOAD names a torch_memory_saver library; tidal picks it by torch's CUDA version, "
            "remove it"
        )
    env["LD_PRELOAD"] = ":".join([lib, *user_preload])
    env["TMS_INIT_ENABLE"] = "1"
    env["TMS_INIT_ENABLE_CPU_BACKUP"] = "1"
    return env
