"""Throughput of ``tidal serve`` under N concurrent ``/generate`` requests, next to the in-process engine on the same batch.

Run: ``tidal bench serve`` (CPU default: tiny preset, 64 requests x 16 prompt x 16 new tokens), or
on a GPU ``tidal bench serve --shape qwen2.5-0.5b-shape --requests 512 --prompt-len 64
--new-tokens 256``. In one run, on the same prompts and sampling parameters:

1. ``inproc``: an ``EmbeddedEngine`` in this process generates the N prompts as one batch (the
   limit: no HTTP, no JSON, no queue).
2. ``http``: ``tidal serve`` with the same model flags in a subprocess on 127.0.0.1; N concurrent
   ``/generate`` requests (one prompt each, ``input_ids``, ``return_logprob``) sent at once from
   ``--client-procs`` processes (``tidal.bench.serve_client``: one keep-alive connection a
   request), timed from the first send to the last reply read and parsed.

Both engines stay alive (each at ``--rollout-mem-fraction`` 0.3) and are timed in turns, one
warm-up each (compilation, CUDA graphs) and then ``--repeats`` rounds of both, in-process first in
even rounds and HTTP first in odd ones, so that a change of load on a shared machine, or a device
slower after an idle gap, hits both alike; the fastest of each counts.
Prints one JSON line: ``inproc_tokens_per_s``, ``http_tokens_per_s``, ``http_overhead`` (the
relative loss of throughput, ``1 - http/inproc``) next to ``goal_overhead`` (0.10), and the engine
steps the server used for the fastest burst (``http_engine_steps``: 1 when every request shared a
step; ``http_step_rows``: rows of each), and of the fastest burst's ``http_burst_seconds`` the
part the server's engine spent generating (``http_engine_seconds``) and the whole split by stage
(``http_split_seconds``, see ``split``; from the server's ``/request_timings``, on the host's
monotonic clock), with the server's mean seconds per request to parse and to render
(``http_per_request_ms``), and the CPU seconds of the engine's thread during its generate in
both (``inproc_engine_cpu_seconds``, ``http_engine_cpu_seconds``) with the server's event loop's
CPU seconds meanwhile (``http_loop_cpu_seconds_during_step``: work of the loop that competes with
the decode loop for the GIL) and the seconds in the garbage collector during the generate in both
(``inproc_gc_seconds``, ``http_gc_seconds_during_step``; the server runs its steps with the collector
off), and the fast decoder's own figures in both (``inproc_decoder``, ``http_decoder``: prefill and
decode-loop seconds, decode steps, CUDA graph captures; the rest of a step is the engine's work
around the decoder), and the in-process engine's tokens/s when called from a thread that is not the
main one, as the server's engine thread is (``inproc_thread_tokens_per_s``, and the overhead against
it, ``http_overhead_vs_thread``: on a busy CPU host torch's intra-op threads slow the main thread's
call, not a worker thread's). Then the same split as lines, next to the in-process seconds.
Response tokens are counted after cutting at EOS, as the engine returns them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

GOAL_OVERHEAD = 0.10
# Both engines live on the device at once (see ``measure``): each may use this much of it at its peak.
MEM_FRACTION = 0.3


def _prompts(tokenizer, vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    specials = set(tokenizer.all_special_ids)
    pool = torch.tensor([i for i in range(vocab) if i not in specials])
    return [pool[torch.randint(len(pool), (length,), generator=gen)].tolist() for _ in range(n)]


def _engine(args, device: str):
    from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig
    from tidal.rollout.embedded import EmbeddedEngine

    rollout = RolloutConfig(
        rollout_max_batch=args.requests,
        rollout_compile=None if device.startswith("cuda") else False,
        rollout_mem_fraction=MEM_FRACTION,
    )
    return EmbeddedEngine(ModelConfig(model=args.shape), rollout, MemoryConfig(), device=device)


def _inproc_once(engine, prompts, args) -> tuple[float, float, float, dict]:
    """Tokens/s of one in-process generate of every prompt as one batch, the CPU seconds its thread spent,
    the seconds spent in the garbage collector meanwhile, and the fast decoder's figures of the call."""
    from tidal.rollout.types import Sample, SamplingParams

    sp = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens, seed=args.seed)
    batch = [Sample(index=i, group=i, prompt=None, prompt_ids=list(p)) for i, p in enumerate(prompts)]
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    from tidal.serve.clocks import GcClock, decode_figures

    GcClock.start()
    t0, c0, gc0 = time.perf_counter(), time.thread_time(), GcClock.seconds
    out = engine.generate(batch, sp)
    seconds = time.perf_counter() - t0
    rate = sum(len(s.response_ids) for s in out) / seconds
    return rate, time.thread_time() - c0, GcClock.seconds - gc0, decode_figures(engine)


