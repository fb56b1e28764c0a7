"""Throughput of ``tidal serve`` under N concurrent ``/generate`` requests, next to the in-process engine on the same batch.

Run: ``tidal bench serve`` (CPU default: tiny preset, 64 requests x 16 prompt x 16 new tokens), or
on a GPU ``tidal bench serve --shape qwen2.5-0.5b-shape --requests 512 --prompt-len 64
--new-tokens 256``. In one run, on the same prompts and sampling parameters:

1. ``inproc``: an ``EmbeddedEngine`` in this process generates the N prompts as one batch (the
   limit: no HTTP, no JSON, no queue).
2. ``http``: ``tidal serve`` with the same model flags in a subprocess on 127.0.0.1; N concurrent
   ``/generate`` requests (one prompt each, ``input_ids``, ``return_logprob``) sent at once from
   an httpx ``AsyncClient``, timed from the first send to the last reply.

Both engines stay alive (each at ``--rollout-mem-fraction`` 0.3) and are timed in turns, one
warm-up each (compilation, CUDA graphs) and then ``--repeats`` rounds of in-process then HTTP, so
a change of load on a shared machine hits both alike; the fastest of each counts.
Prints one JSON line: ``inproc_tokens_per_s``, ``http_tokens_per_s``, ``http_overhead`` (the
relative loss of throughput, ``1 - http/inproc``) next to ``goal_overhead`` (0.10), and the engine
steps the server used for the fastest burst (``http_engine_steps``: 1 when every request shared a
step; ``http_step_rows``: rows of each), and of the fastest burst's ``http_burst_seconds`` the
part the server's engine spent generating (``http_engine_seconds``; the rest is HTTP, JSON, queueing).
Response tokens are counted after cutting at EOS, as the engine returns them.
"""

from __future__ import annotations

import argparse
import asyncio
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


def _inproc_once(engine, prompts, args) -> float:
    """Tokens/s of one in-process generate of every prompt as one batch."""
    from tidal.rollout.types import Sample, SamplingParams

    sp = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens, seed=args.seed)
    batch = [Sample(index=i, group=i, prompt=None, prompt_ids=list(p)) for i, p in enumerate(prompts)]
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(batch, sp)
    return sum(len(s.response_ids) for s in out) / (time.perf_counter() - t0)


def _start_server(args, device: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tidal", "serve", "--model", args.shape, "--device", device.split(":")[0]]
    cmd += ["--port", "0", "--rollout-max-batch", str(args.requests), "--no-check-memory-plan"]
    cmd += ["--rollout-mem-fraction", str(MEM_FRACTION)]
    if device == "cpu":
        cmd += ["--no-rollout-compile"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ})
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"tidal serve did not start: {line!r}")
    return proc, line.split()[-1]


async def _burst(url: str, prompts, args) -> tuple[int, float, set[int]]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        sp = {"max_new_tokens": args.new_tokens, "temperature": args.temperature, "sampling_seed": args.seed}
        body = [{"input_ids": p, "sampling_params": sp, "return_logprob": True} for p in prompts]
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(client.post("/generate", json=b) for b in body))
        dt = time.perf_counter() - t0
    outs = [r.json() for r in replies]
    bad = [r.text for r in replies if r.status_code != 200]
    if bad:
        raise RuntimeError(f"/generate failed: {bad[0]}")
    return sum(o["meta_info"]["completion_tokens"] for o in outs), dt, {o["meta_info"]["engine_step"] for o in outs}


def _http_once(url: str, prompts, args) -> tuple[float, list[int], float, float]:
    """Tokens/s of one burst, the rows of each engine step that served it, the burst's seconds and
    the seconds the engine spent generating in those steps."""
    import httpx

    tokens, dt, used = asyncio.run(_burst(url, prompts, args))
    recent = httpx.get(url + "/server_info").json()["internal_states"][0]["recent_steps"]
    steps = [s for s in recent if s["step"] in used]
    return tokens / dt, [s["rows"] for s in steps], dt, sum(s["seconds"] for s in steps)


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
    """Both sides alive at once, timed in turns (in-process, then HTTP, per repeat), so that a change
    of machine load hits both alike; one warm-up each first."""
    proc, url = _start_server(args, device)
    try:
        engine = _engine(args, "cuda:0" if device == "cuda" else "cpu")
        vocab = min(len(engine.tokenizer), engine.model.config.get_text_config().vocab_size)
        prompts = _prompts(engine.tokenizer, vocab, args.requests, args.prompt_len, args.seed)
        _wait_healthy(url)
        _inproc_once(engine, prompts, args)
        _http_once(url, prompts, args)
        inproc, http, rows, wall, step_s = 0.0, 0.0, [], 0.0, 0.0
        for _ in range(args.repeats):
            inproc = max(inproc, _inproc_once(engine, prompts, args))
            rate, used, dt, gen_s = _http_once(url, prompts, args)
            if rate > http:
                http, rows, wall, step_s = rate, used, dt, gen_s
        return {"inproc": inproc, "http": http, "rows": rows, "wall": wall, "step_s": step_s}
    finally:
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
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    m = measure(args, device)
    inproc, http, step_rows = m["inproc"], m["http"], m["rows"]
    row = {
        "shape": args.shape,
        "device": device,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "inproc_tokens_per_s": round(inproc, 1),
        "http_tokens_per_s": round(http, 1),
        "http_overhead": round(1 - http / inproc, 4),
        "goal_overhead": GOAL_OVERHEAD,
        "http_engine_steps": len(step_rows),
        "http_step_rows": step_rows,
        "http_burst_seconds": round(m["wall"], 3),
        "http_engine_seconds": round(m["step_s"], 3),
    }
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
