"""torch.profiler around one measured call, for the benchmarks' ``--profile`` flags and a run's ``--profile-rollouts``.

``profiled(fn, device, label)`` runs ``fn`` once under ``torch.profiler`` and returns its result and
a ``ProfileSummary``: on CUDA the device kernels (which is what a replayed CUDA graph shows: its
kernels, not the operators that launched them at capture), on the CPU the operators, each with its
self time, sorted by it. ``by_category`` adds the kernels up by what their names say they are
(communication, attention, matrix multiplies, inductor-fused triton kernels, sampling, softmax, copies and
indexing, reductions, the rest), so that a decode or train step's breakdown reads off one line. The table goes to
stderr, the summary is one JSON-able dict (the benchmark prints it on stdout).

``profile_call`` is the same for a training run's own calls (``--profile-rollouts``): an engine's generate
or the trainer's train of the rollouts named, each writing its summary and a Chrome trace into the run
directory's ``profiles/``, so that a phase is seen as it runs in the loop, beside the other actors. Its
summary adds ``phases``: per ``record_function`` label of tidal's own (the decoder's ``tidal.prefill`` and
``tidal.decode``, the trainer's ``tidal.old_logprobs``, ``tidal.micro_batch`` and ``tidal.optimizer``), the
wall, the device's busy time inside it, the longest operators and the CUDA API calls that took the most host
time, read back from the trace (``trace_phases``), so a phase that waits on the host says so, and on what,
without opening the trace.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

# (category, substrings of a lower-cased kernel or operator name); the first match wins.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "allgather", "reducescatter", "allreduce")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient_attention", "softmax_warp")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "aten::mm", "aten::addmm", "aten::bmm")),
    ("triton", ("triton_",)),
    ("sampling", ("exponential", "multinomial", "philox", "uniform", "normal", "argmax")),
    ("softmax", ("softmax", "logsumexp")),
    ("copy_index", ("copy", "index", "scatter", "gather", "cat", "fill", "memset", "memcpy", "where")),
    ("reduce", ("reduce", "sum", "max", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "aten::")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


@dataclass
class ProfileSummary:
    """Where the time of one profiled call went (seconds of device time on CUDA, CPU time elsewhere)."""

    label: str
    clock: str  # "device" (CUDA kernels) or "cpu" (operators' self time)
    wall_s: float
    total_s: float
    kernels: int  # distinct kernel (or operator) names
    launches: int
    by_category: dict[str, float] = field(default_factory=dict)
    top: list[tuple[str, float, int]] = field(default_factory=list)  # (name, seconds, calls)
    phases: dict[str, dict] = field(default_factory=dict)  # per ``tidal.*`` label of the trace (``trace_phases``)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["top"] = [[n[:120], round(s, 6), c] for n, s, c in self.top]
        out["by_category"] = {k: round(v, 6) for k, v in self.by_category.items()}
        out["total_s"], out["wall_s"] = round(self.total_s, 6), round(self.wall_s, 6)
        return {"profile": out.pop("label"), **out}


def _self_us(evt, device: bool) -> float:
    if device:
        for name in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(evt, name):
                return float(getattr(evt, name))
        return 0.0
    return float(evt.self_cpu_time_total)


def _is_device(evt) -> bool:
    kind = getattr(evt, "device_type", None)
    return kind is not None and str(kind).endswith("CUDA")


def summarize(events, label: str, wall_s: float, device: bool, top: int = 15) -> ProfileSummary:
    """A summary of ``prof.key_averages()``: device kernels when ``device``, else CPU operators."""
    rows = []
    for evt in events:
        if device != _is_device(evt):
            continue
        us = _self_us(evt, device)
        if us > 0:
            rows.append((evt.key, us / 1e6, int(evt.count)))
    rows.sort(key=lambda r: -r[1])
    by_cat: dict[str, float] = {}
    for name, s, _ in rows:
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + s
    return ProfileSummary(
        label=label,
        clock="device" if device else "cpu",
        wall_s=wall_s,
        total_s=sum(r[1] for r in rows),
        kernels=len(rows),
        launches=sum(r[2] for r in rows),
        by_category=dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        top=rows[:top],
    )


def profiled(
    fn: Callable[[], Any], device: str, label: str, row_limit: int = 40, trace: str | None = None
) -> tuple[Any, ProfileSummary]:
    """Run ``fn`` once under torch.profiler; print the table by self time to stderr (``row_limit`` 0: no table);
    (result, summary). ``trace``: also write the Chrome trace there (atomically), a timeline of every operator
    and kernel, where the device's idle gaps show."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = str(device).startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    if row_limit:
        print(f"--- torch.profiler: {label} (sorted by {key}) ---", file=sys.stderr)
        print(averages.table(sort_by=key, row_limit=row_limit), file=sys.stderr)
    if trace is not None:
        tmp = f"{trace}.tmp-{os.getpid()}"
        prof.export_chrome_trace(tmp)
        os.replace(tmp, trace)
    return out, summarize(averages, label, wall, cuda)


