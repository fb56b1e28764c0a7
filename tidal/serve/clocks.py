"""What ``tidal serve`` measures about each engine step: seconds in the garbage collector, CPU seconds of the
engine's and the event loop's threads, the fast decoder's own figures (``StepInfo``, ``tidal bench serve``)."""

from __future__ import annotations

import gc
import time


class GcClock:
    """Seconds this process has spent in the cyclic garbage collector since ``start()`` (a ``gc.callbacks``
    hook; each collection stops every thread, the engine's decode loop included)."""

    seconds = 0.0
    passes = [0, 0, 0]  # collections of each generation
    _began = 0.0
    _on = False

    @classmethod
    def start(cls) -> None:
        if not cls._on:
            cls._on = True
            gc.callbacks.append(cls._hook)

    @classmethod
    def _hook(cls, phase: str, info: dict) -> None:
        if phase == "start":
            cls._began = time.perf_counter()
        else:
            cls.seconds += time.perf_counter() - cls._began
            cls.passes[info["generation"]] += 1


def decode_figures(engine) -> dict:
    """The fast decoder's figures of ``engine``'s last decoder call (empty without a fast decoder)."""
    stats = getattr(getattr(engine, "_fast_decoder", None), "last_stats", None) or {}
    keys = ("prefill_s", "decode_s", "steps", "graph_captures", "capture_s", "compactions")
    return {k: stats[k] for k in keys if k in stats}


def cpu_clocks(loop_thread: int | None) -> tuple[float, float | None]:
    """CPU seconds so far of this thread and of the event loop's thread (None where unreadable)."""
    try:
        other = time.clock_gettime(time.pthread_getcpuclockid(loop_thread)) if loop_thread is not None else None
    except (AttributeError, OSError):  # not Linux, or that thread ended
        other = None
    return time.thread_time(), other


def cpu_spent(loop_thread: int | None, since: tuple[float, float | None]) -> tuple[float, float | None]:
    now = cpu_clocks(loop_thread)
    return now[0] - since[0], (now[1] - since[1] if now[1] is not None and since[1] is not None else None)
