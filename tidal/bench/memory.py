"""Benchmark: pause/resume of a trainer-like and an engine-like state, per host-memory policy.

    python -m tidal.bench.memory                      # CPU: portable backend, 1 GiB trainer state
    python -m tidal.bench.memory --gib 16 --cycles 5  # H200: tms backend, 16 GiB trainer state
    python -m tidal.bench.memory --cycles 100 --policies retain   # flat host and device memory

The trainer-like state is fp32 weights, their gradients and AdamW state (exp_avg, exp_avg_sq,
after one real ``AdamW.step``): 16 bytes per parameter, ``--gib`` in total, of which weights and
optimizer (12 bytes per parameter) are backed up and grads discarded (``--offload-train``). The
engine-like state is weights and a KV cache, both discarded. Every cycle runs the colocated order:
release the engine, pause the trainer (measure everything paused), resume the trainer, check its
contents, change the weights a little (a "train step"), resume the engine.

Each policy runs in a fresh process, so its RSS baseline is clean; one JSON line per policy:

    pause_s / resume_s           per cycle, trainer only
    pause_gbps / resume_gbps     backed-up bytes / seconds, per cycle
    pause_gbps_by_class /        the same per backed-up state class (weights, optimizer), per cycle
    resume_gbps_by_class
    pinned_copy_gbps             the limit, measured in the same process: pinned D2H and H2D copies
                                 on CUDA (the mean of both), a large memcpy on CPU
    host_rss_growth_paused_bytes process RSS while everything is paused minus RSS before the state
                                 was built (the max over cycles); goal <= 1.05 x host_backup_bytes
                                 (= backup_bytes, except under disk: the weights only)
    device_used_paused_bytes     device memory in use while paused minus before the state was
                                 built (CUDA, driver's view); bytes still allocated to the
                                 registered storages (CPU); goal <= 2% of the paused bytes
    contents_intact              every backed-up tensor's 64-bit position-weighted checksum of its
                                 raw bytes equal after every resume (any single changed word is
                                 always detected)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from tidal.config.schema import MemoryConfig
from tidal.memory import StateClass, make_backend
from tidal.memory.preload import actor_env, resolve_backend
from tidal.memory.telemetry import device_used_bytes, host_rss_bytes, trim_host_heap

S = StateClass
TRAINER = [S.GRADS, S.OPTIMIZER, S.WEIGHTS, S.ACTIVATIONS]
ENGINE = [S.KV_CACHE, S.WEIGHTS]
CHUNK = 64 * 1024**2  # bytes per benchmark tensor


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_copy_gbps(device: torch.device, nbytes: int) -> dict[str, float]:
    """The copy limit of pause/resume on this machine, measured now."""
    nbytes = max(64 * 1024**2, min(nbytes, 2 * 1024**3))
    best = {}
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
            times = []
            for _ in range(4):
                _sync(device)
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                _sync(device)
                times.append(time.perf_counter() - t0)
            best[name] = nbytes / min(times[1:]) / 1e9
        del host, dev, dst, src  # the loop's names hold the buffers too: without them the 2 GiB stay cached
        torch.cuda.empty_cache()
        out = {"pinned_d2h_gbps": best["d2h"], "pinned_h2d_gbps": best["h2d"]}
        out["pinned_copy_gbps"] = (best["d2h"] + best["h2d"]) / 2
        return out
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    del a, b
    trim_host_heap()
    return {"pinned_copy_gbps": nbytes / min(times[1:]) / 1e9}


def fingerprint(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Per tensor, computed on its device: the sum of its raw 64-bit words times odd position weights
    (mod 2**64; a single changed word changes it by an odd multiple of a nonzero difference, never 0),
    and the plain sum of the words."""
    out = []
    for t in tensors:
        words = t.detach().reshape(-1).view(torch.int64)
        w = torch.arange(words.numel(), device=t.device, dtype=torch.int64).mul_(2).add_(1)
        out.append((int(words.mul(w).sum()), int(words.sum())))
    return out