def _on_a_thread(engine, prompts, args) -> float:
    """Tokens/s of ``_inproc_once`` run in a new thread."""
    import threading

    got: list = []
    worker = threading.Thread(target=lambda: got.append(_inproc_once(engine, prompts, args)))
    worker.start()
    worker.join()
    return got[0][0]


def _start_server(args, device: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tidal", "serve", "--model", args.shape, "--device", device.split(":")[0]]
    cmd += ["--port", "0", "--rollout-max-batch", str(args.requests), "--no-check-memory-plan"]
    cmd += ["--rollout-mem-fraction", str(MEM_FRACTION)]
    if device == "cpu":
        cmd += ["--no-rollout-compile"]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"tidal serve did not start: {line!r}")
    return proc, line.split()[-1]


class _Clients:
    """``procs`` client processes (``tidal.bench.serve_client``), each holding its share of the requests."""

    def __init__(self, url: str, prompts, args, api_key: str | None = None) -> None:
        sp = {"max_new_tokens": args.new_tokens, "temperature": args.temperature, "sampling_seed": args.seed}
        bodies = [
            {"input_ids": p, "sampling_params": sp, "return_logprob": True, "rid": f"bench-{i}"}
            for i, p in enumerate(prompts)
        ]
        procs = max(1, min(args.client_procs, len(bodies)))
        self.shares = [bodies[i::procs] for i in range(procs)]
        self.procs = []
        for share in self.shares:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tidal.bench.serve_client", url],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            proc.stdin.write(json.dumps({"bodies": share, "api_key": api_key}) + "\n")
            proc.stdin.flush()
            self.procs.append(proc)

    def burst(self) -> tuple[float, dict]:
        """Every request sent at once: (the start, ``time.monotonic()``; the merged replies)."""
        t0 = time.monotonic()
        for proc in self.procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        merged = {"sent": [], "done": [], "tokens": 0, "steps": set(), "errors": []}
        for proc in self.procs:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("a bench client process ended without an answer")
            out = json.loads(line)
            for k in ("sent", "done", "errors"):
                merged[k] += out[k]
            merged["tokens"] += out["tokens"]
            merged["steps"] |= set(out["steps"])
        if merged["errors"]:
            raise RuntimeError(f"/generate failed: {merged['errors'][0]}")
        return t0, merged

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.stdin.write("quit\n")
                proc.stdin.close()
            except OSError:
                pass
            proc.wait(timeout=30)


# The phases of a burst, in the order a request passes them; ``split`` gives each its share of the wall time.
PHASES = ("client_send", "server_parse", "queue_wait", "engine_step", "render", "client_receive")


def split(t0: float, timings: list[dict], done: list[float]) -> dict[str, float]:
    """The burst's wall time cut at the moment the last request passed each stage (monotone, so the
    parts add up to the whole): ``client_send`` until the last request reached the server's handler
    (client work, connections, HTTP parsing), ``server_parse`` until the last was validated and
    queued, ``queue_wait`` until the first engine step began (the burst window), ``engine_step``
    until the last step ended, ``render`` until the last reply was rendered, ``client_receive`` until
    the client had read and parsed the last reply."""
    marks = [
        max(t["arrived"] for t in timings),
        max(t["queued"] for t in timings),
        min(t["started"] for t in timings),
        max(t["ended"] for t in timings),
        max(t["rendered"] for t in timings),
        max(done),
    ]
    out, last = {}, t0
    for name, mark in zip(PHASES, marks):
        mark = max(mark, last)
        out[name] = mark - last
        last = mark
    return out


