"""What the machine offers: devices, their memory, host memory, torch_memory_saver.

Resolution depends on the machine (``--device auto``, the memory backend, whether offload is
needed), so it takes an ``Environment`` instead of probing inside each rule: tests pass a made-up
one, and ``tidal explain --assume-gpus 8 --assume-gpu-memory 80GiB`` plans a GPU run on a laptop.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from dataclasses import dataclass

from tidal.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(text: str | int | float, what: str = "size") -> int:
    """``"80GiB"``, ``"512MiB"``, ``"1e9"``, ``1024`` -> bytes. Raises ConfigError naming ``what``."""
    if isinstance(text, bool):
        raise ConfigError(f"{what}: expected a size in bytes such as 512MiB, got {text!r}")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ConfigError(f"{what}: a size cannot be negative, got {text}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{what}: cannot read {text!r} as a size; write bytes or a number with a unit such as 512MiB or 80GiB"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """Bytes in binary units with three significant figures (``1.50 GiB``)."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def _has_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


# Device nodes and driver files of the GPU drivers torch.cuda can use (NVIDIA, ROCm, WSL's GPU).
_GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def _torch_cuda_version() -> int | None:
    """The CUDA version this torch was built for, as the driver API writes versions (13.0: 13000), read from
    ``torch/version.py`` without importing torch; None for a build without CUDA, or when it cannot be read."""
    spec = importlib.util.find_spec("torch")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        try:
            with open(os.path.join(root, "version.py")) as f:
                return cuda_build_version(f.read())
        except OSError:
            continue
    return None


def cuda_build_version(version_py: str) -> int | None:
    """The ``cuda = '13.0'`` line of a ``torch/version.py`` as 13000; None where it says None or is missing."""
    m = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"](\d+)\.(\d+)", version_py, re.M)
    return int(m.group(1)) * 1000 + int(m.group(2)) * 10 if m else None


def cuda_without_torch() -> tuple[int, int] | None:
    """``(devices, bytes of device 0)`` from the CUDA driver (``libcuda``, through ctypes), as torch would count
    them (``CUDA_VISIBLE_DEVICES`` applies), or None when this cannot say and torch must be asked: torch is
    loaded already, this torch was built without CUDA, there is no CUDA driver library, the driver is older
    than torch's CUDA version (torch may still run on it, or refuse), or it reports an error or no device.

    Importing torch took 3.8 s on the H100 hosts, and ``tidal train`` resolves its configuration before it
    starts the warm process (``tidal.cluster.warm``), whose imports are the start's critical path: probed
    this way, the warm process starts at once. The driver API initialises without a CUDA context."""
    import ctypes

    if "torch" in sys.modules:
        return None
    built = _torch_cuda_version()
    if built is None:
        return None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        version, count, dev, mem = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_size_t(0)
        ok = (
            cuda.cuDriverGetVersion(ctypes.byref(version)) == 0
            and version.value >= built
            and cuda.cuInit(0) == 0
            and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
            and count.value > 0
            and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
            and cuda.cuDeviceTotalMem_v2(ctypes.byref(mem), dev) == 0
        )
    except (OSError, AttributeError):  # no driver library, or one without these entry points
        return None
    return (int(count.value), int(mem.value)) if ok else None


def gpu_driver_present() -> bool:
    """Whether asking torch about CUDA can say yes: a GPU driver's files exist, or torch is loaded already.

    Without a driver ``torch.cuda.is_available()`` is False, so a CPU host is probed without importing
    torch (1.5-2 s of a 2-core machine's start-up; the driver process of ``tidal train`` needs no torch).
    """
    return "torch" in sys.modules or any(os.path.exists(p) for p in _GPU_DRIVER_PATHS)


