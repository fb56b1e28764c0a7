"""Benchmark: the trainer's step throughput, pause/resume and checkpoint speed, each next to its limit.

    python -m tidal.bench.trainer                                     # CPU: tiny preset
    python -m tidal.bench.trainer --model smollm2-135m --samples 16   # CPU: a real 135M model
    python -m tidal.bench.trainer --device cuda --model qwen2.5-0.5b-shape --samples 64 \\
        --prompt-len 256 --response-len 256                           # GPU

One rank in this process (a 1-rank FSDP2 group; the code path of every rank). Prints ``{"train": ...}``
(first_train_s, train_s, grad_norm) as soon as the measured call ends, then one JSON line:

    first_train_s            the warm-up call (the first: allocator growth, AdamW state, compiling)
    first_loss / loss        the two calls' losses, and the measured call's entropy and gradient norm (same
    entropy / grad_norm      samples and seed: equal across kernels up to rounding)
    train_tokens_per_s       ``TrainerActor.train`` on one rollout (old log-prob recompute, loss,
                             backward, clipping, AdamW), real tokens / seconds
    limit_tokens_per_s       the same micro-batches through the bare transformers model and the same
                             log-prob kernel (no FSDP, one forward + backward + AdamW step, no
                             recompute), same run
    train_vs_limit           ratio; the trainer runs two forwards per micro-batch (recompute + train)
                             so ~0.6-0.7 means its own overhead is small
    limit_error              why the two above are null: the bare model ran out of device memory beside
                             the trainer (its whole micro-batch's logits and gradient at 32k tokens)
    matmul_tflops            the hardware's limit: a square matmul in the compute dtype, same run (it and
                             the two below also in the first line, right after the measured call)
    train_floor_s            one training pass's FLOPs (``tidal.roofline.train_flops``) at that peak
    train_peak_fraction      train_floor_s / train_s: the share of the measured peak the train call reached
    pause_s / resume_s       trainer pause/resume (weights + AdamW state) with offload on
    pause_gbps / resume_gbps backed-up bytes / seconds
    copy_gbps                the limit: a large host memcpy (CPU) or pinned D2H copy (CUDA)
    save_s / save_gbps       an atomic checkpoint of weights + optimizer (written while paused)
    write_gbps               the limit: the same bytes written as one safetensors file, same run
    adamw                    the kernel choices in effect: AdamW's (--adamw-impl), the logits per
    logprob_chunk_elems      compiled log-prob chunk (--logprob-chunk-elems), the compiled forward over
    logprob_forward          vocabulary blocks or rows (--logprob-forward), the backward element-wise
    logprob_backward         or row-wise (--logprob-backward), rows bounded for 32-bit indexing
    logprob_bounded_rows     (--logprob-bounded-rows), the LM head at the trained positions only
    trained_logits_only      (off with --all-logits)
    host_syncs               CUDA: how often one more train call made the host wait for the device
    host_sync_sites          (torch's sync debug mode), and the Python lines that did; the rollout's one
                             transfer of its metrics at the end is expected, anything per micro-batch
                             stalls the queue of kernels

``--response-len-min N`` draws each response's length in ``[N, --response-len]`` anew for every call, so the
measured call meets micro-batch shapes the warm-up did not (as a real run does at every step), and
``--attention-order cudnn-first`` puts cuDNN's SDPA kernel before the trainer's own order
(``tidal.trainer.step.TRAIN_SDPA``): the two side by side show what a kernel's per-shape set-up costs a train call.

With ``--profile`` one more train call (after the measured one) runs under torch.profiler: a table of
kernels by device time (operators by CPU time on the CPU) on stderr and a second JSON line,
``{"profile": "train", ...}``, with the total, the split by kernel category and the top kernels (``tidal.profiling``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import time

import torch

from tidal import roofline
from tidal.profiling import profiled


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _samples(n: int, plen: int, rlen: int, vocab: int, seed: int = 0, rlen_min: int | None = None):
    """``n`` samples of random tokens; responses of ``rlen`` tokens, or drawn in ``[rlen_min, rlen]`` (per seed)."""
    from tidal.rollout.types import Sample

    rng = random.Random(seed)
    hi = min(vocab - 1, 48) if vocab <= 64 else vocab - 1
    lens = [rlen if rlen_min is None else rng.randint(rlen_min, rlen) for _ in range(n)]
    return [
        Sample(
            index=i,
            group=i // 4,
            prompt="",
            prompt_ids=[rng.randint(4, hi) for _ in range(plen)],
            response_ids=[rng.randint(4, hi) for _ in range(lens[i])],
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(n)
    ]


def _copy_gbps(device: str, nbytes: int) -> float:
    if device == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst.copy_(src)
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        return nbytes / (time.perf_counter() - t) / 1e9
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time.perf_counter()
    dst.copy_(src)
    return nbytes / (time.perf_counter() - t) / 1e9


def _limit_tokens_per_s(actor, samples) -> float:
    """The bare model on the trainer's own micro-batches: one forward + backward + AdamW step."""
    from tidal.algos.logprobs import token_logprobs
    from tidal.model.load import build_model
    from tidal.trainer.microbatch import MicroBatch
    from tidal.trainer.packing import pack_micro_batches

    model = build_model(actor.spec, dtype=torch.float32, seed=0, device=actor.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    lengths = [s.total_len for s in samples]
    mbs = [
        MicroBatch(samples, mb, actor.pad_id, actor.device)
        for mb in pack_micro_batches(lengths, actor.cfg.max_tokens_per_gpu)
    ]
    autocast = torch.autocast(
        "cuda", dtype=actor.compute_dtype, enabled=actor.device_type == "cuda" and actor.compute_dtype != torch.float32
    )
    t = time.perf_counter()
    for mb in mbs:
        # The same model call and log-prob kernel as the trainer (right-padded rows, no mask).
        with autocast:
            logits = model(input_ids=mb.input_ids, use_cache=False).logits
        lp = token_logprobs(logits, mb.next_ids)[:, :-1]
        (-(lp * mb.mask).sum() / mb.mask.sum().clamp(min=1)).backward()
    opt.step()
    if actor.device_type == "cuda":
        torch.cuda.synchronize()
    return sum(lengths) / (time.perf_counter() - t)


def _limit_or_reason(actor, samples) -> tuple[float | None, str | None]:
    """``_limit_tokens_per_s``, or None and why where the bare model does not fit beside the trainer (it keeps its
    own weights, optimizer state and whole micro-batches' logits on the device next to the trainer's)."""
    try:
        return _limit_tokens_per_s(actor, samples), None
    except torch.OutOfMemoryError as exc:
        reason = f"the bare model ran out of device memory beside the trainer: {str(exc).splitlines()[0]}"
        print(json.dumps({"limit_error": reason}), flush=True)
        return None, reason
    finally:
        if actor.device_type == "cuda":
            torch.cuda.empty_cache()


def _host_syncs(fn) -> tuple[int, dict[str, int]]:
    """Run ``fn`` under CUDA's sync debug mode: how many synchronising calls it made, by Python line."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sites: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            site = f"{os.path.relpath(w.filename)}:{w.lineno}"
            sites[site] = sites.get(site, 0) + 1
    return sum(sites.values()), dict(sorted(sites.items(), key=lambda kv: -kv[1]))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--response-len", type=int, default=16)
    ap.add_argument(
        "--response-len-min",
        type=int,
        default=None,
        help="responses drawn in [this, --response-len], new lengths at every call (a real run's micro-batch shapes)",
    )
    ap.add_argument(
        "--attention-order",
        default="trainer",
        choices=("trainer", "cudnn-first"),
        help="SDPA's kernel order in the model calls: the trainer's (tidal.trainer.step.TRAIN_SDPA) or cuDNN's first",
    )
    ap.add_argument("--max-tokens-per-gpu", type=int, default=4096)
    ap.add_argument(
        "--recompute-logprobs",
        action="store_true",
        help="run the separate old-log-prob pass (a one-step rollout otherwise takes the training pass's own)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="print a torch.profiler table of the measured train call to stderr"
    )
    ap.add_argument(
        "--compile-layers", action="store_true", help="torch.compile every decoder layer (--compile-layers)"
    )
    ap.add_argument("--adamw-impl", default="auto", choices=("auto", "fused", "foreach"), help="--adamw-impl")
    ap.add_argument(
        "--all-logits",
        action="store_true",
        help="the LM head at every position (--no-trained-logits-only; the default is on with CUDA)",
    )
    ap.add_argument(
        "--logprob-forward",
        default="rows",
        choices=("blocked", "rows"),
        help="the compiled log-prob forward: over vocabulary blocks (one read of the logits) or whole rows (two)",
    )
    ap.add_argument(
        "--logprob-backward",
        default="rowwise",
        choices=("flat", "rowwise"),
        help="the compiled log-prob backward: element-wise over rows * V, or a row-wise kernel",
    )
    ap.add_argument(
        "--logprob-bounded-rows",
        action="store_true",
        help="bound the compiled chunks' rows for the compiler (32-bit indexing)",
    )
    ap.add_argument(
        "--logprob-chunk-elems",
        type=int,
        default=None,
        help="logits per chunk of the compiled log-prob kernels (default tidal.algos.logprobs.COMPILED_CHUNK_ELEMS; "
        "0: the eager kernels' 512 MiB budget, 441 rows at a 152k vocabulary)",
    )
    return ap.parse_args(argv)


def _trainer(args: argparse.Namespace):
    from tidal.config.schema import AlgorithmConfig, MemoryConfig, ModelConfig, TrainerConfig, WeightSyncConfig
    from tidal.trainer.actor import TrainerActor

    return TrainerActor(
        0,
        1,
        "127.0.0.1",
        _port(),
        model=ModelConfig(model=args.model),
        trainer=TrainerConfig(
            lr=1e-6,
            max_tokens_per_gpu=args.max_tokens_per_gpu,
            recompute_logprobs=args.recompute_logprobs,
            compile_layers=args.compile_layers,
            adamw_impl=args.adamw_impl,
            trained_logits_only=False if args.all_logits else None,
        ),
        algorithm=AlgorithmConfig(),
        memory=MemoryConfig(offload_train=True),
        weight_sync=WeightSyncConfig(),
        device=args.device,
    )


def _save_figures(actor) -> tuple[dict, float, float]:
    """A checkpoint save's stats and time, and the time of writing as many bytes as one safetensors file."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        s = actor.save(os.path.join(d, "ckpt"), {"rollout_id": 1})
        save_s = time.perf_counter() - t
        flat = {f"t{i}": torch.ones(max(1, s["checkpoint/bytes"] // 4 // 8), dtype=torch.float32) for i in range(8)}
        t = time.perf_counter()
        save_file(flat, os.path.join(d, "limit.safetensors"))
        write_s = time.perf_counter() - t
    return s, save_s, write_s


def _apply_knobs(args: argparse.Namespace) -> bool:
    """Check the length range and set the module-level kernel choices the flags name; False: bad input (said)."""
    from tidal.algos import logprobs

    if args.response_len_min is not None and not 1 <= args.response_len_min <= args.response_len:
        print(
            f"--response-len-min {args.response_len_min}: give 1 to --response-len ({args.response_len})",
            file=sys.stderr,
        )
        return False
    if args.attention_order == "cudnn-first":
        from torch.nn.attention import SDPBackend

        from tidal.trainer import step

        cudnn = SDPBackend.CUDNN_ATTENTION
        step.TRAIN_SDPA = (cudnn,) + tuple(b for b in step.TRAIN_SDPA if b != cudnn)
    if args.logprob_chunk_elems is not None:
        logprobs.COMPILED_CHUNK_ELEMS = args.logprob_chunk_elems
    logprobs.BLOCKED_FORWARD = args.logprob_forward == "blocked"
    logprobs.ROWWISE_BACKWARD = args.logprob_backward == "rowwise"
    logprobs.BOUNDED_ROWS = args.logprob_bounded_rows
    return True


def main(argv: list[str] | None = None) -> int:
    from tidal.algos import logprobs

    args = _parse(argv)
    if not _apply_knobs(args):
        return 2
    actor = _trainer(args)
    info = actor.init()
    vocab = actor.model.config.vocab_size
    samples = _samples(args.samples, args.prompt_len, args.response_len, vocab, rlen_min=args.response_len_min)
    t_first = time.perf_counter()
    first = actor.train(samples, 0)  # warm-up: allocator, optimizer state, compiling
    first_s = time.perf_counter() - t_first
    batch = _samples(args.samples, args.prompt_len, args.response_len, vocab, seed=1, rlen_min=args.response_len_min)
    m = actor.train(batch, 1)
    # The measured figures at once (the full row comes at the end, after the limit, pause and save), so that a
    # run cut short by a time limit still reports them.
    tflops = roofline.matmul_tflops(torch.device(args.device), actor.compute_dtype)
    floor_s = roofline.train_flops(
        roofline.Shape.of(actor.model), [(len(x.prompt_ids), len(x.response_ids)) for x in batch]
    )
    floor_s /= tflops * 1e12
    peak = {
        "matmul_tflops": round(tflops, 2),
        "train_floor_s": round(floor_s, 4),
        "train_peak_fraction": round(floor_s / m["train_s"], 3),
    }
    early = {
        "first_train_s": round(first_s, 3),
        "train_s": round(m["train_s"], 3),
        "grad_norm": round(m["grad_norm"], 6),
        **peak,
    }
    print(json.dumps({"train": early}), flush=True)
    profile, later = None, []
    if args.profile:  # one more call, so that the profiler's own overhead stays out of train_s
        out, summary = profiled(lambda: actor.train(batch, 2), args.device, "train")
        profile, later = summary.as_dict(), [out]
    syncs, sync_sites = None, {}
    if args.device == "cuda":
        syncs, sync_sites = _host_syncs(lambda: later.append(actor.train(batch, 3)))
    limit, limit_error = _limit_or_reason(actor, samples)

    p = actor.pause().metrics
    kept = p["memory/trainer_pause/weights/backup_bytes"] + p["memory/trainer_pause/optimizer/backup_bytes"]
    s, save_s, write_s = _save_figures(actor)
    r = actor.resume().metrics
    row = {
        "model": args.model,
        "device": args.device,
        "params": info["num_params"],
        "tokens": m["tokens"],
        "compile_layers": args.compile_layers,
        "response_lens": [min(len(x.response_ids) for x in batch), max(len(x.response_ids) for x in batch)],
        "attention_order": args.attention_order,
        "adamw": "fused" if actor.optimizer.defaults.get("fused") else "foreach",
        "logprob_chunk_elems": logprobs.COMPILED_CHUNK_ELEMS,
        "logprob_forward": args.logprob_forward,
        "logprob_backward": args.logprob_backward,
        "logprob_bounded_rows": args.logprob_bounded_rows,
        "trained_logits_only": actor._stats_kw["trained_only"],
        "first_train_s": round(first_s, 3),
        "train_s": round(m["train_s"], 3),
        # The same samples and seed give the same losses whatever the kernels (to rounding).
        "first_loss": round(float(first["loss"]), 6),
        "loss": round(float(m["loss"]), 6),
        "entropy": round(float(m["entropy"]), 6),
        "grad_norm": round(float(m["grad_norm"]), 6),
        "train_tokens_per_s": round(m["tokens_per_s"], 1),
        "limit_tokens_per_s": round(limit, 1) if limit else None,
        "train_vs_limit": round(m["tokens_per_s"] / limit, 3) if limit else None,
        "limit_error": limit_error,
        **peak,
        "logprob_recompute_s": round(m["logprob_recompute_s"], 3),
        "logprob_recomputed": bool(m["logprob_recomputed"]),
        "optimizer_s": round(m["optimizer_s"], 3),
        "backup_bytes": kept,
        "pause_s": round(p["memory/trainer_pause/total_s"], 4),
        "resume_s": round(r["memory/trainer_resume/total_s"], 4),
        "pause_gbps": round(kept / p["memory/trainer_pause/total_s"] / 1e9, 2),
        "resume_gbps": round(kept / r["memory/trainer_resume/total_s"] / 1e9, 2),
        "copy_gbps": round(_copy_gbps(args.device, max(kept, 1 << 26)), 2),
        "checkpoint_bytes": s["checkpoint/bytes"],
        "save_s": round(save_s, 3),
        "save_gbps": round(s["checkpoint/bytes"] / save_s / 1e9, 3),
        "write_gbps": round(s["checkpoint/bytes"] / write_s / 1e9, 3),
        # The calls after the measured one (profiled, sync-counted): their losses and gradient norms, equal
        # across kernel choices up to rounding like the first two.
        "later_losses": [round(float(x["loss"]), 6) for x in later],
        "later_grad_norms": [round(float(x["grad_norm"]), 6) for x in later],
        "host_syncs": syncs,
        "host_sync_sites": sync_sites,
    }
    print(json.dumps(row))
    if profile is not None:
        print(json.dumps(profile))
    actor.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