def _http_once(url: str, clients: _Clients) -> dict:
    """One burst: tokens/s, the rows of each engine step that served it, its seconds, the seconds the
    engine spent generating in those steps, and the split of the burst (``split``)."""
    import httpx

    t0, out = clients.burst()
    wall = max(out["done"]) - t0
    for _ in range(200):  # a request is answered as its rows end: its step is recorded when the step ends
        info = httpx.get(url + "/server_info").json()["internal_states"][0]["recent_steps"]
        steps = [s for s in info if s["step"] in out["steps"]]
        if len(steps) == len(out["steps"]):
            break
        time.sleep(0.01)
    rids = {f"bench-{i}" for i in range(len(out["done"]))}
    timings = [t for t in httpx.get(url + "/request_timings").json()["requests"] if t["rid"] in rids]
    timings = {t["rid"]: t for t in timings}.values()  # the latest burst's (rids repeat between bursts)
    per_request = {
        "server_parse_ms": 1000 * sum(t["queued"] - t["arrived"] for t in timings) / len(timings),
        "render_ms": 1000 * sum(t["rendered"] - t["resumed"] for t in timings) / len(timings),
    }
    loop_cpu = [s["loop_cpu_seconds"] for s in steps]
    return {
        "rate": out["tokens"] / wall,
        "rows": [s["rows"] for s in steps],
        "wall": wall,
        "step_s": sum(s["seconds"] for s in steps),
        "step_cpu_s": sum(s["engine_cpu_seconds"] for s in steps),
        "loop_cpu_s": None if None in loop_cpu else sum(loop_cpu),
        "gc_s": sum(s["gc_seconds"] for s in steps),
        "gc_passes": [sum(s["gc_passes"][g] for s in steps) for g in range(3)],
        "decoder": steps[-1]["decoder"] if steps else {},
        "split": split(t0, list(timings), out["done"]),
        "per_request": per_request,
    }


def _wait_healthy(url: str) -> None:
    import httpx

    for _ in range(1500):
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"tidal serve at {url} never answered /health")


