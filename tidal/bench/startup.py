"""Start-up and whole-run time of ``tidal train``, next to TRL's ``GRPOTrainer`` on the same job.

Run: ``python -m tidal.bench.startup`` (``--runs 3``; ``--with-trl`` also times
``python -m tidal.bench.trl_baseline``, the same tiny model and task in TRL, which needs the
``bench`` extra; ``-- FLAGS`` passes flags to ``tidal train``, e.g. ``-- --num-rollout 1``).

Each run is a fresh process timed from outside, as a user's shell would: ``first_step_s`` is the
wall time from the command's start to its first step line on the console (``step    0 |``: Ray
started, actors built, weights synced, one rollout generated and trained), ``total_s`` to its exit;
``startup_*`` and ``step0_*`` say where that time went (step 0's row of the run's metrics.jsonl:
seconds since the process started when Ray was up, the actors built and the first sync done, the
actors' build times, and step 0's phases, whose generate and train include compiling).
With ``--with-trl`` the two commands run in turn (tidal, TRL, tidal, ...) so that a machine whose
speed drifts slows both alike. Prints one JSON line per run, then the medians next to the limits
they are measured against: ``first_step_s`` <= 8 s on a 2-core CPU (on a GPU, the 0.5B preset: <= 20 s with
a warm compile cache; with ``--fresh-cache``, one new ``--compile-cache-dir`` for every run, the first run's
cold figure <= 45 s and the others' warm one <= 20 s), and tidal's ``total_s`` no more than TRL's.

Wall times mean little on a host others are using, so each run also says how much CPU its processes
used (``ProcessCPU``: the command's whole process tree, sampled every 0.1 s): ``cpu_first_step_s``
up to the first step line and ``cpu_total_s`` to the exit, and ``cpu_first_step_by_role`` (the
driver, the warm process that forks the workers, Ray's own processes, each actor). On 2 cores the
first step cannot come sooner than half its CPU seconds. ``load`` is the host's 1-minute load average
when the run ended.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

FIRST_STEP_LIMIT_S = 8.0  # a 2-core CPU, the embedded default
# One GPU, the 0.5B preset: the first step with the compile cache a run before it left (warm), and with none (cold).
GPU_WARM_LIMIT_S, GPU_COLD_LIMIT_S = 20.0, 45.0


def role(cmdline: list[str], root: bool) -> str:
    """What a process of a run is, from its command line (Ray names its workers ``ray::<Actor>``)."""
    if root:
        return "driver"
    head = cmdline[0] if cmdline else ""
    if head.startswith("ray::"):
        name = head[5:].split(".")[0].split(" ")[0]
        return "ray idle worker" if name == "IDLE" else name
    line = " ".join(cmdline)
    if "tidal.cluster.warm" in line:
        return "warm process"
    if "default_worker.py" in line and "raylet" not in head:
        return "ray worker starting"
    return "ray"  # gcs, raylet, its agents, the log monitor, the workers' handles


class ProcessCPU:
    """CPU seconds (user + system) of a process and all its descendants, sampled in a thread; a process
    that exits keeps its last sample."""

    def __init__(self, pid: int, interval: float = 0.1):
        import threading

        import psutil

        self._root = psutil.Process(pid)
        self._seen: dict[int, tuple[str, float]] = {}
        self._interval = interval
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="process-cpu")
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            self.sample()
            self._done.wait(self._interval)

    def sample(self) -> None:
        import psutil

        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            return
        for p in procs:
            try:
                t = p.cpu_times()
                label = role(p.cmdline(), p.pid == self._root.pid)
            except psutil.Error:
                continue
            with self._lock:
                self._seen[p.pid] = (label, t.user + t.system)

    def by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        with self._lock:
            for label, cpu in self._seen.values():
                out[label] = out.get(label, 0.0) + cpu
        return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def time_command(cmd: list[str], first_line: str | None = None) -> dict:
    """Run ``cmd``; seconds to the first output line starting with ``first_line`` and to its exit,
    and the CPU seconds of its processes by then."""
    t0 = time.perf_counter()
    first = None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    cpu = ProcessCPU(proc.pid)
    last, at_first = "", {}
    for line in proc.stdout:
        if first is None and first_line is not None and line.startswith(first_line):
            first = time.perf_counter() - t0
            cpu.sample()
            at_first = cpu.by_role()
        if line.strip():
            last = line.strip()
    rc = proc.wait()
    cpu.stop()
    row = {
        "rc": rc,
        "first_step_s": None if first is None else round(first, 2),
        "total_s": round(time.perf_counter() - t0, 2),
        "cpu_total_s": round(sum(cpu.by_role().values()), 2),
        "load": round(os.getloadavg()[0], 2),
        "last_line": last[-160:],
    }
    if at_first:
        row["cpu_first_step_s"] = round(sum(at_first.values()), 2)
        row["cpu_first_step_by_role"] = at_first
    return row


def step0_breakdown(run_dir: str) -> dict:
    """Where step 0's time went, from the run's metrics.jsonl: the ``startup_*`` marks (seconds since
    the process started: Ray up, actors built, first sync done; the actors' build times) and the
    step's own phases (the first generate and train include compiling and graph capture)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            row = json.loads(f.readline())
    except (OSError, ValueError):
        return {}
    keep = ("elapsed_s", "generate_s", "train_s", "sync_s", "release_s", "resume_s", "pause_s")
    out = {f"step0_{k}": row[k] for k in keep if k in row} | {k: v for k, v in row.items() if k.startswith("startup_")}
    return {"device": run_device(run_dir), **out}


def run_device(run_dir: str) -> str | None:
    """The device a run resolved to (its config.yaml's ``cluster.device``), or None without one."""
    import yaml

    try:
        with open(os.path.join(run_dir, "config.yaml")) as f:
            return (yaml.safe_load(f) or {}).get("cluster", {}).get("device")
    except (OSError, yaml.YAMLError, AttributeError):
        return None


def first_step_limits(rows: list[dict], *, fresh_cache: bool) -> dict:
    """The first step's limits for these runs, by the device they ran on (``device`` of each row): 8 s on a CPU;
    on a GPU 20 s with a warm compile cache and 45 s cold. With ``fresh_cache`` (one new cache for every run)
    the first run is the cold one and the median of the others the warm figure, each next to its limit."""
    if not any(r.get("device") == "cuda" for r in rows):
        return {"first_step_limit_s": FIRST_STEP_LIMIT_S}
    if not fresh_cache:
        return {"first_step_limit_s": GPU_WARM_LIMIT_S}
    cold = [r for r in rows if r["run"] == 0]
    return {
        "first_step_cold_s": _median(cold, "first_step_s"),
        "cold_limit_s": GPU_COLD_LIMIT_S,
        "first_step_warm_s": _median([r for r in rows if r["run"] > 0], "first_step_s"),
        "warm_limit_s": GPU_WARM_LIMIT_S,
    }


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None and r["rc"] == 0]
    return round(statistics.median(values), 2) if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tidal.bench.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--with-trl", action="store_true", help="also time the TRL run of the same job, in turn")
    p.add_argument(
        "--fresh-cache",
        action="store_true",
        help="every run on one new --compile-cache-dir: the first compiles cold, the others read what it left",
    )
    p.add_argument("train_flags", nargs="*", help="flags for tidal train (after --)")
    args = p.parse_args(argv)
    py = sys.executable
    tidal_rows, trl_rows = [], []
    with tempfile.TemporaryDirectory(prefix="tidal-startup-") as tmp:
        cache = ["--compile-cache-dir", os.path.join(tmp, "compile-cache")] if args.fresh_cache else []
        for i in range(args.runs):
            out = os.path.join(tmp, f"run{i}")
            cmd = [py, "-m", "tidal", "train", "--no-progress", "--output-dir", out, *args.train_flags, *cache]
            row = {"command": "tidal train", "run": i, **time_command(cmd, "step    0 |"), **step0_breakdown(out)}
            print(json.dumps(row), flush=True)
            tidal_rows.append(row)
            if args.with_trl:
                cmd = [py, "-m", "tidal.bench.trl_baseline", "--output-dir", os.path.join(tmp, f"trl{i}")]
                row = {"command": "trl GRPOTrainer", "run": i, **time_command(cmd)}
                print(json.dumps(row), flush=True)
                trl_rows.append(row)
    summary = {
        "cpus": os.cpu_count(),
        "runs": args.runs,
        "tidal_first_step_s": _median(tidal_rows, "first_step_s"),
        **first_step_limits(tidal_rows, fresh_cache=args.fresh_cache),
        "tidal_total_s": _median(tidal_rows, "total_s"),
        "tidal_cpu_first_step_s": _median(tidal_rows, "cpu_first_step_s"),
        "tidal_cpu_total_s": _median(tidal_rows, "cpu_total_s"),
        "load_max": max((r["load"] for r in tidal_rows + trl_rows), default=None),
    }
    if args.with_trl:
        summary["trl_total_s"] = _median(trl_rows, "total_s")
        summary["trl_cpu_total_s"] = _median(trl_rows, "cpu_total_s")
        if summary["tidal_total_s"] and summary["trl_total_s"]:
            summary["tidal_over_trl"] = round(summary["tidal_total_s"] / summary["trl_total_s"], 3)
    print(json.dumps(summary), flush=True)
    return 0 if all(r["rc"] == 0 for r in tidal_rows + trl_rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
