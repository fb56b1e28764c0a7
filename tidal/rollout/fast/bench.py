"""Benchmark cases of the fast decode path, each next to transformers ``generate`` on the same batch.

Run: ``python -m tidal.rollout.fast.bench`` (CPU default: tiny preset) or, on the GPU host,
``python -m tidal.rollout.fast.bench --shape qwen2.5-0.5b-shape --prompts 64 --samples 8
--prompt-len 64 --new-tokens 256 --varlen-max 1024`` (``tidal bench rollout`` times the engine around the same
decoder, with the hardware's floor beside it). One JSON line per configuration:

- ``fast``: CUDA graphs on (where there is CUDA), fixed lengths: every row generates ``new_tokens``
  at temperature 1 (no EOS). ``tokens_per_s`` / ``seconds`` are a warm call; ``cold_seconds`` is the
  first call, graph capture included (``capture_s``). ``logprob_max_abs_diff`` /
  ``logprob_mean_abs_diff``: the returned log-probs against a teacher-forced forward of the same
  model and dtype (what the trainer recomputes); ``fp32_logprob_*`` against an fp32 copy of it on
  the first ``--fp32-rows`` rows. ``peak_gpu_bytes`` (weights included) is checked against
  ``budget_bytes`` (``mem_fraction`` of the device).
- ``fast-eager``: the same with graphs off: what the graphs buy (CUDA only).
- ``fast-compiled``: graphs plus ``torch.compile`` of the step's model forward and sampling
  (attention stays eager); ``compile_fallback_reason`` says why it fell back, if it did (CUDA only).
- ``fast-tms``: cache and graphs allocated in a torch_memory_saver ``kv_cache`` region: bytes a
  pause frees (``tms_freed_bytes``, against ``kv_cache_bytes``: the rest is the graphs' pool), pause
  and resume seconds, and whether the next call replays without recapturing and samples the same
  tokens (CUDA only; needs torch_memory_saver).
- ``fast-varlen`` / ``fast-varlen-nocompact``: per-row length limits drawn uniformly in
  ``[--varlen-min, --varlen-max]``, EOS a stop id, with and without compaction; tokens counted up to
  each row's end. ``fast-varlen-compiled``: the same with the compiled step, as the engine decodes on
  CUDA by default (CUDA only). Their ``hf_generate_tokens_per_s`` runs ``generate`` to the longest limit (it
  has no per-row limit) and counts the same useful tokens.
- ``fast-prefill``: the prefill alone (one new token a row), with the batch's equal prompts prefilled once
  (the decoder's default) and with every row prefilled (``share_prompts=False``): ``prefill_s`` of each,
  their ratio, next to its limit, the rows per distinct prompt (``--samples``).
- ``fast-recapture``: after ``release()`` (what a memory backend that moves buffers forces), the
  next call's capture time (``capture_s``) against a warm call: the price of recapturing graphs.

``--fused-kv-write`` (with ``--fused``) has the compiled pieces write the cache instead of the attention call
(``FusedDecodeForward(write_kv=True)``). ``--compile-static`` compiles the decode step's pieces and sampler per
batch bucket, each specialised to its size, instead of one dynamic graph for all buckets (the decoder's
default): the compiled cases then say what the dynamic shapes cost the kernels (the ``environment`` line records
which ran).

A first ``environment`` line gives versions, the GPU and the weights' size. Every other line has
``hf_generate_tokens_per_s`` measured in the same run, ``cuda_graphs`` and
``fallback_reason`` (why graphs are off, when they are), and the decoder's step statistics; each case that
generates also has the hardware's limit beside its figure: ``decode_floor_tokens_per_s`` for its batch and
rows' lengths and whether bytes or FLOPs bound it (``decode_floor_bound``; ``tidal.roofline``, with
``matmul_tflops`` and ``copy_gbps`` measured once in the same run) and ``floor_fraction``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import time
from dataclasses import dataclass, field

import torch

from tidal import roofline
from tidal.dtypes import default_dtype
from tidal.model import build_model, resolve_model
from tidal.rollout.fast.decode import FastDecoder
from tidal.rollout.generate import left_pad, teacher_forced_logprobs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(prompts: int, samples: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``prompts`` random prompts of ``prompt_len`` tokens (ids 3..vocab), each repeated ``samples`` times."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(prompts):
        ids = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        out += [list(ids) for _ in range(samples)]
    return out


def hf_generate(
    model, prompts, *, max_new_tokens: int, temperature: float, pad_id: int, seed: int
) -> tuple[torch.Tensor, float]:
    """Plain ``model.generate`` on the whole left-padded batch, no EOS: (new token ids, seconds)."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    torch.manual_seed(seed)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        seq = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=temperature > 0,
            temperature=temperature or 1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    _sync(device)
    return seq[:, ids.shape[1] :], time.perf_counter() - t0