def measure(args, device: str) -> dict:
    """Both sides alive at once, timed in turns (each round both, alternating which goes first), so that a
    change of machine load hits both alike; one warm-up each first."""
    proc, url = _start_server(args, device)
    clients = None
    try:
        engine = _engine(args, "cuda:0" if device == "cuda" else "cpu")
        vocab = min(len(engine.tokenizer), engine.model.config.get_text_config().vocab_size)
        prompts = _prompts(engine.tokenizer, vocab, args.requests, args.prompt_len, args.seed)
        _wait_healthy(url)
        clients = _Clients(url, prompts, args)
        _inproc_once(engine, prompts, args)
        _http_once(url, clients)
        inproc, best = (0.0, 0.0, 0.0, {}), None
        for r in range(args.repeats):
            # Alternating which side goes first: a device that is slower right after a pause (clocks, caches)
            # or right after the other side's burst would otherwise always hurt the same side.
            for side in ("inproc", "http") if r % 2 == 0 else ("http", "inproc"):
                if side == "inproc":
                    inproc = max(inproc, _inproc_once(engine, prompts, args), key=lambda x: x[0])
                    continue
                got = _http_once(url, clients)
                if best is None or got["rate"] > best["rate"]:
                    best = got
        # The same in-process generate from a thread that is not the main one (as the server's engine thread
        # is), once per repeat: whether running the engine off the main thread alone costs anything.
        threaded = max(_on_a_thread(engine, prompts, args) for _ in range(args.repeats))
        return {
            "inproc": inproc[0],
            "inproc_cpu_s": inproc[1],
            "inproc_gc_s": inproc[2],
            "inproc_decoder": inproc[3],
            "inproc_thread": threaded,
            "http": best["rate"],
            **best,
        }
    finally:
        if clients is not None:
            clients.close()
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tidal bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny", help="model preset or folder (--model of tidal serve)")
    p.add_argument("--requests", type=int, default=64, help="concurrent /generate requests, one prompt each")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--repeats", type=int, default=2, help="timed runs of each side after one warm-up; the fastest counts"
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) // 4)),
        help="client processes sharing the requests (default: a quarter of the cores, at most 8)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads of both sides (default: torch's; 1 keeps CPU figures steady on a busy host)",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    m = measure(args, device)
    inproc, http, step_rows = m["inproc"], m["http"], m["rows"]
    row = {
        "shape": args.shape,
        "device": device,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "client_procs": max(1, min(args.client_procs, args.requests)),
        "inproc_tokens_per_s": round(inproc, 1),
        "inproc_thread_tokens_per_s": round(m["inproc_thread"], 1),
        "http_tokens_per_s": round(http, 1),
        "http_overhead": round(1 - http / inproc, 4),
        # Against the in-process engine called from a non-main thread, as the server's engine thread calls it
        # (on a busy CPU host torch's intra-op threads make the main thread's call the slower one).
        "http_overhead_vs_thread": round(1 - http / m["inproc_thread"], 4),
        "goal_overhead": GOAL_OVERHEAD,
        "http_engine_steps": len(step_rows),
        "http_step_rows": step_rows,
        "http_burst_seconds": round(m["wall"], 3),
        "http_engine_seconds": round(m["step_s"], 3),
        # CPU seconds of the engine's thread during its generate, in-process and in the server, and of the
        # server's event loop meanwhile (a busy loop holds the GIL the decode loop needs between launches).
        "inproc_engine_cpu_seconds": round(m["inproc_cpu_s"], 3),
        "http_engine_cpu_seconds": round(m["step_cpu_s"], 3),
        "http_loop_cpu_seconds_during_step": None if m["loop_cpu_s"] is None else round(m["loop_cpu_s"], 3),
        "inproc_gc_seconds": round(m["inproc_gc_s"], 4),
        "http_gc_seconds_during_step": round(m["gc_s"], 4),
        "http_gc_passes_during_step": m["gc_passes"],
        # The fast decoder's own seconds (prefill, decode loop), steps and graph captures in the timed call of each.
        "inproc_decoder": _rounded(m["inproc_decoder"]),
        "http_decoder": _rounded(m["decoder"]),
        "http_split_seconds": {k: round(v, 3) for k, v in m["split"].items()},
        "http_per_request_ms": {k: round(v, 3) for k, v in m["per_request"].items()},
    }
    print(json.dumps(row), flush=True)
    print(_table(row), flush=True)
    return 0


def _rounded(figures: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}


def _table(row: dict) -> str:
    """The burst's split as lines, next to the limit: the in-process engine's seconds for the same batch."""
    tokens = row["http_tokens_per_s"] * row["http_burst_seconds"]
    limit = tokens / row["inproc_tokens_per_s"]
    lines = [
        f"{row['requests']} requests: in-process {limit:.3f} s ({row['inproc_tokens_per_s']:.0f} tok/s, the limit), "
        f"HTTP {row['http_burst_seconds']:.3f} s ({row['http_tokens_per_s']:.0f} tok/s): "
        f"overhead {100 * row['http_overhead']:.1f} % (goal <= {100 * GOAL_OVERHEAD:.0f} %)"
    ]
    for name, sec in row["http_split_seconds"].items():
        lines.append(f"  {name:<15} {sec:8.3f} s  {100 * sec / row['http_burst_seconds']:5.1f} %")
    loop = row["http_loop_cpu_seconds_during_step"]
    lines.append(
        f"  engine step: {row['http_engine_seconds']:.3f} s, its thread's CPU {row['http_engine_cpu_seconds']:.3f} s "
        f"(in-process {limit:.3f} s, CPU {row['inproc_engine_cpu_seconds']:.3f} s); "
        f"event loop CPU meanwhile {'unknown' if loop is None else f'{loop:.3f} s'}; garbage collector "
        f"{row['http_gc_seconds_during_step']:.4f} s (in-process {row['inproc_gc_seconds']:.4f} s)"
    )
    lines.append(f"  fast decoder: in-process {row['inproc_decoder']}, HTTP {row['http_decoder']}")
    lines.append(
        f"  in-process from a thread that is not the main one: {row['inproc_thread_tokens_per_s']:.0f} tok/s "
        f"(from the main thread {row['inproc_tokens_per_s']:.0f}): HTTP overhead against it "
        f"{100 * row['http_overhead_vs_thread']:.1f} %"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
