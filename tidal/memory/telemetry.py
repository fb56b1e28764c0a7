"""Memory telemetry: process and device memory readings, and a timeline of the run's phases.

``host_rss_bytes()`` and ``device_used_bytes(device)`` are the two numbers every pause/resume
report carries. Device memory is read from the driver (``torch.cuda.mem_get_info``), not from
PyTorch's allocator counters, because a paused torch_memory_saver region is invisible to the
allocator but not to the driver. On a CPU device the device *is* the host, so its "device
memory" is the process RSS.

``MemoryTimeline`` collects one point per phase event (``mark("generate", rss, dev)``) and one per
step (``mark("step", ...)``, whether anything paused or not) from the driver and draws them into a PNG in the run directory, so the colocation plot (trainer and engine
taking turns on one device, host memory rising by the backups) is visible after a run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    import torch

_LIBC: ctypes.CDLL | None = None
_LIBC_LOADED = False


_PROC: psutil.Process | None = None


def host_rss_bytes() -> int:
    """Resident set size of this process in bytes."""
    global _PROC
    if _PROC is None or _PROC.pid != os.getpid():  # a forked child must not read its parent
        _PROC = psutil.Process()
    return _PROC.memory_info().rss


def device_used_bytes(device: str | torch.device) -> int:
    """Bytes in use on ``device`` as the driver sees them (all processes); host RSS for a CPU device."""
    if not str(device).startswith("cuda"):
        return host_rss_bytes()  # torch is imported only for a device that needs it (the driver reads this on CPU)
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return int(total - free)
    return host_rss_bytes()


def trim_host_heap() -> bool:
    """Return freed heap pages to the OS (glibc ``malloc_trim``); False where libc has no such call.

    Large blocks (above glibc's mmap threshold, at most 32 MiB) go back to the OS on free; the
    many small ones of a model's parameters live in the heap and stay in RSS until trimmed.
    """
    global _LIBC, _LIBC_LOADED
    if not _LIBC_LOADED:
        _LIBC_LOADED = True
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
        except OSError:
            lib = None
        _LIBC = lib if lib is not None and hasattr(lib, "malloc_trim") else None
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True


@dataclass
class TimelinePoint:
    seconds: float  # since the timeline started
    phase: str
    host_rss: int
    device_used: int


class MemoryTimeline:
    """Phase events with host and device memory; written as a PNG (and JSON) into the run directory."""

    def __init__(self, title: str = "memory across phases"):
        self.title = title
        self.points: list[TimelinePoint] = []
        self._t0 = time.perf_counter()

    def mark(self, phase: str, host_rss: int | None = None, device_used: int | None = None) -> TimelinePoint:
        """Record ``phase`` now; readings default to this process's RSS and nothing on the device."""
        point = TimelinePoint(
            seconds=time.perf_counter() - self._t0,
            phase=phase,
            host_rss=int(host_rss if host_rss is not None else host_rss_bytes()),
            device_used=int(device_used if device_used is not None else 0),
        )
        self.points.append(point)
        return point

    def snapshot(self) -> MemoryTimeline:
        """A copy holding the points so far (drawn in another thread while this one goes on recording)."""
        copy = MemoryTimeline(self.title)
        copy.points, copy._t0 = list(self.points), self._t0
        return copy

    def to_json(self) -> str:
        return json.dumps([asdict(p) for p in self.points])

    def write_png(self, path: str | os.PathLike) -> Path:
        """Draw host RSS and device memory (GiB) against time, one labelled marker per phase."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        xs = [p.seconds for p in self.points]
        gib = 1024**3
        fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
        # Steps, not lines: the reading holds until the next phase event.
        ax.step(xs, [p.device_used / gib for p in self.points], where="post", marker="o", label="device used")
        ax.step(xs, [p.host_rss / gib for p in self.points], where="post", marker="s", label="host RSS")
        # Pause/resume events are labelled; the per-step readings ("step") only get their markers.
        for p in self.points:
            if p.phase != "step":
                ax.annotate(p.phase, (p.seconds, p.device_used / gib), rotation=60, fontsize=7, alpha=0.8)
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("GiB")
        ax.set_title(self.title)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path

    def save(self, run_dir: str | os.PathLike, name: str = "memory_timeline") -> Path:
        """Write ``<run_dir>/<name>.png`` and ``<run_dir>/<name>.json``; returns the PNG path."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / f"{name}.json").write_text(self.to_json())
        return self.write_png(run_dir / f"{name}.png")


def process_memory_stats(device: str, reset_peak: bool = True) -> dict[str, int]:
    """This process's memory since the last call: host RSS, device peak allocated, device in use.

    ``device_used`` is the driver's view of the whole device (every process on it), so for
    colocated actors it shows what trainer and engine hold together.
    """
    out = {"host_rss": host_rss_bytes(), "device_peak": 0, "device_used": 0}
    if device != "cuda":
        return out
    import torch

    if torch.cuda.is_available():
        out["device_peak"] = int(torch.cuda.max_memory_allocated())
        out["device_used"] = int(device_used_bytes("cuda"))
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()
    return out
