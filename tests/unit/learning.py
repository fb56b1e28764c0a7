"""The learning check of the end-to-end tests: a run learns when the mean reward of its last three
rollouts is ``RISE`` above that of its first three (at least six rollouts), within the default
budget of 60 rollouts. A run stops as soon as it has shown that (``on_step`` raises ``Reached``),
which keeps the runs that check it within CI's time."""

from __future__ import annotations

RISE = 0.3


class Reached(Exception):
    """Raised from ``on_step`` once the rise is reached: the run has shown what it must."""


def rose(rows: list[dict], rise: float = RISE) -> bool:
    """Whether the 3-rollout mean reward at the end of ``rows`` is ``rise`` above the one at the start."""
    rewards = [r["reward_mean"] for r in rows]
    return len(rows) >= 6 and sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 >= rise


def learn(cfg) -> tuple[list[dict], bool]:
    """Train ``cfg`` until the rise (or the end of its budget); the rows of its rollouts, and whether it rose."""
    from tidal.driver import train

    rows: list[dict] = []

    def on_step(s, rollout_id, row):
        if rollout_id < 0:
            return
        rows.append(row)
        if rose(rows):
            raise Reached

    try:
        train(cfg, on_step=on_step)
    except Reached:
        return rows, True
    return rows, False