@dataclass(frozen=True)
class ProfileRequest:
    """Profile an actor's next call of one phase (``--profile-rollouts``): its files go to ``dir`` as
    ``<label>.json`` (the ``ProfileSummary``) and ``<label>.trace.json`` (the Chrome trace)."""

    dir: str
    label: str  # e.g. "rollout3-generate-engine0"


def profile_call(request: ProfileRequest, fn: Callable[[], Any], device: str) -> Any:
    """``fn`` under torch.profiler, its summary and trace written as ``request`` says; returns ``fn``'s result."""
    from tidal.atomic import write_text_atomic

    os.makedirs(request.dir, exist_ok=True)
    base = os.path.join(request.dir, request.label)
    out, summary = profiled(fn, device, request.label, row_limit=0, trace=f"{base}.trace.json")
    try:
        summary.phases = trace_phases(f"{base}.trace.json")
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a profile never stops the run: say why in it
        summary.phases = {"unreadable_trace": {"error": f"{type(exc).__name__}: {exc}"[:200]}}
    write_text_atomic(f"{base}.json", json.dumps(summary.as_dict(), indent=1) + "\n")
    return out


PHASE_PREFIX = "tidal."  # record_function labels of the code's own phases (decoder and trainer)
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_RUNTIME_CATS = ("cuda_runtime", "cuda_driver")  # host-side CUDA API calls (cudaMalloc, cudaLaunchKernel, ...)


def trace_phases(path: str, top: int = 3) -> dict[str, dict]:
    """Per labelled phase of a Chrome trace (``record_function`` names starting ``PHASE_PREFIX``): its wall,
    how much of it the device was busy (the union of kernel and copy intervals inside it), its longest
    operators, and the CUDA runtime and driver calls it spent the most host time in (``runtime_calls``: name,
    seconds, count, summed over the phase's calls). A phase whose device is idle most of its wall is waiting
    on the host: its longest operators name the wait (a prefill that spent 70 ms building cuDNN's attention
    graph showed this way), its runtime calls a wait inside CUDA (``cudaMalloc``, ``cudaFree``, a synchronize)."""
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    device = sorted(
        ((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in _DEVICE_CATS), key=lambda iv: iv[0]
    )
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    runtime = [e for e in events if e.get("cat") in _RUNTIME_CATS]
    out: dict[str, dict] = {}
    calls: dict[str, dict[str, list[float]]] = {}
    for label in (e for e in events if e.get("name", "").startswith(PHASE_PREFIX)):
        if label.get("cat") not in ("user_annotation", "cpu_op"):
            continue
        a, b = label["ts"], label["ts"] + label.get("dur", 0)
        phase = out.setdefault(label["name"], {"calls": 0, "wall_s": 0.0, "device_busy_s": 0.0, "longest_ops": []})
        phase["calls"] += 1
        phase["wall_s"] += (b - a) / 1e6
        phase["device_busy_s"] += _busy(device, a, b) / 1e6
        inside = [o for o in ops if a <= o["ts"] and o["ts"] + o.get("dur", 0) <= b]
        longest = sorted(inside, key=lambda o: -o.get("dur", 0))[:top]
        phase["longest_ops"] += [[o["name"][:80], round(o.get("dur", 0) / 1e6, 6)] for o in longest]
        totals = calls.setdefault(label["name"], {})
        for r in (r for r in runtime if a <= r["ts"] and r["ts"] + r.get("dur", 0) <= b):
            seconds_count = totals.setdefault(r["name"][:80], [0.0, 0])
            seconds_count[0] += r.get("dur", 0) / 1e6
            seconds_count[1] += 1
    for name, phase in out.items():
        phase["wall_s"], phase["device_busy_s"] = round(phase["wall_s"], 6), round(phase["device_busy_s"], 6)
        phase["longest_ops"] = sorted(phase["longest_ops"], key=lambda r: -r[1])[:top]
        ranked = sorted(calls.get(name, {}).items(), key=lambda kv: -kv[1][0])[:top]
        phase["runtime_calls"] = [[n, round(sec, 6), count] for n, (sec, count) in ranked]
    return out


def _busy(intervals: list[tuple[float, float]], a: float, b: float) -> float:
    """Length of the union of ``intervals`` (sorted by start) clipped to ``[a, b]``."""
    total, end = 0.0, a
    for lo, hi in intervals:
        if lo >= b:
            break
        lo, hi = max(lo, end), min(hi, b)
        if hi > lo:
            total += hi - lo
            end = hi
    return total