def _diffs(got: list[list[float]], ref: list[list[float]]) -> tuple[float, float]:
    flat = torch.tensor([abs(a - b) for g, r in zip(got, ref) for a, b in zip(g, r)] or [0.0], dtype=torch.float64)
    return float(flat.max()), float(flat.mean())


def _error_line(case: str, exc: Exception) -> dict:
    import traceback

    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"case": case, "error": f"{type(exc).__name__}: {exc}", "traceback_tail": "".join(tb[-4:])[-2000:]}


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def dec_bytes(line: dict) -> int:
    return int(line.get("kv_cache_bytes", 0))


def _timed(dec: FastDecoder, prompts, **kw) -> tuple:
    _sync(dec.device)
    if dec.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dec.device)
    t0 = time.perf_counter()
    res = dec.generate(prompts, **kw)
    _sync(dec.device)
    peak = torch.cuda.max_memory_allocated(dec.device) if dec.device.type == "cuda" else 0
    return res, time.perf_counter() - t0, peak


def _line(case: str, args, dec: FastDecoder, res, seconds: float, peak: int, hf_tps: float, **extra) -> dict:
    tokens = sum(len(t) for t in res.tokens)
    stats = dict(res.stats)
    budget = (
        int(args.mem_fraction * torch.cuda.get_device_properties(dec.device).total_memory)
        if dec.device.type == "cuda"
        else 0
    )
    line = {
        "case": case,
        "shape": args.shape,
        "device": str(dec.device),
        "gpu": torch.cuda.get_device_name(dec.device) if dec.device.type == "cuda" else None,
        "dtype": str(dec.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "rows": len(res.tokens),
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "hf_generate_tokens_per_s": round(hf_tps, 1),
        "speedup_vs_hf": round(tokens / seconds / hf_tps, 2) if hf_tps else None,
        "peak_gpu_bytes": int(peak),
        "budget_bytes": budget,
        "within_budget": (peak <= budget) if budget else None,
        "cuda_graphs": stats.get("cuda_graphs"),
        "fallback_reason": stats.get("fallback_reason"),
        "decoder_rows": stats.get("rows"),
        "kv_cache_bytes": dec.cache.nbytes if dec.cache is not None else 0,
        "steps": stats.get("steps"),
        "compactions": stats.get("compactions"),
        "prefill_s": round(stats.get("prefill_s", 0.0), 4),
        "decode_s": round(stats.get("decode_s", 0.0), 4),
        "capture_s": round(stats.get("capture_s", 0.0), 4),
        "graph_captures": stats.get("graph_captures"),
        "buckets": stats.get("buckets"),
        "fused": stats.get("fused"),
        "sampler_noise": stats.get("sampler_noise"),
        "kv_block": dec.kv_block,
        "decode_attention": dec.decode_attention,
        "flex_kernel_options": dec._flex.kernel_options if dec._flex is not None else None,
        "inductor_options": dec.compile_options,
    }
    # The hardware's limit for this batch over the rows' actual lengths (tidal.roofline), measured once a run.
    line.update(
        roofline.decode_figures(
            dec.model, args.prompt_len, [len(t) for t in res.tokens], args.prompts, tokens / seconds
        )
    )
    line.update(extra)
    return line


@dataclass
class _Run:
    """What every case shares: the flags, the model and its batch, and the lines printed so far."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    model: torch.nn.Module
    prompts: list[list[int]]
    eos: int = 2  # the char tokenizer's EOS; with random weights it is as likely as any other token
    pad: int = 0
    lines: list[dict] = field(default_factory=list)

    def emit(self, line: dict) -> None:
        self.lines.append(line)
        print(json.dumps(line), flush=True)

    def decoder(self, **kw) -> FastDecoder:
        args = self.args
        opts = dict(
            max_batch=len(self.prompts),
            max_seq_len=args.prompt_len + max(args.new_tokens, args.varlen_max),
            mem_fraction=args.mem_fraction,
            mem_bytes=int(args.mem_gib * 2**30) if args.mem_gib else None,
            pad_id=self.pad,
            kv_block=args.kv_block,
            fused=args.fused,
            decode_attention=args.decode_attention,
            sampler_noise=args.sampler_noise,
            compile_dynamic=not args.compile_static,
            fused_kv_write=args.fused_kv_write,
        )
        opts.update(kw)
        return FastDecoder(self.model, **opts)

    def empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _environment(run: _Run) -> dict:
    import transformers

    device = run.device
    return {
        "case": "environment",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "gpu_total_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0,
        "weights_bytes": sum(p.numel() * p.element_size() for p in run.model.parameters()),
        "rows": len(run.prompts),
        "compile_static": run.args.compile_static,
        "fused_kv_write": run.args.fused_kv_write,
    }


def run_cases(args: argparse.Namespace) -> list[dict]:
    """Every case, one dict per JSON line (printed as they finish)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = default_dtype(device.type)
    spec = resolve_model(args.shape)
    model = build_model(spec, dtype=dtype, seed=args.seed, device=device).eval()
    model.requires_grad_(False)
    vocab = model.config.get_text_config().vocab_size
    prompts = make_prompts(args.prompts, args.samples, args.prompt_len, vocab, args.seed)
    run = _Run(args, device, dtype, model, prompts)
    run.emit(_environment(run))

    # transformers generate, the limit every case is measured against (after a short warm-up).
    hf_tps = 0.0
    if not args.skip_hf:
        hf_generate(model, prompts[:4], max_new_tokens=4, temperature=1.0, pad_id=run.pad, seed=0)
        hf_new, hf_s = hf_generate(
            model, prompts, max_new_tokens=args.new_tokens, temperature=1.0, pad_id=run.pad, seed=args.seed
        )
        hf_tps = hf_new.numel() / hf_s

    fixed = dict(max_new_tokens=args.new_tokens, temperature=1.0, seed=args.seed)
    wanted = set(args.cases.split(","))
    fixed_cases = [("fast", dict(cuda_graphs=True))]
    if device.type == "cuda":  # compiling on CPU takes minutes; graphs do not exist there
        fixed_cases += [
            ("fast-eager", dict(cuda_graphs=False)),
            ("fast-compiled", dict(cuda_graphs=True, compile=True)),
        ]
    # --flex-kernel-options: each fixed case once per set of FlexAttention kernel options (one model, one job).
    # --inductor-options: the compiled cases once per set of inductor options (the same model), for each of those.
    option_sets = (
        _option_sets(args.flex_kernel_options, "--flex-kernel-options") if args.decode_attention == "flex" else [None]
    )
    inductor_sets = _option_sets(args.inductor_options, "--inductor-options")
    fixed_cases = [
        (case, {**opts, "flex_kernel_options": ko, "compile_options": io})
        for ko in option_sets
        for io in inductor_sets
        for case, opts in fixed_cases
        if io is None or opts.get("compile")
    ]
    for case, opts in fixed_cases:
        try:
            if case not in wanted:
                continue
            _fixed_case(run, case, opts, fixed, hf_tps)
        except Exception as exc:  # one broken case must not hide the others in a one-shot GPU run
            run.emit(_error_line(case, exc))
        finally:
            _free(device)

    if device.type == "cuda" and "fast-tms" in wanted:
        try:
            run.emit(_tms_case(args, run.decoder, prompts, fixed, hf_tps))
        except Exception as exc:
            run.emit(_error_line("fast-tms", exc))
        finally:
            _free(device)
    if "fast-prefill" in wanted:
        try:
            run.emit(_prefill_case(run))
        except Exception as exc:
            run.emit(_error_line("fast-prefill", exc))
        finally:
            _free(device)
    _varlen_cases(run, wanted)
    return run.lines


def _prefill_case(run: _Run) -> dict:
    """Prefill with equal prompts shared and with every row prefilled (a warm call each, one new token)."""
    one = dict(max_new_tokens=1, temperature=1.0, seed=run.args.seed)
    seconds, rows = {}, {}
    for share in (False, True):
        dec = run.decoder(cuda_graphs=False, share_prompts=share)
        _timed(dec, run.prompts, **one)
        res, _, _ = _timed(dec, run.prompts, **one)
        seconds[share], rows[share] = res.stats["prefill_s"], res.stats["prefill_rows"]
        del dec
        run.empty_cache()
    return {
        "case": "fast-prefill",
        "rows": len(run.prompts),
        "prefill_rows_shared": rows[True],
        "prefill_s_shared": round(seconds[True], 4),
        "prefill_s_every_row": round(seconds[False], 4),
        "speedup": round(seconds[False] / max(seconds[True], 1e-9), 2),
        "speedup_limit": run.args.samples,
    }


def _option_sets(texts: list[str] | None, flag: str) -> list[dict | None]:
    """A repeatable options flag (``--flex-kernel-options``, ``--inductor-options``): each a JSON object or a list of
    them (``{}``: the defaults); ``[None]`` when not given."""
    sets: list = []
    try:
        for text in texts or []:
            value = json.loads(text)
            sets += value if isinstance(value, list) else [value]
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{flag} {texts!r}: not JSON ({exc}); give JSON objects (or lists of them)") from None
    if not all(isinstance(s, dict) for s in sets):
        raise SystemExit(f"{flag} {texts!r}: give JSON objects (or lists of them)")
    return [s or None for s in sets] or [None]


def _fixed_case(run: _Run, case: str, opts: dict, fixed: dict, hf_tps: float) -> None:
    """One fixed-length case (``fast``, ``fast-eager``, ``fast-compiled``); ``fast`` adds ``fast-recapture``."""
    args, prompts, device = run.args, run.prompts, run.device
    dec = run.decoder(**opts)
    cold, cold_s, _ = _timed(dec, prompts, **fixed)
    res, seconds, peak = _timed(dec, prompts, **fixed)
    extra = {
        "cold_seconds": round(cold_s, 4),
        "capture_s": round(cold.stats["capture_s"], 4),
        "compiled": res.stats["compiled"],
        "compile_fallback_reason": res.stats["compile_fallback_reason"],
    }
    if case in ("fast", "fast-compiled"):
        extra.update(_logprob_checks(run, res))
    line = _line(case, args, dec, res, seconds, peak, hf_tps, **extra)
    if args.profile == case:
        from tidal.profiling import profiled

        _, summary = profiled(functools.partial(_timed, dec, prompts, **fixed), device.type, f"fast-bench {case}")
        run.emit(summary.as_dict())
    if case == "fast":
        # Release (drops graphs) then generate again: the capture cost a moving memory backend pays.
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(device) if cuda else 0
        t0 = time.perf_counter()
        dec.release()
        release_s = time.perf_counter() - t0
        # What release() hands back: the cache, the state buffers and the graphs' pool.
        freed = reserved - torch.cuda.memory_reserved(device) if cuda else dec_bytes(line)
        line["reserved_bytes_warm"] = int(reserved)
        line["release_freed_bytes"] = int(freed)
        again, again_s, _ = _timed(dec, prompts, **fixed)
        run.emit(line)
        run.emit(
            _line(
                "fast-recapture",
                args,
                dec,
                again,
                again_s,
                0,
                hf_tps,
                release_s=round(release_s, 4),
                warm_seconds=round(seconds, 4),
            )
        )
    else:
        run.emit(line)
    del dec
    run.empty_cache()


def _logprob_checks(run: _Run, res) -> dict:
    """The returned log-probs against a teacher-forced forward (and an fp32 copy on the first rows)."""
    model, prompts, args = run.model, run.prompts, run.args
    extra: dict = {}
    forced = teacher_forced_logprobs(model, prompts, res.tokens)
    extra["logprob_max_abs_diff"], extra["logprob_mean_abs_diff"] = _diffs(res.logprobs, forced)
    if args.fp32_rows and run.dtype != torch.float32:
        ref = copy.deepcopy(model).float()
        k = min(args.fp32_rows, len(prompts))
        forced32 = teacher_forced_logprobs(ref, prompts[:k], res.tokens[:k])
        extra["fp32_logprob_max_abs_diff"], extra["fp32_logprob_mean_abs_diff"] = _diffs(res.logprobs[:k], forced32)
        del ref
    extra["mean_logprob"] = sum(sum(x) for x in res.logprobs) / max(1, sum(len(x) for x in res.logprobs))
    return extra


def _varlen_cases(run: _Run, wanted: set[str]) -> None:
    """Variable lengths: per-row limits spread over [varlen_min, varlen_max], EOS a stop id."""
    args, model, prompts, device, eos = run.args, run.model, run.prompts, run.device, run.eos
    gen = torch.Generator().manual_seed(args.seed + 1)
    limits = torch.randint(args.varlen_min, args.varlen_max + 1, (len(prompts),), generator=gen).tolist()
    var = dict(max_new_tokens=limits, temperature=1.0, stop_ids=[eos], seed=args.seed)
    hf_var_tps = 0.0
    cases = [("fast-varlen", dict(compaction=True)), ("fast-varlen-nocompact", dict(compaction=False))]
    if device.type == "cuda":  # the configuration the engine runs on CUDA: graphs and the compiled step
        cases.append(("fast-varlen-compiled", dict(compaction=True, compile=True)))
    if not args.skip_hf_varlen and wanted & {case for case, _ in cases}:
        hf_var, hf_var_s = hf_generate(
            model, prompts, max_new_tokens=max(limits), temperature=1.0, pad_id=run.pad, seed=args.seed
        )
        useful = 0
        for row, lim in zip(hf_var.tolist(), limits):
            row = row[:lim]
            useful += row.index(eos) + 1 if eos in row else len(row)
        hf_var_tps = useful / hf_var_s
    for case, opts in cases:
        try:
            if case not in wanted:
                continue
            dec = run.decoder(**opts)
            _timed(dec, prompts, **var)  # cold: captures the buckets this batch visits
            res, seconds, peak = _timed(dec, prompts, **var)
            extra = {
                "limits_min": min(limits),
                "limits_max": max(limits),
                "limits_sum": sum(limits),
                "stopped_rows": sum(res.stopped),
                "compiled": res.stats["compiled"],
                "compile_fallback_reason": res.stats["compile_fallback_reason"],
            }
            run.emit(_line(case, args, dec, res, seconds, peak, hf_var_tps, **extra))
            if args.profile == case:
                from tidal.profiling import profiled

                _, summary = profiled(functools.partial(_timed, dec, prompts, **var), device.type, f"fast-bench {case}")
                run.emit(summary.as_dict())
            del dec
            run.empty_cache()
        except Exception as exc:
            run.emit(_error_line(case, exc))
        finally:
            _free(device)


def _tms_case(args, decoder, prompts, fixed: dict, hf_tps: float) -> dict:
    """KV cache and graphs under torch_memory_saver: what a pause frees, and whether graphs survive it."""
    from tidal.memory.base import StateClass, engine_policy
    from tidal.memory.tms import TmsBackend

    backend = TmsBackend(engine_policy(), device="cuda", hook_mode="torch", label="bench-fast")
    dec = decoder(region=lambda: backend.region(StateClass.KV_CACHE), graphs_in_region=True)
    backend.register(StateClass.KV_CACHE, dec.kv_tensors)
    _timed(dec, prompts, **fixed)
    res, seconds, peak = _timed(dec, prompts, **fixed)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    backend.pause([StateClass.KV_CACHE])
    t1 = time.perf_counter()
    free1 = torch.cuda.mem_get_info()[0]
    backend.resume([StateClass.KV_CACHE])
    t2 = time.perf_counter()
    again = dec.generate(prompts, **fixed)
    return _line(
        "fast-tms",
        args,
        dec,
        res,
        seconds,
        peak,
        hf_tps,
        tms_pause_s=round(t1 - t0, 4),
        tms_resume_s=round(t2 - t1, 4),
        tms_freed_bytes=int(free1 - free0),
        graph_captures_after_resume=again.stats["graph_captures"],
        same_tokens_after_resume=again.tokens == res.tokens,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="tiny", help="model preset (tiny, tiny-qwen2, qwen2.5-0.5b-shape, ...)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--varlen-min", type=int, default=16)
    p.add_argument("--varlen-max", type=int, default=64)
    p.add_argument("--skip-hf-varlen", action="store_true", help="skip generate on the variable-length batch")
    p.add_argument(
        "--skip-hf", action="store_true", help="skip generate on the fixed-length batch (runs comparing settings)"
    )
    p.add_argument("--mem-fraction", type=float, default=0.45, help="device memory the engine may hold at its peak")
    p.add_argument(
        "--mem-gib", type=float, default=None, help="cache and workspace budget in GiB instead (on CPU: 1 by default)"
    )
    p.add_argument("--kv-block", type=int, default=256, help="attention length granularity of decode steps")
    p.add_argument("--fused", action="store_true", help="stacked q/k/v and gate/up matmuls (tidal.rollout.fast.fused)")
    p.add_argument("--decode-attention", choices=("sdpa", "flex"), default="sdpa", help="decode-step attention kernel")
    p.add_argument(
        "--sampler-noise",
        choices=("buffer", "drawn", "blocks"),
        default="buffer",
        help="unfiltered sampling's noise (--rollout-sampler-noise; drawn only with the compiled step)",
    )
    p.add_argument(
        "--flex-kernel-options",
        action="append",
        help="with flex, repeatable: JSON kernel options for flex_attention (or a list of them); each fixed case "
        "runs once per set, e.g. --flex-kernel-options {} --flex-kernel-options '{\"num_warps\":4}'",
    )
    p.add_argument(
        "--inductor-options",
        action="append",
        help="repeatable: JSON inductor options for the compiled cases' graphs (torch.compile options; or a list of "
        "them); each compiled fixed case runs once per set, e.g. --inductor-options {} --inductor-options "
        "'{\"coordinate_descent_tuning\":true}'",
    )
    p.add_argument(
        "--compile-static",
        action="store_true",
        help="compiled cases: a graph per batch bucket specialised to its size (default: one dynamic graph for all)",
    )
    p.add_argument(
        "--fused-kv-write",
        action="store_true",
        help="with --fused: each compiled piece writes the keys and values it computed (one fused kernel), not "
        "the attention call (two index_copy a layer)",
    )
    p.add_argument("--fp32-rows", type=int, default=64, help="rows checked against an fp32 teacher-forced pass")
    p.add_argument(
        "--cases",
        default="fast,fast-eager,fast-compiled,fast-tms,fast-prefill,fast-varlen,fast-varlen-nocompact,fast-varlen-compiled",
        help="comma-separated cases to run (fast-recapture comes with fast)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--profile", default=None, help="a case whose warm call also runs under torch.profiler (table on stderr)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tidal.rollout.fast.bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    run_cases(args)


if __name__ == "__main__":
    main()


def run_from_rollout_bench(args: argparse.Namespace) -> list[dict]:
    """The cases above with the shape and batch flags of ``python -m tidal.bench.rollout``."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    mine = p.parse_args([])
    for name in ("shape", "prompts", "samples", "prompt_len", "new_tokens", "seed", "device"):
        if getattr(args, name, None) is not None:
            setattr(mine, name, getattr(args, name))
    return run_cases(mine)