@dataclass(frozen=True)
class Environment:
    cuda_available: bool = False
    device_count: int = 0  # accelerators per node
    device_memory: int = 0  # bytes per accelerator
    host_memory: int = 16 * 1024**3  # bytes per node
    cpu_count: int = 2
    tms_available: bool = False  # torch_memory_saver importable
    megatron_available: bool = False  # megatron-core importable (--train-backend megatron)
    transformer_engine_available: bool = False  # transformer_engine installed (Megatron's TE layer spec)
    apex_available: bool = False  # apex installed (its fused norm lets Megatron's local spec split sequences)
    num_nodes: int = 1  # nodes of the cluster (1 for a local cluster)
    assumed: bool = False  # built from --assume-* flags rather than probed

    @classmethod
    def detect(cls) -> Environment:
        """Probe this machine. Cheap: no CUDA context is kept, no model is built, and torch is imported only
        where the CUDA driver cannot be asked directly (``cuda_without_torch``)."""
        import psutil

        cuda, count, mem = False, 0, 0
        if gpu_driver_present():
            probed = cuda_without_torch()
            if probed is not None:
                cuda, (count, mem) = True, probed
            else:
                import torch

                cuda = torch.cuda.is_available()
                count = torch.cuda.device_count() if cuda else 0
                mem = torch.cuda.get_device_properties(0).total_memory if count else 0
        return cls(
            cuda_available=cuda,
            device_count=count,
            device_memory=int(mem),
            host_memory=int(psutil.virtual_memory().total),
            cpu_count=os.cpu_count() or 1,
            tms_available=importlib.util.find_spec("torch_memory_saver") is not None,
            megatron_available=_has_megatron(),
            transformer_engine_available=importlib.util.find_spec("transformer_engine") is not None,
            apex_available=importlib.util.find_spec("apex") is not None,
        )

    def with_assumptions(
        self,
        *,
        gpus: int | None = None,
        gpu_memory: int | None = None,
        host_memory: int | None = None,
        nodes: int | None = None,
        tms: bool | None = None,
    ) -> Environment:
        """This environment with some facts replaced, for planning a run on other hardware."""
        changes: dict = {}
        if gpus is not None:
            changes.update(cuda_available=gpus > 0, device_count=gpus)
            # A GPU host installs the gpu extra, which brings torch_memory_saver.
            changes.setdefault("tms_available", gpus > 0)
            changes.setdefault("megatron_available", self.megatron_available or gpus > 0)
            if gpus > 0 and gpu_memory is None and not self.device_memory:
                raise ConfigError("--assume-gpus needs --assume-gpu-memory (e.g. 80GiB) to plan memory")
        if gpu_memory is not None:
            changes["device_memory"] = gpu_memory
        if host_memory is not None:
            changes["host_memory"] = host_memory
        if nodes is not None:
            changes["num_nodes"] = nodes
        if tms is not None:
            changes["tms_available"] = tms
        return dataclasses.replace(self, assumed=self.assumed or bool(changes), **changes)

    def describe(self) -> str:
        head = "assumed" if self.assumed else "detected"
        if self.cuda_available:
            dev = f"{self.device_count} GPU(s) x {format_bytes(self.device_memory)}"
        else:
            dev = "no GPU"
        tms = "torch_memory_saver available" if self.tms_available else "no torch_memory_saver"
        nodes = f"{self.num_nodes} node(s), " if self.num_nodes != 1 else ""
        return f"{head}: {nodes}{dev}, host {format_bytes(self.host_memory)}, {self.cpu_count} CPU(s), {tms}"


ASSUME_FLAGS = (
    "--assume-gpus",
    "--assume-gpu-memory",
    "--assume-host-memory",
    "--assume-nodes",
    "--assume-tms",
    "--assume-no-tms",
)


def split_assumptions(argv: list[str], base: Environment | None = None) -> tuple[Environment, list[str]]:
    """Take the ``--assume-*`` flags of ``tidal explain`` out of ``argv``.

    Returns the environment (``base`` or this machine, with the assumptions applied) and the
    remaining arguments for ``tidal.config.parse``.
    """
    values: dict = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if name in ("--assume-tms", "--assume-no-tms"):
            values["tms"] = name == "--assume-tms"
            i += 1
            continue
        if name in ASSUME_FLAGS:
            if eq:
                value = inline
                i += 1
            elif i + 1 < len(argv):
                value = argv[i + 1]
                i += 2
            else:
                raise ConfigError(f"{name} needs a value")
            if name in ("--assume-gpus", "--assume-nodes"):
                try:
                    values["gpus" if name == "--assume-gpus" else "nodes"] = int(value)
                except ValueError:
                    raise ConfigError(f"{name}: expected a whole number, got {value!r}") from None
            else:
                key = "gpu_memory" if name == "--assume-gpu-memory" else "host_memory"
                values[key] = parse_size(value, name)
            continue
        rest.append(arg)
        i += 1
    env = base if base is not None else Environment.detect()
    return (env.with_assumptions(**values) if values else env), rest
