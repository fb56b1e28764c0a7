"""SDPA at sequence lengths it has not seen: each kernel's first call next to its steady call.

Run: ``python -m tidal.bench.attention`` (``tidal bench attention``). For each SDPA backend asked for, a warm-up
call, then per length in ``--lengths`` (each new to the process) the first forward and backward of a causal,
maskless call of ``[rows, heads, length, head_dim]`` (the trainer's call: ``tidal.trainer.step``) timed on the
host clock around a device sync, then the same shape ``--iters`` times more. One JSON line per backend:
``first_ms`` and ``steady_ms`` per length and ``setup_ms``, the mean of their differences: what a new shape
costs beyond the kernel's own time. Its limit is the steady call beside it (a kernel with no per-shape set-up
has a first call near its steady one); ``trainer_order`` names the order the trainer tries them in.

Why it exists: cuDNN's attention builds an execution graph for every new shape. On an H100 (16 rows, 14 heads
of 64, lengths 300-1200, bf16): cuDNN 120-135 ms a first call against 0.5-0.9 ms steady, flash 0.5-1.3 ms first
against 0.4-1.15 ms steady (docs/benchmarks.md, round seven). A trainer's micro-batch shape follows the
responses' lengths and a prefill's the prompts', so both run without cuDNN first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def _call(backend: SDPBackend, shape: tuple[int, ...], dtype, device, backward: bool, reps: int = 1) -> float:
    """Milliseconds a call (forward, and backward when asked) of ``backend`` at ``shape``, host clock."""
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=backward) for _ in range(3))
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            out.sum().backward()
    _sync(device)
    return (time.perf_counter() - t0) * 1000 / reps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, args, device: torch.device) -> dict:
    """One backend's line: first and steady milliseconds per new length, or why it cannot run here."""
    backend, dtype = BACKENDS[name], getattr(torch, args.dtype)
    shape = (args.rows, args.heads, 0, args.head_dim)
    row: dict = {"backend": name, "device": device.type, "rows": args.rows, "heads": args.heads}
    row.update(head_dim=args.head_dim, dtype=args.dtype, backward=args.backward, lengths=args.lengths)
    try:
        _call(backend, shape[:2] + (args.warm_length, args.head_dim), dtype, device, args.backward)
    except RuntimeError as exc:  # no kernel of this backend for these inputs on this device
        return {**row, "available": False, "reason": str(exc).splitlines()[0][:160]}
    firsts, steadies = [], []
    for length in args.lengths:
        at = shape[:2] + (length, args.head_dim)
        firsts.append(_call(backend, at, dtype, device, args.backward))
        steadies.append(_call(backend, at, dtype, device, args.backward, reps=args.iters))
    setup = sum(f - s for f, s in zip(firsts, steadies)) / len(firsts)
    return {
        **row,
        "available": True,
        "first_ms": [round(x, 3) for x in firsts],
        "steady_ms": [round(x, 3) for x in steadies],
        "setup_ms": round(setup, 3),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tidal bench attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lengths", default="300,400,500,600,700,800,900,1000,1100,1200", help="comma-separated")
    ap.add_argument("--warm-length", type=int, default=256, help="the warm-up call's length (not among --lengths)")
    ap.add_argument("--iters", type=int, default=5, help="steady calls per length")
    ap.add_argument("--backends", default="cudnn,flash,efficient,math", help=f"comma-separated of {list(BACKENDS)}")
    ap.add_argument("--no-backward", dest="backward", action="store_false", help="forward only (a prefill's call)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    names = [n for n in args.backends.split(",") if n]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        _bad(f"--backends {args.backends!r}: choose among {', '.join(BACKENDS)}")
    if not hasattr(torch, args.dtype) or not isinstance(getattr(torch, args.dtype), torch.dtype):
        _bad(f"--dtype {args.dtype!r} is not a torch dtype; give e.g. bfloat16, float16 or float32")
    if not args.lengths or args.warm_length in args.lengths:
        _bad(f"--lengths {args.lengths}: give one or more, none equal to --warm-length {args.warm_length}")
    from tidal.trainer.step import TRAIN_SDPA

    order = [n for b in TRAIN_SDPA for n, v in BACKENDS.items() if v == b]
    for name in names:
        print(json.dumps({**measure(name, args, device), "trainer_order": order}), flush=True)


def _bad(message: str) -> None:
    print(f"tidal bench attention: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