def _tensor_sizes(total_bytes: int, elem: int) -> list[int]:
    """Element counts of CHUNK-sized tensors (the last one smaller) adding up to ``total_bytes``."""
    n = max(total_bytes // elem, 2)
    per = CHUNK // elem
    sizes = [per] * (n // per)
    if n % per:
        sizes.append(n % per)
    return [s + (s % 2) for s in sizes]  # even: every tensor is whole int64 words


def _warm_up(device: torch.device) -> None:
    """Run the code paths once on a few bytes, so lazy imports and allocator pools are not counted as state."""
    p = torch.nn.Parameter(torch.ones(64, device=device))
    p.grad = torch.ones(64, device=device)
    torch.optim.AdamW([p], foreach=False).step()
    fingerprint([p])
    with torch.no_grad():
        p.add_(1.0)


def _trainer_state(trainer, device: torch.device, sizes: list[int]):
    """Trainer-like state: 16 bytes per parameter (weights, grads, exp_avg, exp_avg_sq), all fp32, registered."""
    with trainer.region(S.WEIGHTS):
        params = [torch.nn.Parameter(torch.randn(n, device=device) * 0.02) for n in sizes]
    with trainer.region(S.GRADS):
        for p in params:
            p.grad = torch.randn(p.numel(), device=device) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    with trainer.region(S.OPTIMIZER):
        opt.step()  # creates exp_avg / exp_avg_sq (and step) inside the optimizer's region

    def opt_state() -> list[torch.Tensor]:
        return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]

    trainer.register(S.WEIGHTS, lambda: params)
    trainer.register(S.OPTIMIZER, opt_state)
    trainer.register(S.GRADS, lambda: [p.grad for p in params])
    return params, opt_state


def _engine_state(engine, device: torch.device, sizes: list[int]) -> list[torch.Tensor]:
    """Engine-like state: weights and KV cache, as large as the trainer's weights each; discarded."""
    with engine.region(S.WEIGHTS):
        e_weights = [torch.empty(n, device=device).fill_(1.0) for n in sizes]
    with engine.region(S.KV_CACHE):
        kv = [torch.empty(n, device=device).fill_(0.0) for n in sizes]
    engine.register(S.WEIGHTS, lambda: e_weights)
    engine.register(S.KV_CACHE, lambda: kv)
    return [*e_weights, *kv]


def _cycles(trainer, engine, device, params, backed, cycles: int, rss0: int, dev0: int):
    """``cycles`` rounds of engine release, trainer pause, resume, engine resume: timings, memory while
    paused and whether the backed-up contents came back intact (a small update between rounds)."""
    with trainer.unmanaged():
        marks = fingerprint(backed)
    rec: dict[str, list] = {k: [] for k in ("pause_s", "resume_s", "engine_release_s", "engine_resume_s")}
    by_class: dict[str, dict[str, list[float]]] = {"pause_gbps_by_class": {}, "resume_gbps_by_class": {}}
    rss_growth, dev_left, intact = [], [], True
    for _ in range(cycles):
        rec["engine_release_s"].append(engine.pause(ENGINE).seconds)
        paused = trainer.pause(TRAINER)
        rec["pause_s"].append(paused.seconds)
        _per_class(by_class["pause_gbps_by_class"], paused)
        gc.collect()
        rss_growth.append(host_rss_bytes() - rss0)
        if device.type == "cuda":
            dev_left.append(device_used_bytes(device) - dev0)
        else:
            dev_left.append(trainer.resident_bytes() + engine.resident_bytes())
        resumed = trainer.resume(TRAINER)
        rec["resume_s"].append(resumed.seconds)
        _per_class(by_class["resume_gbps_by_class"], resumed)
        with trainer.unmanaged():
            intact = intact and fingerprint(backed) == marks
            with torch.no_grad():  # a "train step": the next pause backs up new bytes
                for p in params:
                    p.add_(1e-3)
            marks = fingerprint(backed)
        rec["engine_resume_s"].append(engine.resume(list(reversed(ENGINE))).seconds)
    return {**rec, **by_class}, rss_growth, dev_left, intact


def _per_class(out: dict[str, list[float]], report) -> None:
    """Each backed-up class's GB/s in one pause or resume (under retain with torch_memory_saver the optimizer
    state is tidal's own backup and the weights torch_memory_saver's: side by side here)."""
    for c in report.classes:
        if c.backup_bytes:
            out.setdefault(c.state_class, []).append(c.gbps)


def run_policy(args: argparse.Namespace, policy: str) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gib = 1024**3
    total = int(args.gib * gib)
    limits = pinned_copy_gbps(device, total * 12 // 16)
    cfg = MemoryConfig(
        memory_backend=args.backend,
        tms_hook_mode=args.hook_mode,
        offload_host_memory=policy,
        offload_disk_dir=args.disk_dir,
    )
    # Backends first: loading their libraries is not state, so it stays out of the baseline.
    trainer = make_backend(cfg, device=str(device), role="trainer", offload_train=True)
    engine = make_backend(cfg, device=str(device), role="engine")
    _warm_up(device)
    gc.collect()
    trim_host_heap()
    rss0 = host_rss_bytes()
    dev0 = device_used_bytes(device) if device.type == "cuda" else 0

    sizes = _tensor_sizes(total // 4, 4)
    params, opt_state = _trainer_state(trainer, device, sizes)
    engine_tensors = _engine_state(engine, device, sizes)
    _sync(device)

    backed = [*params, *[t for t in opt_state() if t.numel() > 1]]
    weight_bytes = sum(t.untyped_storage().nbytes() for t in params)
    backup_bytes = weight_bytes + sum(t.untyped_storage().nbytes() for t in opt_state())
    # Under the disk policy only the weights stay on the host; optimizer state goes to files.
    host_backup_bytes = weight_bytes if policy == "disk" else backup_bytes
    grad_bytes = sum(p.grad.untyped_storage().nbytes() for p in params)
    engine_bytes = sum(t.untyped_storage().nbytes() for t in engine_tensors)

    rec, rss_growth, dev_left, intact = _cycles(trainer, engine, device, params, backed, args.cycles, rss0, dev0)
    trainer.close()
    engine.close()

    pause_gbps = [backup_bytes / s / 1e9 for s in rec["pause_s"]]
    resume_gbps = [backup_bytes / s / 1e9 for s in rec["resume_s"]]
    steady = slice(1, None) if args.cycles > 1 else slice(0, None)
    limit = limits["pinned_copy_gbps"]
    paused_bytes = backup_bytes + grad_bytes + engine_bytes
    return {
        "backend": trainer.name,
        "policy": policy,
        "device": str(device),
        "hook_mode": args.hook_mode if trainer.name == "tms" else None,
        "cycles": args.cycles,
        "backup_bytes": backup_bytes,
        "host_backup_bytes": host_backup_bytes,
        "disk_backup_bytes": backup_bytes - host_backup_bytes,
        "discarded_bytes": grad_bytes + engine_bytes,
        **rec,
        "pause_gbps": pause_gbps,
        "resume_gbps": resume_gbps,
        **limits,
        "steady_pause_fraction_of_limit": statistics.median(pause_gbps[steady]) / limit,
        "steady_resume_fraction_of_limit": statistics.median(resume_gbps[steady]) / limit,
        "host_rss_growth_paused_bytes": max(rss_growth),
        "host_rss_growth_paused_ratio": max(rss_growth) / host_backup_bytes,  # goal <= 1.05
        "host_rss_growth_paused_spread_bytes": max(rss_growth) - min(rss_growth),  # flat across cycles
        "device_used_paused_bytes": max(dev_left),
        "device_used_paused_fraction": max(dev_left) / paused_bytes,  # goal <= 0.02
        "device_used_paused_spread_bytes": max(dev_left) - min(dev_left),
        "contents_intact": bool(intact),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tidal.bench.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the trainer-like state in GiB")
    ap.add_argument("--cycles", type=int, default=5, help="pause/resume cycles per policy")
    ap.add_argument("--policies", default="release,retain,disk", help="comma-separated host-memory policies")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto", choices=("auto", "tms", "portable"))
    ap.add_argument("--hook-mode", default="torch", choices=("torch", "preload"))
    ap.add_argument("--disk-dir", default=None, help="directory for the disk policy (default: a temp dir)")
    ap.add_argument("--one-policy", default=None, help=argparse.SUPPRESS)  # child process mode
    args = ap.parse_args(argv)

    if args.one_policy:
        print(json.dumps(run_policy(args, args.one_policy)), flush=True)
        return

    import tempfile

    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="tidal-bench-disk-")
    kind, _ = resolve_backend(args.backend, args.device)
    env = dict(os.environ)
    if kind == "tms" and args.hook_mode == "preload":
        env.update(actor_env(MemoryConfig(tms_hook_mode="preload", offload_train=True), {}, args.device))
    failed = False
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        cmd = [sys.executable, "-m", "tidal.bench.memory", "--one-policy", policy, "--disk-dir", disk_dir]
        cmd += ["--gib", str(args.gib), "--cycles", str(args.cycles), "--device", args.device]
        cmd += ["--backend", args.backend, "--hook-mode", args.hook_mode]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(json.dumps({"policy": policy, "error": f"exit code {proc.returncode}"}), flush=True)
            failed = True
            continue
        print(lines[-1], flush=True)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
