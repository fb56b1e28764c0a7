"""curves.png: what is drawn from the metrics rows, and when a run redraws its charts."""

from __future__ import annotations

import struct

from tidal.observe.plots import RedrawClock, plot_curves


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
