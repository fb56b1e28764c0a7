"""What people see while a run goes: a progress display and one line of metrics per step.

On a terminal a live ``rich`` progress bar shows the rollout and the current phase; elsewhere
(CI, pipes) only the per-step lines are printed. The per-step line holds reward, loss, KL,
entropy, tokens/s, phase times and memory.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def _fmt_bytes(n: float | None) -> str:
    if not n:
        return "0"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}P"


def step_line(row: dict) -> str:
    def g(k, fmt="{:.3f}"):
        v = row.get(k)
        return "-" if v is None else fmt.format(v)

    phases = " ".join(
        f"{p.removesuffix('_s')}={row[p]:.2f}s"
        for p in ("generate_s", "train_s", "sync_s", "pause_s", "resume_s", "release_s")
        if row.get(p) is not None
    )
    mem = f"host={_fmt_bytes(row.get('host_rss_bytes'))}"
    if row.get("device_peak_bytes"):
        mem += f" dev_peak={_fmt_bytes(row.get('device_peak_bytes'))}"
    return (
        f"step {row['step']:>4} | reward {g('reward_mean')} | loss {g('loss', '{:+.4f}')} | kl {g('kl', '{:.4f}')} "
        f"| ent {g('entropy', '{:.3f}')} | gen {g('gen_tokens_per_s', '{:.0f}')} tok/s | {phases} | {mem} | t={row['elapsed_s']:.0f}s"
    )


class Display:
    def __init__(self, total: int, enabled: bool = True):
        self.console = Console(stderr=False, highlight=False)
        self.live = enabled and sys.stdout.isatty()
        self.progress = None
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]rollout"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[phase]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self.task = self.progress.add_task("rollout", total=total, phase="starting")
            self.progress.start()

    def phase(self, name: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, phase=name)

    def step(self, row: dict) -> None:
        line = step_line(row)
        if self.progress is not None:
            self.progress.console.print(line)
            self.progress.advance(self.task)
        else:
            print(line, flush=True)

    def info(self, msg: str) -> None:
        if self.progress is not None:
            self.progress.console.print(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
