"""How ``EmbeddedEngine`` uses the fast decode path: one call at its generation step.

``fast_generate_chunk(decoder, prompts, sampling, end_ids)`` returns what the engine's
``_generate_chunk`` returns (token ids and raw-policy log-probs per row), or ``None`` when the
transformers ``generate`` path should run instead: fast decode turned off, a model it cannot run
(logged once), or more stop ids than it holds. Stop *strings* need no special case: rows run to
their end id or length and ``finish_response`` cuts them at the first stop string, as it does for
``generate``'s output.

The engine owns its decoder: it builds it on first use with ``build_decoder`` (from its model,
``RolloutConfig`` and memory backend) and keeps it (``engine._fast_decoder``). Its cache and
state buffers are allocated inside the engine backend's ``region(kv_cache)`` and registered as class
``kv_cache``, so ``release_memory`` / ``resume_memory`` free and restore them with the rest of the
engine's KV memory.

Settings, read from the engine's ``RolloutConfig`` when it has them (defaults otherwise):

    rollout_fast_decode   bool   True   use this path
    rollout_mem_fraction  float  0.45   device memory the engine may hold at its peak (weights + KV + workspace)
    rollout_cuda_graphs   bool   True   capture decode steps in CUDA graphs (CUDA only)
    rollout_max_batch     int    512    rows decoded together (the cache holds at most this many)
    rollout_kv_block      int    256    attention length granularity of a decode step
    rollout_compile       bool   CUDA   torch.compile the decode step (attention stays eager); on with CUDA
    rollout_compile_options dict CUDA   inductor options of its graphs; combo kernels with CUDA, none on CPU
    rollout_prefix_cache_mb int  0      prompt KV kept between calls for multi-turn requests (tidal.rollout.fast.prefix)
    rollout_fused_decode  bool   False  stacked q/k/v and gate/up matmuls in decode steps (tidal.rollout.fast.fused)
    rollout_fused_kv_write bool  False  with it, its compiled pieces write the KV cache (the attention only reads)
    rollout_sampler_noise str    auto   unfiltered sampling's noise: buffer, drawn inside the kernel, or blocks (two stages); auto: blocks with CUDA
    rollout_decode_attention str auto   decode attention kernel: sdpa, or flex (tidal.rollout.fast.flex_decode); auto: flex with CUDA
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from tidal.config.schema import (
    decode_attention_default,
    rollout_compile_default,
    rollout_compile_options_default,
    sampler_noise_default,
)
from tidal.errors import UserError
from tidal.memory.base import StateClass
from tidal.rollout.fast.decode import FastDecoder
from tidal.rollout.types import SamplingParams

log = logging.getLogger(__name__)

OFF = "off"  # what an engine keeps when it decided not to use the fast path


def build_decoder(model, cfg, *, device_type: str, pad_id: int, backend, name: str) -> FastDecoder | str:
    """The engine's fast decoder for ``model`` under ``cfg`` (its ``RolloutConfig``), or ``OFF``: turned
    off, or a model it cannot run (logged once). Its KV cache is allocated in ``backend``'s
    ``region(kv_cache)`` and registered there, so the engine's releases free it."""
    if not cfg.rollout_fast_decode:
        return OFF
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 1 << 30
    seq = min(limit, cfg.rollout_max_prompt_len + cfg.rollout_max_response_len)
    try:
        dec = FastDecoder(
            model,
            max_batch=cfg.rollout_max_batch,
            max_seq_len=seq,
            mem_fraction=cfg.rollout_mem_fraction,
            cuda_graphs=cfg.rollout_cuda_graphs,
            kv_block=cfg.rollout_kv_block,
            # Unset (a config built in code, not resolved): the resolved default, on with CUDA.
            compile=cfg.rollout_compile if cfg.rollout_compile is not None else rollout_compile_default(device_type),
            pad_id=pad_id,
            region=lambda: backend.region(StateClass.KV_CACHE),
            prefix_cache_bytes=int(getattr(cfg, "rollout_prefix_cache_mb", None) or 0) << 20,
            fused=bool(getattr(cfg, "rollout_fused_decode", False)),
            fused_kv_write=bool(getattr(cfg, "rollout_fused_kv_write", False)),
            compile_options=_compile_options(cfg, device_type),
            sampler_noise=_auto(getattr(cfg, "rollout_sampler_noise", "auto"), sampler_noise_default, device_type),
            decode_attention=_auto(
                getattr(cfg, "rollout_decode_attention", "auto"), decode_attention_default, device_type
            ),
        )
    except UserError as exc:
        log.warning("%s: transformers generate instead of fast decode (%s)", name, exc)
        return OFF
    backend.register(StateClass.KV_CACHE, dec.kv_tensors)
    return dec


def _compile_options(cfg, device_type: str) -> dict | None:
    """The decode step's inductor options: the config's, or for a config built in code and not resolved, the
    resolved default for the device."""
    opts = getattr(cfg, "rollout_compile_options", None)
    return rollout_compile_options_default(device_type) if opts is None else opts


def _auto(choice: str, default: Callable[[str], str], device_type: str) -> str:
    """A setting of a config built in code, not resolved: ``auto`` is the resolved default for the device."""
    return default(device_type) if choice == "auto" else choice


def _takes(dec: FastDecoder | str, end_ids: Sequence[int]) -> bool:
    """Whether ``dec`` decodes a call with ``end_ids`` (else transformers ``generate`` does)."""
    return dec != OFF and len(end_ids) <= dec.max_stop_ids


def wave_rows(dec: FastDecoder | str, end_ids: Sequence[int]) -> int | None:
    """Rows of one wave of ``dec`` (what its KV cache holds, planned before the first allocation) when it
    takes a call with ``end_ids``; None when ``fast_generate_chunk`` would fall back to ``generate``."""
    if not _takes(dec, end_ids):
        return None
    return dec.rows if dec.cache is not None else int(dec.plan()["rows"])


def fast_generate_chunk(
    dec: FastDecoder | str,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    end_ids: list[int],
    limits: Sequence[int] | None = None,
    should_stop=None,
    on_rows_done=None,
) -> tuple[list[list[int]], list[list[float]]] | None:
    """New token ids and their policy log-probs per row, or None to fall back to ``generate``.

    ``limits``: new tokens per row (default ``sampling.max_new_tokens`` for each); ``should_stop``:
    asked at the decoder's host syncs, True cuts the call short; ``on_rows_done``: rows that ended, handed
    on at those syncs (``FastDecoder.generate``)."""
    if not _takes(dec, end_ids):
        return None
    # No seed: the engine has seeded torch for this call (CPU: the decoder draws its seed from it;
    # CUDA: the default generator the graphs use is the one torch.manual_seed set).
    res = dec.generate(
        prompts,
        max_new_tokens=int(sampling.max_new_tokens) if limits is None else [int(x) for x in limits],
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=int(sampling.top_k),
        stop_ids=end_ids,
        should_stop=should_stop,
        on_rows_done=on_rows_done,
    )
    return res.tokens, res.logprobs
