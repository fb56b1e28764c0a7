"""curves.png: what is drawn from the metrics rows, and when a run redraws its charts."""

from __future__ import annotations

import struct
import threading
import time

import pytest

from tidal.memory.telemetry import MemoryTimeline
from tidal.observe.plots import ChartThread, RedrawClock, plot_curves


def _png_size(path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, read by the PNG specification (signature, then IHDR first)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def test_curves_png_from_rows(tmp_path):
    rows = [
        {"step": i, "reward_mean": 0.1 * i, "generate_s": 1.0, "train_s": 2.0, "sync_s": 0.1, "eval_accuracy": None}
        for i in range(4)
    ]
    rows[3]["eval_accuracy"] = 0.5
    path = tmp_path / "curves.png"
    assert plot_curves(rows, str(path)) == str(path)
    assert _png_size(path) == (720, 630)  # 8 x 7 inches at 90 dpi
    assert path.stat().st_size > 10_000  # two panels with axes, legends and phase bands, not a blank canvas
    assert not list(tmp_path.glob("*.tmp.png")), "written through a temporary file, then renamed"
    assert plot_curves([], str(tmp_path / "none.png")) is None and not (tmp_path / "none.png").exists()


def test_redraw_clock_waits_its_interval_between_redraws():
    now = [100.0]
    clock = RedrawClock(every_s=30.0, clock=lambda: now[0])
    seen = []
    for t in (101.0, 129.9, 130.0, 131.0, 159.0, 161.0):
        now[0] = t
        seen.append(clock.due())
    assert seen == [False, False, True, False, False, True]


def test_chart_thread_draws_beside_the_caller_skips_while_busy_and_raises_a_failed_draw(tmp_path):
    gate, drawn = threading.Event(), []

    def draw(rows, path):
        assert gate.wait(10)
        drawn.append(plot_curves(rows, path))

    rows = [{"step": i, "reward_mean": 0.1 * i, "train_s": 1.0} for i in range(3)]
    charts = ChartThread()
    assert charts.start(draw, rows, str(tmp_path / "a.png"))  # returns while the draw waits on the gate
    assert not charts.start(draw, rows, str(tmp_path / "b.png"))  # due while drawing: skipped
    gate.set()
    charts.wait()
    assert drawn == [str(tmp_path / "a.png")] and not (tmp_path / "b.png").exists()

    def fail():
        raise OSError("no space left on device")

    assert charts.start(fail)
    with pytest.raises(OSError, match="no space"):
        while not charts.start(lambda: None):  # the next redraw raises the last one's failure
            time.sleep(0.01)
    charts.start(fail)
    with pytest.raises(OSError, match="no space"):
        charts.wait()
    charts.wait()  # nothing in flight


def test_memory_timeline_snapshot_keeps_the_points_so_far(tmp_path):
    timeline = MemoryTimeline("t")
    timeline.mark("step", 1 << 30, 2 << 30)
    copy = timeline.snapshot()
    timeline.mark("step", 1 << 30, 3 << 30)
    assert [p.device_used for p in copy.points] == [2 << 30] and len(timeline.points) == 2
    assert copy.points[0].seconds == timeline.points[0].seconds
    assert copy.write_png(tmp_path / "m.png").stat().st_size > 0
