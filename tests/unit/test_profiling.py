"""The profile summaries' phase figures, read from a real torch.profiler trace and from a hand-made one."""

from __future__ import annotations

import json
import time

import torch

from tidal.profiling import ProfileRequest, profile_call, trace_phases


def test_profile_call_reports_each_labelled_phase_with_its_longest_operators(tmp_path):
    def work():
        with torch.profiler.record_function("tidal.prefill"):
            a = torch.randn(64, 64)
            for _ in range(3):
                a = a @ a
            time.sleep(0.02)  # host time inside the phase, no operator
        with torch.profiler.record_function("tidal.decode"):
            torch.randn(8).sum()
        torch.ones(3).add_(1)  # outside any phase
        return 7

    assert profile_call(ProfileRequest(str(tmp_path), "rollout1-generate-engine0"), work, "cpu") == 7
    summary = json.load(open(tmp_path / "rollout1-generate-engine0.json"))
    phases = summary["phases"]
    assert sorted(phases) == ["tidal.decode", "tidal.prefill"]
    prefill = phases["tidal.prefill"]
    assert prefill["calls"] == 1 and prefill["wall_s"] >= 0.02 and prefill["device_busy_s"] == 0.0  # no device
    names = [name for name, _ in prefill["longest_ops"]]
    assert any(n in ("aten::mm", "aten::matmul") for n in names) and "aten::add_" not in names, names
    assert all(s1 >= s2 for (_, s1), (_, s2) in zip(prefill["longest_ops"], prefill["longest_ops"][1:]))
    assert phases["tidal.decode"]["wall_s"] < prefill["wall_s"]


def test_device_busy_is_the_union_of_kernels_clipped_to_the_phase(tmp_path):
    # Chrome trace events in microseconds: a 100 us phase, kernels overlapping each other and its edges.
    def x(name, cat, ts, dur):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}

    events = [
        x("tidal.prefill", "user_annotation", 1000, 100),
        x("k1", "kernel", 990, 20),  # 10 us inside
        x("k2", "kernel", 1002, 5),  # inside k1's span: adds 0
        x("k3", "kernel", 1050, 10),
        x("copy", "gpu_memcpy", 1055, 10),  # overlaps k3: adds 5
        x("k4", "kernel", 1095, 50),  # 5 us inside
        x("k5", "kernel", 1200, 10),  # after the phase
        x("aten::slow", "cpu_op", 1010, 60),
        x("aten::fast", "cpu_op", 1080, 5),
        x("aten::outside", "cpu_op", 900, 500),
        x("cudaMalloc", "cuda_runtime", 1020, 30),
        x("cudaMalloc", "cuda_runtime", 1060, 12),
        x("cudaLaunchKernel", "cuda_runtime", 1075, 2),
        x("cuMemMap", "cuda_driver", 1090, 4),
        x("cudaFree", "cuda_runtime", 1150, 40),  # after the phase
    ]
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    phase = trace_phases(str(path))["tidal.prefill"]
    assert phase["wall_s"] == 100e-6 and abs(phase["device_busy_s"] - 30e-6) < 1e-12, phase
    assert [n for n, _ in phase["longest_ops"]] == ["aten::slow", "aten::fast"]
    # Host time in CUDA's API inside the phase, per call name (seconds, count), the most first.
    assert phase["runtime_calls"] == [["cudaMalloc", 42e-6, 2], ["cuMemMap", 4e-6, 1], ["cudaLaunchKernel", 2e-6, 1]]


def test_an_unreadable_trace_leaves_the_call_and_its_summary_standing(tmp_path, monkeypatch):
    import tidal.profiling as profiling

    def broken(path, top=3):
        raise ValueError("not a trace")

    monkeypatch.setattr(profiling, "trace_phases", broken)
    assert profile_call(ProfileRequest(str(tmp_path), "x"), lambda: 3, "cpu") == 3
    summary = json.load(open(tmp_path / "x.json"))
    assert summary["phases"] == {"unreadable_trace": {"error": "ValueError: not a trace"}}
