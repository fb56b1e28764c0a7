"""PNG plots of a run: reward and phase times over steps, and when and where a run redraws them.

Drawn with matplotlib's Agg backend (no display needed) from the rows of ``metrics.jsonl``.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable

from tidal.background import in_background

PHASES = ("generate_s", "release_s", "train_s", "pause_s", "sync_s", "resume_s")
REDRAW_EVERY_S = 30.0


class RedrawClock:
    """When a run redraws its charts between steps: once ``every_s`` seconds have passed since the
    start or the last redraw (the run draws them once more at its end).

    Drawing the two charts costs ~0.4 s of CPU, more as the memory timeline grows: a schedule by
    rollout would tax a small, fast run most (a tiny model's step takes about a second on a CPU); a
    schedule by time bounds the cost to ~1 % of any run."""

    def __init__(self, every_s: float = REDRAW_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self._clock = clock
        self._last = clock()

    def due(self) -> bool:
        """True (and the clock restarts) when the charts should be redrawn now."""
        now = self._clock()
        if now - self._last < self.every_s:
            return False
        self._last = now
        return True


class ChartThread:
    """Draws a run's charts in one background thread, so that a redraw never holds up a step.

    Drawn on the driver's own thread, a redraw stopped the loop between two steps for its ~0.4 s of CPU,
    and the run's first one longer (it also waits for matplotlib's import): time in which the trainer
    idled, and in the synchronous loop the engines too. The driver now hands this thread
    a copy of what it has recorded and goes on; it mostly waits on its actors meanwhile, so the drawing
    takes little from it. A redraw that falls due while the last one is still drawing is skipped; a draw
    that failed raises at the next redraw, or at ``wait``."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future | None = None

    def start(self, draw: Callable[..., object], *args) -> bool:
        """``draw(*args)`` in the background, unless a draw is still running (then False)."""
        if self._future is not None:
            if not self._future.done():
                return False
            done, self._future = self._future, None
            done.result()  # the last draw's failure, if any (raised once)
        self._future = in_background(draw, *args, name="tidal-charts")
        return True

    def wait(self) -> None:
        """Until the draw in flight (if any) has finished; raises its failure."""
        future, self._future = self._future, None
        if future is not None:
            future.result()


def import_plotting() -> None:
    """matplotlib with its Agg backend and pyplot, imported (a run imports them beside its steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def plot_curves(rows: list[dict], path: str) -> str | None:
    """Reward (with eval accuracy when present) and stacked phase times per step."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ax1.plot(steps, [r.get("reward_mean", float("nan")) for r in rows], label="reward_mean")
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
    if evals:
        ax1.plot(*zip(*evals), "o-", label="eval_accuracy")
    ax1.set_ylabel("reward")
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right")
    # Stacked bands, one filled polygon per phase (bars cost a patch per step and phase: most of the drawing).
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        vals = [float(r.get(phase) or 0.0) for r in rows]
        if any(vals):
            top = [b + v for b, v in zip(bottom, vals)]
            ax2.fill_between(steps, bottom, top, step="mid", linewidth=0, label=phase.removesuffix("_s"))
            bottom = top
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return path
