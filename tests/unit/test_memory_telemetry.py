"""Memory telemetry: readings and the timeline PNG written into a run directory."""

from __future__ import annotations

import json

import torch

from tidal.memory import MemoryTimeline, device_used_bytes, host_rss_bytes


def test_readings_track_a_real_allocation():
    before = host_rss_bytes()
    t = torch.ones(32 * 1024**2, dtype=torch.uint8)  # touched: counts in RSS
    assert host_rss_bytes() - before >= 30 * 1024**2
    assert device_used_bytes("cpu") >= host_rss_bytes() - 8 * 1024**2  # a CPU device is the host
    del t


def test_timeline_writes_png_and_json(tmp_path):
    tl = MemoryTimeline("test run")
    gib = 1024**3
    for phase, rss, dev in [
        ("generate", 3 * gib, 20 * gib),
        ("engine_release", 3 * gib, 2 * gib),
        ("trainer_resume", 3 * gib, 30 * gib),
        ("trainer_pause", 19 * gib, 2 * gib),
    ]:
        tl.mark(phase, rss, dev)
    default = tl.mark("sync")  # readings default to this process
    assert default.host_rss > 0 and default.device_used == 0
    png = tl.save(tmp_path / "run")
    data = png.read_bytes()
    assert png.name == "memory_timeline.png" and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    points = json.loads((tmp_path / "run" / "memory_timeline.json").read_text())
    assert [p["phase"] for p in points] == ["generate", "engine_release", "trainer_resume", "trainer_pause", "sync"]
    assert points[3]["host_rss"] == 19 * gib
    assert all(b["seconds"] >= a["seconds"] for a, b in zip(points, points[1:], strict=False))
