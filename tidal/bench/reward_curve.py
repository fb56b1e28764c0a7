"""Benchmark: the main job's reward curve and wall time.

    python -m tidal.bench.reward_curve [train flags]      (or: tidal bench reward-curve)

Runs ``tidal train`` (the embedded default unless flags say otherwise), then prints the reward
per step with the wall time since the command started, and a summary JSON line: the reward at the
start (mean of the first 3 steps), the best 3-step mean and when it was reached, the rise, and the
goal it is measured against (a rise of at least 0.3 within 180 s on a 2-core CPU).
"""

from __future__ import annotations

import json
import os
import sys
import time

GOAL_RISE, GOAL_SECONDS = 0.3, 180.0


def summarize(rows: list[dict]) -> dict:
    """Start reward, best 3-step mean, and the first time a rise of GOAL_RISE was seen."""
    rewards = [r["reward_mean"] for r in rows]
    start = sum(rewards[:3]) / max(1, len(rewards[:3]))
    best, best_at, reached_at = start, None, None
    for i in range(len(rows)):
        window = rewards[max(0, i - 2) : i + 1]
        m = sum(window) / len(window)
        t = rows[i]["elapsed_s"]
        if m > best:
            best, best_at = m, t
        if reached_at is None and m - start >= GOAL_RISE:
            reached_at = t
    return {
        "steps": len(rows),
        "reward_start": round(start, 4),
        "reward_best_3step": round(best, 4),
        "reward_rise": round(best - start, 4),
        "best_at_s": None if best_at is None else round(best_at, 1),
        "rise_0.3_at_s": None if reached_at is None else round(reached_at, 1),
        "goal": f"rise >= {GOAL_RISE} within {GOAL_SECONDS:.0f} s",
        "goal_met": reached_at is not None and reached_at <= GOAL_SECONDS,
    }


def main(argv: list[str] | None = None) -> int:
    t0 = time.time()
    from tidal.cli import _resolved
    from tidal.driver import train

    cfg, _ = _resolved(list(sys.argv[1:] if argv is None else argv))
    cfg.logging.progress = False
    train(cfg)
    wall = time.time() - t0
    path = os.path.join(cfg.logging.output_dir, "metrics.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    # elapsed_s in metrics.jsonl counts from the start of this process (Ray and actor start-up included).
    print("step  reward  wall_s")
    for r in rows:
        print(f"{r['step']:>4}  {r['reward_mean']:.3f}  {r['elapsed_s']:7.1f}")
    summary = summarize(rows)
    summary.update(
        {
            "wall_s": round(wall, 1),
            "device": cfg.cluster.device,
            "cpus": os.cpu_count(),
            "run_dir": cfg.logging.output_dir,
        }
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
