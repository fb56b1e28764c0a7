"""Benchmark: synchronous, one-step and fully asynchronous training on the same work, in one job.

    python -m tidal.bench.async_modes [--modes sync,one-step,full] [train flags]   (or: tidal bench async)

Runs ``tidal train`` once per mode with the same flags (the embedded default unless flags say
otherwise) and the same placement: the one the asynchronous rule picks (on CPU, engines on their
own cores; on one GPU, trainer and engine resident side by side), passed to every mode explicitly.
For each mode it prints, over the steps after the first (start-up and first compilation excluded):

- samples/s: samples trained per second of step wall time, and the ratio to sync's;
- trainer busy: the fraction of the wall time the trainer spent training;
- engine busy: the fraction of engine time spent generating (sync: generate time over wall time;
  async: the engines' own call time, ``engine_busy_frac``);
- reward per step: the mean over the steps, and the mean of the last three.

The goal it is measured against (the H200, 0.5B shape, one GPU): one-step at least 1.5x sync's
samples/s at equal reward per sample. A summary JSON line follows the table.
"""

from __future__ import annotations

import json
import sys
import time

GOAL_SPEEDUP = 1.5
MODES = ("sync", "one-step", "full")


def placement_flags(flags: list[str]) -> list[str]:
    """The placement ``--async one-step`` resolves to, as explicit flags for every mode."""
    from tidal.config import parse, resolve

    if any(f in flags for f in ("--colocate", "--no-colocate")):
        return []
    cfg, prov = parse([*flags, "--async", "one-step"])
    cfg = resolve(cfg, prov)
    out = ["--colocate" if cfg.cluster.colocate else "--no-colocate"]
    if not cfg.cluster.colocate and "--rollout-num-gpus" not in flags:
        out += ["--rollout-num-gpus", str(cfg.cluster.rollout_num_gpus)]
    if cfg.cluster.colocate:
        out += ["--no-offload"]
    return out


def run_mode(mode: str, flags: list[str]) -> list[dict]:
    from tidal.config import parse, resolve
    from tidal.driver import train

    argv = [*flags, "--no-progress"] + ([] if mode == "sync" else ["--async", mode])
    cfg, prov = parse(argv)
    cfg.logging.output_dir = None if cfg.logging.output_dir is None else f"{cfg.logging.output_dir}-{mode}"
    cfg = resolve(cfg, prov)
    rows: list[dict] = []
    train(cfg, on_step=lambda s, rollout_id, row: rows.append(row) if rollout_id >= 0 else None)
    return rows


def summarize(mode: str, rows: list[dict]) -> dict:
    """Figures over the steps after the first (see the module docstring)."""
    steady = rows[1:] or rows
    walls = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])] or [rows[0].get("elapsed_s", 0.0)]
    wall = sum(walls)
    samples = sum(r.get("train_samples", r.get("gen_samples", 0)) for r in steady)
    train_s = sum(r.get("train_s", 0.0) for r in steady)
    if mode == "sync":
        engine = sum(r.get("generate_s", 0.0) for r in steady) / wall if wall else 0.0
    else:
        engine = sum(r["engine_busy_frac"] * w for r, w in zip(steady, walls)) / wall if wall else 0.0
    rewards = [r["reward_mean"] for r in rows]
    return {
        "mode": mode,
        "steps": len(rows),
        "samples_per_s": samples / wall if wall else 0.0,
        "trainer_busy": train_s / wall if wall else 0.0,
        "engine_busy": engine,
        "reward_per_step": sum(rewards) / len(rewards),
        "reward_last3": sum(rewards[-3:]) / len(rewards[-3:]),
        "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in steady) / len(steady),
        "dropped_groups": rows[-1].get("async/dropped_total", 0),
    }


def table(results: list[dict]) -> str:
    base = next((r["samples_per_s"] for r in results if r["mode"] == "sync"), None)
    lines = [
        f"{'mode':<9} {'samples/s':>10} {'x sync':>7} {'trainer busy':>13} {'engine busy':>12} "
        f"{'reward/step':>12} {'last 3':>7} {'staleness':>10} {'dropped':>8}"
    ]
    for r in results:
        ratio = f"{r['samples_per_s'] / base:.2f}" if base else "-"
        lines.append(
            f"{r['mode']:<9} {r['samples_per_s']:>10.1f} {ratio:>7} {r['trainer_busy']:>13.2f} {r['engine_busy']:>12.2f} "
            f"{r['reward_per_step']:>12.3f} {r['reward_last3']:>7.3f} {r['staleness_mean']:>10.2f} {r['dropped_groups']:>8}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    modes = list(MODES)
    if "--modes" in argv:
        i = argv.index("--modes")
        modes = argv[i + 1].split(",")
        del argv[i : i + 2]
    bad = [m for m in modes if m not in MODES]
    if bad:
        from tidal.errors import UserError

        raise UserError(f"--modes {','.join(bad)}: not a mode; use any of {','.join(MODES)}")
    flags = argv + placement_flags(argv)
    print(f"tidal bench async: {', '.join(modes)} with {' '.join(flags) or 'the default flags'}", flush=True)
    results = []
    for mode in modes:
        t0 = time.perf_counter()
        rows = run_mode(mode, flags)
        results.append(summarize(mode, rows))
        print(f"{mode}: {len(rows)} steps in {time.perf_counter() - t0:.1f} s (start-up included)", flush=True)
    print(table(results))
    base = next((r for r in results if r["mode"] == "sync"), None)
    one = next((r for r in results if r["mode"] == "one-step"), None)
    summary = {"results": results, "goal": f"one-step >= {GOAL_SPEEDUP}x sync samples/s at equal reward per sample"}
    if base and one and base["samples_per_s"]:
        summary["one_step_speedup"] = one["samples_per_s"] / base["samples_per_s"]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
