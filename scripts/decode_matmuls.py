"""The decode step's four matmul shapes of the 0.5B preset at M = 512 rows (bf16, CUDA): cuBLAS's one call (F.linear,
as the model calls it) against split-K (a batched matmul over 2, 3, 4 or 8 slices of K, summed in fp32), each timed
24 times in a CUDA graph; prints microseconds, TFLOP/s and the largest difference from an fp32 product.

Split-K would pay where one call leaves SMs idle (the down projection's N = 896 is 28 tiles of 128 x 128 for an H100's
132 SMs); on an H100 it did not (docs/benchmarks.md, round seventeen).

    python3 scripts/decode_matmuls.py
"""

import functools

import torch
import torch.nn.functional as F

REPS = 24  # calls captured in one graph, as the step's 24 layers call each shape
SHAPES = (("down", 512, 4864, 896), ("o_proj", 512, 896, 896), ("gate_up", 512, 896, 9728), ("qkv", 512, 896, 1152))


def graph_us(fn, iters: int = 50) -> float:
    """Microseconds a call of ``fn`` takes, REPS calls replayed from one CUDA graph ``iters`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / REPS * 1000


def split_k(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T with ``wt`` [S, K/S, N] (W^T in S slices of K): S partial products summed in fp32."""
    s, k_part, _ = wt.shape
    return torch.bmm(x.view(x.shape[0], s, k_part).transpose(0, 1), wt).sum(0, dtype=torch.float32)


def one_shape(m: int, k: int, n: int) -> dict[str, str]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    ref = x.float() @ w.float().t()
    calls = {"linear": functools.partial(F.linear, x, w)}
    for s in (2, 3, 4, 8):
        if k % s == 0:
            calls[f"splitk{s}"] = functools.partial(split_k, x, w.t().contiguous().view(s, k // s, n))
    out = {}
    for name, fn in calls.items():
        us = graph_us(fn)
        err = (fn().float() - ref).abs().max().item()
        out[name] = f"{us:.2f}us err {err:.4f} ({2 * m * k * n / us / 1e6:.0f} TF/s)"
    return out


def main() -> None:
    torch.manual_seed(0)
    for name, m, k, n in SHAPES:
        print(name, one_shape(m, k, n), flush=True)


if __name__ == "__main__":
    main()
