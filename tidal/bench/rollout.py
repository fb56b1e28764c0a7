"""Rollout throughput and log-prob fidelity of the embedded engine, next to plain transformers ``generate``.

Run: ``python -m tidal.bench.rollout`` (CPU default: tiny preset, 32 prompts x 8 samples), or on a
GPU ``python -m tidal.bench.rollout --shape qwen2.5-0.5b-shape --prompts 64 --samples 8
--prompt-len 64 --new-tokens 256``. Prints one JSON line per configuration (shape x ``path``, the
engine's generation step: ``fast`` = ``tidal.rollout.fast``, ``generate`` = transformers generate):

- ``tokens_per_s`` / ``seconds``: the engine's ``generate`` over the whole batch (chunking, policy
  log-probs, stop handling included), counting response tokens after cutting at EOS;
- ``hf_generate_tokens_per_s``: the limit it is measured against, plain ``model.generate`` on the
  same padded batch with the same sampling in the same run, counting tokens up to each row's EOS;
- ``logprob_max_abs_diff`` / ``logprob_mean_abs_diff``: the engine's log-probs against a
  teacher-forced forward pass over prompt + response (what the trainer recomputes);
- ``peak_gpu_bytes``: peak allocated device memory during the engine's generate (0 on CPU);
- ``decode_floor_tokens_per_s``: the limit of the hardware (``tidal.roofline``): the least time the
  batch's prefill and decode steps take at the matmul peak and copy bandwidth measured in the same run
  (``matmul_tflops``, ``copy_gbps``), whether its steps are bound by bytes or FLOPs (``decode_floor_bound``),
  and ``floor_fraction``, the engine's share of it;
- ``compiled``: whether the fast path ran its compiled decode step (the CUDA default; ``--no-compile``
  turns it off);
- with ``--with-cb``, ``cb_generate_batch_tokens_per_s``: transformers continuous batching on the
  same prompts (the measurement behind the engine's choice of padded ``generate``);
- with ``--profile``, one more warm ``generate`` of the same batch under ``torch.profiler``: its table
  (kernels by device time on CUDA, where the decode runs as replayed CUDA graphs; operators by CPU
  time elsewhere) on stderr, and a ``{"profile": ...}`` JSON line after the path's line with the
  total, the split by kernel category and the top kernels (``tidal.profiling``).

The model is randomly initialised (presets need no download), so responses are noise; what is
measured is the cost per token and the agreement of the log-probs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from tidal import roofline
from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig
from tidal.profiling import profiled
from tidal.rollout.embedded import EmbeddedEngine
from tidal.rollout.generate import left_pad, teacher_forced_logprobs
from tidal.rollout.types import Sample, SamplingParams


def make_samples(engine: EmbeddedEngine, prompts: int, samples: int, prompt_len: int, seed: int) -> list[Sample]:
    """``prompts`` random prompts of ``prompt_len`` ordinary tokens, each repeated ``samples`` times (one group)."""
    gen = torch.Generator().manual_seed(seed)
    specials = set(engine.tokenizer.all_special_ids)
    vocab = min(len(engine.tokenizer), engine.model.config.get_text_config().vocab_size)
    pool = torch.tensor([i for i in range(vocab) if i not in specials])
    out = []
    for g in range(prompts):
        ids = pool[torch.randint(len(pool), (prompt_len,), generator=gen)].tolist()
        out += [Sample(index=g * samples + j, group=g, prompt=None, prompt_ids=list(ids)) for j in range(samples)]
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate_tokens(engine: EmbeddedEngine, batch: list[Sample], sampling: SamplingParams) -> tuple[int, float]:
    """Plain ``model.generate`` on the whole padded batch: (tokens up to each row's EOS, seconds)."""
    ids, mask = left_pad([s.prompt_ids for s in batch], engine._pad_id, engine.device)
    eos = engine.tokenizer.eos_token_id
    torch.manual_seed(sampling.seed or 0)
    _sync(engine.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        seq = engine.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=sampling.temperature > 0,
            temperature=sampling.temperature or 1.0,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=engine._pad_id,
        )
    _sync(engine.device)
    seconds = time.perf_counter() - t0
    tokens = 0
    for row in seq[:, ids.shape[1] :].tolist():
        tokens += row.index(eos) + 1 if eos in row else len(row)
    return tokens, seconds


def cb_generate_tokens(engine: EmbeddedEngine, batch: list[Sample], sampling: SamplingParams) -> tuple[int, float]:
    """transformers continuous batching (``generate_batch``) on the same prompts: (tokens, seconds)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(
        do_sample=sampling.temperature > 0,
        temperature=sampling.temperature or 1.0,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=engine.tokenizer.eos_token_id,
        pad_token_id=engine._pad_id,
    )
    # The page-size keyword was renamed between transformers releases (block_size -> page_size).
    try:
        cb = ContinuousBatchingConfig(return_logprobs=True, page_size=64)
    except TypeError:
        cb = ContinuousBatchingConfig(return_logprobs=True, block_size=64)
    _sync(engine.device)
    t0 = time.perf_counter()
    results = engine.model.generate_batch(
        [s.prompt_ids for s in batch], generation_config=config, continuous_batching_config=cb
    )
    _sync(engine.device)
    seconds = time.perf_counter() - t0
    return sum(len(r.generated_tokens) for r in results.values()), seconds


def _timed(fn, repeats: int) -> tuple[object, float]:
    """The result of the fastest of ``repeats`` runs and its seconds (the machine's noise only adds time)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn()
        seconds = time.perf_counter() - t0
        if seconds < best:
            best, out = seconds, res
    return out, best


def _compiled(engine: EmbeddedEngine) -> bool:
    """Whether the engine decoded through a compiled step (False for transformers generate or a fallback)."""
    dec = getattr(engine, "_fast_decoder", None)
    return hasattr(dec, "_compiled_step") and dec._compiled_step() is not None


def engine_generate_fresh(engine: EmbeddedEngine, args: argparse.Namespace, sampling: SamplingParams):
    """A call of ``engine.generate`` on a fresh copy of the benchmark batch, synchronised at its end."""
    batch = make_samples(engine, args.prompts, args.samples, args.prompt_len, args.seed)

    def call():
        out = engine.generate(batch, sampling)
        _sync(engine.device)
        return out

    return call


def run(args: argparse.Namespace, shape: str, path: str) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # Unset: the engine's default (compiled on CUDA), as in a resolved configuration.
    rollout = RolloutConfig(
        rollout_seed=args.seed,
        rollout_compile=False if args.no_compile else None,
        rollout_fused_decode=args.fused,
        rollout_fused_kv_write=args.fused_kv_write,
        rollout_sampler_noise=args.sampler_noise,
        rollout_kv_block=args.kv_block,
        rollout_decode_attention=args.decode_attention,
    )
    # The engine's generation step: the fast decode path (tidal.rollout.fast) or transformers generate.
    rollout.rollout_fast_decode = path == "fast"
    engine = EmbeddedEngine(ModelConfig(model=shape), rollout, MemoryConfig(), device=device, seed=args.seed)
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.new_tokens, seed=args.seed
    )
    batch = make_samples(engine, args.prompts, args.samples, args.prompt_len, args.seed)
    # Warm-up: first calls pay for kernel selection and allocator growth, not generation.
    engine.generate(
        make_samples(engine, 2, 2, args.prompt_len, args.seed + 1), SamplingParams(max_new_tokens=4, seed=0)
    )
    hf_generate_tokens(engine, batch[:4], SamplingParams(max_new_tokens=4, seed=0))

    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)

    fresh = [make_samples(engine, args.prompts, args.samples, args.prompt_len, args.seed) for _ in range(args.repeats)]

    def engine_generate():
        out = engine.generate(fresh.pop(), sampling)
        _sync(engine.device)
        return out

    out, seconds = _timed(engine_generate, args.repeats)
    peak = torch.cuda.max_memory_allocated(engine.device) if engine.device.type == "cuda" else 0
    tokens = sum(len(s.response_ids) for s in out)
    hf_tps = None
    if not args.skip_hf:
        hf_runs = [hf_generate_tokens(engine, batch, sampling) for _ in range(args.repeats)]
        hf_tokens, hf_seconds = min(hf_runs, key=lambda r: r[1])
        hf_tps = round(hf_tokens / hf_seconds, 1)

    forced = teacher_forced_logprobs(
        engine.model,
        [s.prompt_ids for s in out],
        [s.response_ids for s in out],
        batch_bytes=(8 << 30) if engine.device.type == "cuda" else (1 << 30),
    )
    diffs = torch.tensor([abs(a - b) for s, f in zip(out, forced) for a, b in zip(s.response_logprobs, f)] or [0.0])
    result = {
        "shape": shape,
        "path": path,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "rows": len(batch),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "hf_generate_tokens_per_s": hf_tps,
        "logprob_max_abs_diff": float(diffs.max()),
        "logprob_mean_abs_diff": float(diffs.mean()),
        "peak_gpu_bytes": int(peak),
        "completed_frac": round(sum(s.status == "completed" for s in out) / len(out), 3),
        "compiled": _compiled(engine),
        "fused": bool(getattr(getattr(engine, "_fast_decoder", None), "_fused", None)),
        "sampler_noise": engine._fast_decoder._sampler_noise()
        if hasattr(getattr(engine, "_fast_decoder", None), "_sampler_noise")
        else None,
        "kv_block": args.kv_block,
        # The kernel the decoder runs: flex falls back to SDPA where it cannot run the model.
        "decode_attention": getattr(getattr(engine, "_fast_decoder", None), "decode_attention", args.decode_attention),
    }
    lens = [len(s.response_ids) for s in out]
    result.update(roofline.decode_figures(engine.model, args.prompt_len, lens, args.prompts, tokens / seconds))
    if args.profile:
        _, summary = profiled(engine_generate_fresh(engine, args, sampling), engine.device.type, f"rollout {path}")
        result["profile"] = summary.as_dict()
    if args.with_cb:
        cb_runs = [cb_generate_tokens(engine, batch, sampling) for _ in range(args.repeats)]
        cb_tokens, cb_seconds = min(cb_runs, key=lambda r: r[1])
        result["cb_generate_batch_tokens_per_s"] = round(cb_tokens / cb_seconds, 1)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tidal.bench.rollout", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny", help="model preset(s), comma-separated: one JSON line each")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each generator; the fastest counts")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--paths", default="fast,generate", help="engine generation steps to time: fast, generate")
    p.add_argument("--no-compile", action="store_true", help="decode uncompiled on CUDA (--no-rollout-compile)")
    p.add_argument(
        "--skip-hf", action="store_true", help="skip transformers generate (runs comparing engine settings in one job)"
    )
    p.add_argument("--fused", action="store_true", help="stacked q/k/v and gate/up matmuls (--rollout-fused-decode)")
    p.add_argument(
        "--fused-kv-write",
        action="store_true",
        help="with --fused: its pieces write the KV cache (--rollout-fused-kv-write)",
    )
    p.add_argument(
        "--sampler-noise",
        default="auto",
        choices=("auto", "buffer", "drawn", "blocks"),
        help="the sampler's noise: a buffer, drawn inside its kernel, or per block and word (--rollout-sampler-noise; "
        "auto: blocks with CUDA)",
    )
    p.add_argument(
        "--kv-block", type=int, default=256, help="attention-length step of decode graphs (--rollout-kv-block)"
    )
    p.add_argument(
        "--decode-attention",
        choices=("auto", "sdpa", "flex"),
        default="auto",
        help="decode-step attention kernel (--rollout-decode-attention; auto: the engine's default, flex with CUDA)",
    )
    p.add_argument("--with-cb", action="store_true", help="also time transformers continuous batching (generate_batch)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="one more warm generate under torch.profiler: table on stderr, summary line",
    )
    args = p.parse_args(argv)
    if args.fused_kv_write and not args.fused:
        print(
            "python -m tidal.bench.rollout: --fused-kv-write is a variant of the fused step; add --fused",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.threads:
        torch.set_num_threads(args.threads)
    for shape in args.shape.split(","):
        for path in args.paths.split(","):
            result = run(args, shape.strip(), path.strip())
            profile = result.pop("profile", None)
            print(json.dumps(result), flush=True)
            if profile is not None:
                print(json.dumps(profile), flush=True)


if __name__ == "__main__":
    main()
