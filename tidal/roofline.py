"""The limits a speed benchmark prints beside its figure, measured in the same run: the device's matmul peak and
copy bandwidth, and the floor they put under a rollout's decoding and a rollout's training pass of a model.

A floor is a roofline. A decode step must read every weight, the keys and values its rows have written so far,
and write its logits (bytes, at the measured copy bandwidth), and it must do two FLOPs per matmul weight and
row plus its attention (FLOPs, at the measured matmul peak); it takes at least the larger of the two. The
prefill computes each distinct prompt once. A training pass does three times a forward's FLOPs (forward, and
a backward of twice as many), the LM head at the response positions only, causal attention at half the square.
Real kernels reach neither limit, so a figure's fraction of its floor says how far there is to go, not that
the floor can be reached; on a CPU, weights that fit the caches can even beat a bandwidth measured on a large
copy.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    """What the floors need to know of a causal LM."""

    body_params: int  # weights of every matmul of the decoder layers (nn.Linear), the LM head excluded
    head_params: int  # the LM head's weights (vocabulary x hidden)
    weight_bytes: int  # every parameter as stored (what a decode step reads)
    layers: int
    attn_dim: int  # query heads x head dim
    kv_bytes_per_token: int  # keys and values of one token, every layer
    vocab: int
    logit_bytes: int  # bytes of one logit as the model writes it

    @classmethod
    def of(cls, model: torch.nn.Module) -> Shape:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head = model.get_output_embeddings()
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        param = next(model.parameters())
        return cls(
            body_params=sum(m.weight.numel() for m in linears),
            head_params=head.weight.numel(),
            weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            layers=cfg.num_hidden_layers,
            attn_dim=heads * head_dim,
            kv_bytes_per_token=2 * cfg.num_hidden_layers * kv_heads * head_dim * param.element_size(),
            vocab=cfg.vocab_size,
            logit_bytes=param.element_size(),
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device: torch.device, iters: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int | None = None, iters: int = 5) -> float:
    """The best of ``iters`` square matmuls of side ``n`` (8192 on CUDA, 1024 elsewhere), in TFLOP/s."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b, device, iters) / 1e12


def copy_gbps(device: torch.device, nbytes: int | None = None, iters: int = 5) -> float:
    """The device's copy bandwidth: the best of ``iters`` copies of ``nbytes`` (1 GiB on CUDA, 256 MiB elsewhere)
    from one buffer to another, bytes read and written per second, in GB/s."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 28)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), device, iters) / 1e9


@functools.cache
def limits(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """``(matmul TFLOP/s in dtype, copy GB/s)`` of ``device``, measured once per process (a benchmark's cases
    share them)."""
    dev = torch.device(device)
    return matmul_tflops(dev, dtype), copy_gbps(dev)


def decode_floor(
    shape: Shape,
    prompt_len: int,
    response_lens: Sequence[int],
    distinct_prompts: int,
    tflops: float,
    gbps: float,
) -> dict[str, float | str]:
    """The least seconds to prefill ``distinct_prompts`` prompts of ``prompt_len`` tokens and decode rows whose
    responses have ``response_lens`` tokens (the first from the prefill's logits), and the tokens per second
    that makes; ``bound``: whether most decode steps were bound by bytes or by FLOPs."""
    flop_s, byte_s = tflops * 1e12, gbps * 1e9
    tokens = distinct_prompts * prompt_len
    prefill_flops = 2 * shape.body_params * tokens + 2 * shape.head_params * distinct_prompts
    prefill_flops += 2 * shape.layers * shape.attn_dim * distinct_prompts * prompt_len**2
    prefill_bytes = shape.weight_bytes + tokens * shape.kv_bytes_per_token
    seconds = max(prefill_flops / flop_s, prefill_bytes / byte_s)
    memory_bound = steps = 0
    for t in range(1, max(response_lens, default=0)):
        rows = sum(n > t for n in response_lens)
        context = prompt_len + t
        step_flops = (
            2 * (shape.body_params + shape.head_params) * rows + 4 * shape.layers * shape.attn_dim * rows * context
        )
        step_bytes = shape.weight_bytes + rows * (context * shape.kv_bytes_per_token + shape.vocab * shape.logit_bytes)
        seconds += max(step_flops / flop_s, step_bytes / byte_s)
        memory_bound += step_bytes / byte_s >= step_flops / flop_s
        steps += 1
    total = sum(response_lens)
    return {
        "floor_s": seconds,
        "floor_tokens_per_s": total / seconds if seconds > 0 else 0.0,
        "bound": "memory" if memory_bound * 2 >= steps else "compute",
    }


def train_flops(shape: Shape, lengths: Sequence[tuple[int, int]]) -> float:
    """FLOPs of one training pass (forward and backward) over samples of ``(prompt, response)`` tokens: three
    times the forward's, whose LM head runs at the response positions only and whose attention is causal."""
    forward = 0.0
    for prompt, response in lengths:
        n = prompt + response
        forward += 2 * shape.body_params * n + 2 * shape.head_params * response
        forward += 2 * shape.layers * shape.attn_dim * n * n
    return 3 * forward


def decode_figures(
    model: torch.nn.Module, prompt_len: int, response_lens: Sequence[int], distinct_prompts: int, tokens_per_s: float
) -> dict[str, float | str | None]:
    """The figures a decode benchmark prints beside its ``tokens_per_s``: this device's ``limits`` for the
    model's dtype, the batch's ``decode_floor`` over its rows' actual lengths, and the share of it reached."""
    param = next(model.parameters())
    tflops, gbps = limits(str(param.device), param.dtype)
    floor = decode_floor(Shape.of(model), prompt_len, response_lens, distinct_prompts, tflops, gbps)
    best = floor["floor_tokens_per_s"]
    return {
        "matmul_tflops": round(tflops, 2),
        "copy_gbps": round(gbps, 1),
        "decode_floor_tokens_per_s": round(best, 1),
        "decode_floor_bound": floor["bound"],
        "floor_fraction": round(tokens_per_s / best, 3) if best else None,
    }
