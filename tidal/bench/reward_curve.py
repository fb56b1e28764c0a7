"""Benchmark: the main job's reward curve and wall time.

    python -m tidal.bench.reward_curve [train flags]      (or: tidal bench reward-curve)

Runs ``tidal train`` (the embedded default unless flags say otherwise), then prints the reward
per step with the wall time since the command started, and a summary JSON line: the reward at the
start (mean of the first 3 steps), the best 3-step mean and when it was reached, the rise, and the
goal it is measured against (a rise of at least 0.3 within 180 s on a 2-core CPU).

With ``--eval-interval`` (the ``smollm2-135m-cpu`` preset sets it) the curve is greedy eval
accuracy on the held-out prompts, starting from the weights before any training, and the goal is
a rise of at least 0.15 within 20 minutes on a 2-core CPU. The summary also gives the machine's
load average during the run, since a shared machine stretches every figure.
"""

from __future__ import annotations

import json
import os
import sys
import time

GOAL_RISE, GOAL_SECONDS = 0.3, 180.0
EVAL_GOAL_RISE, EVAL_GOAL_SECONDS = 0.15, 1200.0


def eval_points(rows: list[dict]) -> list[tuple[float, int, float]]:
    """(wall s, step, greedy eval accuracy): the starting weights' (step -1), then each evaluated step."""
    points = []
    if rows and rows[0].get("eval_accuracy_initial") is not None:
        points.append((rows[0]["eval_initial_elapsed_s"], -1, rows[0]["eval_accuracy_initial"]))
    points += [(r["elapsed_s"], r["step"], r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
    return points


def summarize_eval(points: list[tuple[float, int, float]]) -> dict:
    """Start accuracy, best accuracy and when, and the first time a rise of EVAL_GOAL_RISE was seen."""
    start = points[0][2]
    best, best_at, reached_at = start, points[0][0], None
    for t, _, acc in points[1:]:
        if acc > best:
            best, best_at = acc, t
        if reached_at is None and acc - start >= EVAL_GOAL_RISE - 1e-9:
            reached_at = t
    return {
        "evals": len(points),
        "eval_start": round(start, 4),
        "eval_best": round(best, 4),
        "eval_rise": round(best - start, 4),
        "eval_best_at_s": round(best_at, 1),
        f"eval_rise_{EVAL_GOAL_RISE}_at_s": None if reached_at is None else round(reached_at, 1),
        "goal": f"eval accuracy rise >= {EVAL_GOAL_RISE} within {EVAL_GOAL_SECONDS:.0f} s",
        "goal_met": reached_at is not None and reached_at <= EVAL_GOAL_SECONDS,
    }


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
    points = eval_points(rows)
    if points:
        print("step  eval_accuracy  wall_s")
        for t, step, acc in points:
            print(f"{step:>4}  {acc:13.3f}  {t:7.1f}")
        summary = summarize_eval(points)
    else:
        print("step  reward  wall_s")
        for r in rows:
            print(f"{r['step']:>4}  {r['reward_mean']:.3f}  {r['elapsed_s']:7.1f}")
        summary = summarize(rows)
    summary.update(
        {
            "wall_s": round(wall, 1),
            "device": cfg.cluster.device,
            "cpus": os.cpu_count(),
            "load_avg_15min_at_end": round(os.getloadavg()[2], 1),
            "run_dir": cfg.logging.output_dir,
        }
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
