"""The decode step's sampler alone: each way of computing it, next to the memory-bandwidth floor.

Run: ``python -m tidal.bench.sampling`` (CUDA: 512 rows x the Qwen2.5 vocabulary, 151,936 words, bf16
logits). Per variant one JSON line: ``ms`` per call (CUDA events over ``--iters`` calls after warm-up,
noise drawing included, as in a decode step), ``floor_ms`` (the bytes the variant must move at the
device-to-device copy bandwidth measured in the same run: logits read, fp32 noise written and read),
``tokens_equal`` (same draws as the eager reference for the same noise) and ``logprob_max_abs_diff``.

Variants: ``eager`` (``sample`` without a fused core: fused log-softmax, then the Gumbel argmax),
``plain`` (``plain_core`` uncompiled), ``compiled`` (``torch.compile(plain_core, dynamic=True)``, the
decode step's fused sampler), ``compiled-static`` (the same with ``dynamic=False``, which would
compile once per batch bucket), ``compiled-drawn`` (``drawn_core`` compiled: the noise drawn
inside the kernel, so the floor is the logits read alone) and ``blocks`` / ``compiled-blocks``
(``blocked_core`` through ``sample``: a block of words, then a word of it, with ``rows x (V/B + B)`` noise
drawn per call; its floor too is the logits read once). The variants that draw their own noise make other
draws than the reference's: ``tokens_equal`` is null for them (the unit tests compare distributions).

Measured on an H100 (512 x 151,936): compiled 0.454 ms (floor 0.258), compiled-drawn 0.534 ms,
compiled-blocks 0.138 ms (floor 0.052). On an H200: eager 1.13 ms, compiled 0.44 ms, compiled-static 0.37 ms, floor
0.18 ms; a variant that split each row's reductions into 64 pieces (more programs per row) was slower,
0.87 ms, and was dropped.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from tidal import roofline
from tidal.rollout.fast.sampling import blocked_core, drawn_core, plain_core, sample, sampling_mode


def _timed(fn, iters: int, device: torch.device) -> float:
    """Milliseconds per call of ``fn()``: CUDA events on a GPU, wall clock elsewhere."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters
    import time

    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1000 / iters


# Variants that read a [rows, vocab] fp32 noise buffer besides the logits (the others read the logits alone).
_BUFFERED = ("eager", "plain", "compiled", "compiled-static")


def variants(vocab: int, device: torch.device, names: list[str]) -> dict:
    """The sampler callables ``(logits, noise) -> (tokens, logprobs)`` to compare."""
    temp = torch.ones(1, device=device)
    mode = sampling_mode(1.0, 1.0, 0, vocab)
    table = {
        "eager": lambda: lambda lg, nz: sample(lg, mode, temp, temp),
        "plain": lambda: functools.partial(_core, plain_core, temp),
        "compiled": lambda: functools.partial(_core, torch.compile(plain_core, dynamic=True), temp),
        "compiled-static": lambda: functools.partial(_core, torch.compile(plain_core, dynamic=False), temp),
        # noise drawn inside the compiled kernel: no fp32 [rows, vocab] noise written and read
        "compiled-drawn": lambda: functools.partial(_drawn, torch.compile(drawn_core, dynamic=True), temp),
        # two stages, a block then a word of it: rows x (V/B + B) noise drawn, the logits read about once
        "blocks": lambda: functools.partial(_blocked, blocked_core, temp),
        "compiled-blocks": lambda: functools.partial(_blocked, torch.compile(blocked_core, dynamic=True), temp),
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}: choose from {', '.join(table)}")
    return {n: table[n]() for n in names}


def _core(core, temp: torch.Tensor, logits: torch.Tensor, noise: torch.Tensor):
    fresh = torch.empty_like(noise).exponential_()  # drawn every step, as the decode step does
    del fresh
    return core(logits, noise, temp, False, False)


def _drawn(core, temp: torch.Tensor, logits: torch.Tensor, noise: torch.Tensor):
    return core(logits, temp, False)


def _blocked(core, temp: torch.Tensor, logits: torch.Tensor, noise: torch.Tensor):
    return sample(logits, sampling_mode(1.0, 1.0, 0, logits.shape[1]), temp, temp, blocked=core)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the copy that measures the bandwidth floor")
    ap.add_argument(
        "--variants",
        default=None,
        help="comma-separated (default: all on CUDA; eager,plain elsewhere, where compiling is slow)",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    names = (
        args.variants
        or (
            "eager,plain,compiled,compiled-static,compiled-drawn,compiled-blocks"
            if device.type == "cuda"
            else "eager,plain,blocks"
        )
    ).split(",")
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, device=device, generator=gen).mul_(3).to(torch.bfloat16)
    noise = torch.empty(args.rows, args.vocab, device=device).exponential_(generator=gen)
    gbps = roofline.copy_gbps(device, args.copy_mib << 20)
    logit_bytes = logits.numel() * logits.element_size()
    moved = logit_bytes + 2 * noise.numel() * 4
    ref_tokens, ref_lp = plain_core(logits, noise, torch.ones(1, device=device), False, False)
    for name, fn in variants(args.vocab, device, names).items():
        if name in ("eager", "compiled-drawn", "blocks", "compiled-blocks"):
            tokens, lp = ref_tokens, ref_lp  # they draw their own noise: compared by distribution in the tests
            equal, diff = None, None
        else:
            tokens, lp = fn(logits, noise)
            equal, diff = bool(torch.equal(tokens, ref_tokens)), float((lp - ref_lp).abs().max())
        ms = _timed(lambda fn=fn: fn(logits, noise), args.iters, device)
        row = dict(
            variant=name,
            rows=args.rows,
            vocab=args.vocab,
            ms=_sig(ms),
            floor_ms=_sig((moved if name in _BUFFERED else logit_bytes) / (gbps * 1e9) * 1000),
            copy_gbps=round(gbps, 1),
            tokens_equal=equal,
            logprob_max_abs_diff=diff,
        )
        print(json.dumps(row), flush=True)


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits: a small case's sub-microsecond floor stays above 0."""
    return float(f"{x:.{digits}g}")


if __name__ == "__main__":
    main()
