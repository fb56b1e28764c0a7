"""The fast decode path: static KV cache, on-device sampling, compaction, CUDA graphs.

``FastDecoder(model, ...)`` wraps a transformers causal LM (llama / qwen2 / qwen3 style; its own
model code runs every layer) and generates a batch of prompts:

1. Rows go in waves of at most ``rows`` (what the memory budget allows, ``plan_rows``). A wave is
   left-padded to its longest prompt ``W``, so every row decodes at the same cache column and one
   column index serves the batch.
2. Prefill runs in chunks of rows whose distinct prompts fill at most ``prefill_tokens``
   (``prefix.prefill_chunks``): one forward pass per chunk (the model's, eager; with ``fused``, the fused
   step's pieces, compiled when the step is) with a 4-D boolean mask (causal, padding excluded; a padding
   query sees itself so that no row of the softmax is empty), keys/values written straight into the cache,
   last-position logits only.
   Equal prompts of a chunk (the samples of a GRPO group) go through it once; their rows copy the keys
   and values and sample from the same logits.
3. Decode steps feed one token per row. A step is a fixed sequence of kernels over static buffers
   (``_step``): model forward through ``fast_attention``, ``sampling.sample``, writing the token and
   its log-prob into per-row output buffers, stop-id / per-row length checks into a ``done`` flag.
   On CUDA it is captured as a graph per (batch bucket, KV-length bucket, sampling mode) and
   replayed; elsewhere (CPU) the same function runs eagerly.
4. Every ``check_every`` steps the host reads how many rows are still running (the only host sync
   of the loop). When they fit a smaller batch bucket, their cache rows and state move to the front
   (compaction) and the loop continues at that bucket, so rows that finished early stop costing
   anything and a long tail runs at a small batch. When none is left, the wave ends. A caller may have
   the rows that ended handed on there (``on_rows_done``), before the call returns.

The attention of a step covers only the cache columns written so far, rounded up to ``kv_block``
(a static length per graph), not the whole cache. With ``decode_attention="flex"`` it goes through
FlexAttention instead (``tidal.rollout.fast.flex_decode``): a block mask built on the device each
step lists the blocks each row has written, the kernel reads only those, and one graph per batch
bucket serves every length (its KV length is the whole cache).

Log-probs are those of the raw policy (``log_softmax`` of the model's logits at temperature 1) for
the sampled tokens, as the trainer recomputes them.

Memory: ``kv_tensors()`` lists every tensor the cached graphs point into besides the weights (the
cache and the step's state buffers), for a memory backend to release as class ``kv_cache``;
``release()`` frees them and the graphs outright, and the next ``generate`` re-allocates. A backend
that frees and re-allocates them in place changes their addresses: the graphs notice (their address
signature) and are recaptured; one that keeps addresses (torch_memory_saver) keeps the graphs.
Contents are never trusted across calls: the cache is zeroed at the start of every ``generate``.

Size: about 700 lines, because the wave loop, the step, compaction and the buffers they
share are one state machine over the same static tensors; the parts that stand alone (attention,
graphs, cache plan, sampling, prefixes, fused projections, flex attention) are their own modules.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from tidal.errors import UserError
from tidal.rollout.fast import attention
from tidal.rollout.fast.flex_decode import RECOMPILES, FlexDecode, recompile_limit_name
from tidal.rollout.fast.fused import FusedDecodeForward, unsupported_reason
from tidal.rollout.fast.graphs import GraphSet
from tidal.rollout.fast.prefix import (
    PrefixStore,
    prefill_chunks,
    reuse_prefixes,
    share_rows,
    shared_prompts,
    take_prompt,
)
from tidal.rollout.fast.request import DecodeResult, batch_buckets, check_request, cut_at_stops
from tidal.rollout.fast.sampling import (
    SamplingMode,
    blocked_core,
    drawn_core,
    plain_core,
    sample,
    sampling_mode,
    vocab_block,
)
from tidal.rollout.fast.static_cache import StaticKVCache, kv_shape, plan_cache
from tidal.rollout.types import DecodeStats

log = logging.getLogger(__name__)

_CPU_DEFAULT_BUDGET = 1 << 30


class FastDecoder:
    """Batched generation over a transformers causal LM with a static cache and on-device sampling.

    Memory: ``mem_bytes`` caps the cache plus the decode workspace; otherwise ``mem_fraction`` of the
    device's total memory caps weights + cache + workspace at the peak (on CPU, without
    ``mem_bytes``, the cache gets 1 GiB). ``max_batch`` caps the rows of one wave, ``max_seq_len``
    the prompt + response length of one row (grown on demand, which drops the cache and graphs).
    ``region`` is a context-manager factory wrapped around every allocation of ``kv_tensors()``
    (a memory backend's ``region(kv_cache)``). ``rehearse_graphs`` runs graph capture's warm-up and
    state restore where there are no graphs (tests on CPU). ``compile`` runs the decode step's
    model forward and sampling through ``torch.compile`` (attention excluded); a failure to compile
    turns it off with one log line (``compile_fallback_reason``). ``graphs_in_region`` captures
    graphs inside ``region`` too, so that a backend that pauses the region (torch_memory_saver) also
    pauses the graphs' memory pool. ``fused`` runs decode steps through
    ``tidal.rollout.fast.fused.FusedDecodeForward`` (stacked q/k/v and gate/up weights, refreshed from
    the model at every ``generate``) where the model family allows it (``fused_fallback_reason`` says
    why not, when it does not). ``decode_attention`` picks the decode step's attention kernel:
    ``"sdpa"`` (SDPA over the bucketed length with an additive mask) or ``"flex"`` (FlexAttention
    with a per-row block mask; ``flex_kernel_options`` go to ``flex_attention`` as they are).
    ``sampler_noise="drawn"`` (compiled only) samples unfiltered rows with ``drawn_core``, its noise
    drawn inside the compiled kernel instead of written to a ``[rows, vocab]`` buffer first;
    ``sampler_noise="blocks"`` (compiled or not) with ``blocked_core``, a block of words and then a word
    of it, so the noise is ``rows x (V/B + B)`` draws (a vocabulary no power of two from 32 to 256
    divides keeps the buffer; ``sampler_fallback_reason`` says so).
    ``share_prompts`` prefills equal prompts of a chunk once (off: every row runs the forward; for
    comparisons).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch: int = 512,
        max_seq_len: int = 2048,
        mem_fraction: float = 0.45,
        mem_bytes: int | None = None,
        cuda_graphs: bool = True,
        kv_block: int = 256,
        check_every: int = 8,
        prefill_tokens: int = 16384,
        compaction: bool = True,
        pad_id: int = 0,
        max_stop_ids: int = 16,
        region: Callable[[], contextlib.AbstractContextManager] | None = None,
        rehearse_graphs: bool = False,
        compile: bool = False,
        graphs_in_region: bool = False,
        prefix_cache_bytes: int = 0,
        fused: bool = False,
        decode_attention: str = "sdpa",
        flex_kernel_options: dict | None = None,
        sampler_noise: str = "buffer",
        share_prompts: bool = True,
        compile_dynamic: bool = True,
        fused_kv_write: bool = False,
        compile_options: dict | None = None,
    ) -> None:
        reason = attention.check_supported(model)
        if reason is not None:
            raise UserError(
                f"fast decode cannot run model {type(model).__name__}: {reason}; turn --rollout-fast-decode off"
            )
        if not 0 < mem_fraction <= 1:
            raise UserError(f"rollout memory fraction {mem_fraction}: must be in (0, 1]; fix --rollout-mem-fraction")
        for name, value in (("max_batch", max_batch), ("max_seq_len", max_seq_len), ("kv_block", kv_block)):
            if value < 1:
                raise UserError(f"fast decode {name}={value}: must be at least 1")
        if sampler_noise not in ("buffer", "drawn", "blocks"):
            raise UserError(
                f"sampler noise {sampler_noise!r}: choose buffer, drawn or blocks (--rollout-sampler-noise)"
            )
        if decode_attention not in ("sdpa", "flex"):
            raise UserError(f"decode attention {decode_attention!r}: choose sdpa or flex (--rollout-decode-attention)")
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab = self.config.vocab_size
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.mem_fraction = mem_fraction
        self.mem_bytes = mem_bytes
        self.kv_block = kv_block
        self.check_every = max(1, check_every)
        self.prefill_tokens = max(1, prefill_tokens)
        self.compaction = compaction
        self.share_prompts = share_prompts
        self.pad_id = pad_id
        self.max_stop_ids = max_stop_ids
        self.region = region or contextlib.nullcontext
        self.shape = kv_shape(self.config, self.dtype)
        self.cache: StaticKVCache | None = None
        self.rows = 0
        self._gen = torch.Generator(device="cpu") if self.device.type == "cpu" else None
        self.graphs = GraphSet(
            self.device,
            rehearse=rehearse_graphs,
            generator=self._gen,
            region=self.region if graphs_in_region else None,
        )
        # torch.compile of the decode step's model forward (attention stays eager: it writes the
        # cache in place) and of the sampling core: fewer, fused kernels inside each captured graph.
        # compile_dynamic: one graph per compiled piece for every batch bucket (rows symbolic); off, a graph per
        # bucket, each specialised to its size (for comparing the two: the fast bench's --compile-static).
        self.compile_fallback_reason: str | None = None
        self._compiled_forward = None
        self._dynamic = compile_dynamic
        # compile_options: inductor settings for every graph the decoder compiles (torch.compile's ``options``; for
        # comparing them: the fast bench's --inductor-options).
        self.compile_options = dict(compile_options) if compile_options else None
        self._samplers(sampler_noise, compile)
        self._fused: FusedDecodeForward | None = None
        self.fused_fallback_reason: str | None = None
        if fused:
            self.fused_fallback_reason = unsupported_reason(model)
            if self.fused_fallback_reason is None:
                self._fused = FusedDecodeForward(
                    model,
                    compile=compile,
                    dynamic=compile_dynamic,
                    write_kv=fused_kv_write,
                    options=self.compile_options,
                )
            else:
                log.info("fast decode: projections not fused (%s)", self.fused_fallback_reason)
        if compile:
            attention.register()
            # The fused forward compiles its own pieces between the attention calls (one graph each).
            if self._fused is None:
                self._compiled_forward = self._compile(self._forward_logits)
        if not cuda_graphs and self.graphs.enabled:
            self.graphs.enabled = False
            self.graphs.fallback_reason = "turned off"
        self.last_stats: dict = {}
        self._totals = DecodeStats()  # every call's stats since the last take_totals (the engine's metrics)
        self._totals_lock = threading.Lock()
        # Prompt KV kept between calls for requests that extend an earlier one (multi-turn); None: off.
        self.prefixes = PrefixStore(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.flex_fallback_reason: str | None = None
        if decode_attention == "flex" and self.device.type == "cuda" and self.shape.head_dim < 16:
            # The compiled kernel's matmuls need a head dimension of at least 16.
            self.flex_fallback_reason = f"head_dim {self.shape.head_dim} < 16"
            log.warning("fast decode: flex attention off, SDPA instead (%s)", self.flex_fallback_reason)
            decode_attention = "sdpa"
        self.decode_attention = decode_attention
        self._flex = (
            FlexDecode(compiled=self.device.type == "cuda", kernel_options=flex_kernel_options)
            if decode_attention == "flex"
            else None
        )

    # ------------------------------------------------------------------ memory

    def budget_bytes(self) -> int:
        """Bytes the decoder may use for cache + workspace (weights excluded)."""
        if self.mem_bytes is not None:
            return int(self.mem_bytes)
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            stacked = self._fused.nbytes() if self._fused is not None else 0
            return int(self.mem_fraction * total) - weights - stacked
        return _CPU_DEFAULT_BUDGET

    def plan(self, max_seq_len: int | None = None) -> dict:
        """How the budget splits: rows, cache bytes, workspace estimate (no allocation)."""
        max_len = max_seq_len or self.max_seq_len
        return plan_cache(
            self.config, self.dtype, self.shape, self.budget_bytes(), max_len, self.prefill_tokens, self.max_batch
        )

    def allocate(self) -> None:
        """Allocate the cache and the step's state buffers for the current ``max_seq_len``."""
        plan = self.plan()
        rows, max_len = plan["rows"], self.max_seq_len
        dev = self.device
        with self.region():
            self.cache = StaticKVCache(self.shape, rows, max_len, dev)
            # Per-slot state of the running batch (slot = position in the bucket).
            self.s_tok = torch.zeros(rows, dtype=torch.long, device=dev)  # last token, fed next
            self.s_pos = torch.zeros(rows, dtype=torch.long, device=dev)  # its RoPE position
            self.s_start = torch.zeros(rows, dtype=torch.long, device=dev)  # first real cache column
            self.s_limit = torch.zeros(rows, dtype=torch.long, device=dev)  # max new tokens
            self.s_rowmap = torch.zeros(rows, dtype=torch.long, device=dev)  # wave row of the slot
            self.s_done = torch.ones(rows, dtype=torch.bool, device=dev)
            # Shared scalars: cache column written next, index of the token produced next.
            self.s_cpos = torch.zeros(1, dtype=torch.long, device=dev)
            self.s_step = torch.zeros(1, dtype=torch.long, device=dev)
            self.s_cols = torch.arange(max_len, dtype=torch.long, device=dev)
            self.s_origin = torch.arange(2, dtype=torch.long, device=dev)  # fused pieces' cache writes: row 0, 1 token
            self.s_stop = torch.full((self.max_stop_ids,), -1, dtype=torch.long, device=dev)
            self.s_temp = torch.ones(1, dtype=torch.float32, device=dev)
            self.s_top_p = torch.ones(1, dtype=torch.float32, device=dev)
            # Outputs by wave row; the extra last row absorbs writes of empty slots.
            self.s_out_tok = torch.zeros((rows + 1, max_len), dtype=torch.long, device=dev)
            self.s_out_lp = torch.zeros((rows + 1, max_len), dtype=torch.float32, device=dev)
            if self._fused is not None:
                self._fused.allocate(dev)
        self.rows = rows
        self.graphs.clear()
        log.info(
            "fast decode: cache of %d rows x %d tokens (%.2f GiB), budget %.2f GiB",
            rows,
            max_len,
            self.cache.nbytes / 2**30,
            plan["budget_bytes"] / 2**30,
        )

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every tensor of memory class kv_cache: the cache and the decode state (empty when released)."""
        if self.cache is None:
            return []
        stacked = self._fused.buffers if self._fused is not None else []
        return [
            self.cache.buf,
            *self._state(),
            self.s_start,
            self.s_limit,
            self.s_rowmap,
            self.s_cols,
            self.s_origin,
            *stacked,
        ]

    def _state(self) -> list[torch.Tensor]:
        """Buffers a decode step mutates (saved around graph warm-up) or reads per call."""
        return [
            self.s_tok,
            self.s_pos,
            self.s_done,
            self.s_cpos,
            self.s_step,
            self.s_stop,
            self.s_temp,
            self.s_top_p,
            self.s_out_tok,
            self.s_out_lp,
        ]

    def release(self) -> None:
        """Free the cache, the state buffers, every graph and the stored prefixes; ``generate`` re-allocates."""
        self.graphs.clear()
        if self.prefixes is not None:
            self.prefixes.clear()
        self.cache = None
        if self._fused is not None:
            self._fused.release()
        for name in [n for n in vars(self) if n.startswith("s_")]:
            delattr(self, name)
        self.rows = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self) -> None:
        """Allocate again after ``release`` (otherwise ``generate`` does it on first use)."""
        if self.cache is None:
            self.allocate()

    def _released_in_place(self) -> bool:
        """Whether a memory backend freed the buffers in place (storage of zero bytes)."""
        return self.cache is not None and self.cache.buf.untyped_storage().nbytes() == 0

    def _signature(self) -> tuple[int, ...]:
        """Addresses a captured step reads or writes: weights, buffers, cache and state."""
        ptrs = [p.data_ptr() for p in self.model.parameters()]
        ptrs += [b.data_ptr() for b in self.model.buffers()]
        ptrs += [t.data_ptr() for t in self.kv_tensors()]
        return tuple(ptrs)

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_ids: Sequence[int] = (),
        seed: int | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_rows_done: Callable[[list[int], list[tuple[list[int], list[float], bool]]], None] | None = None,
    ) -> DecodeResult:
        """Generate for every prompt; see ``DecodeResult``.

        ``max_new_tokens`` is one limit or one per row. ``seed`` reseeds the sampling generator (on
        CUDA the device's default generator); without it the stream continues. ``should_stop`` is
        asked at each of the wave's host syncs (every ``check_every`` steps): once it answers True
        the call returns the tokens so far (rows not started: none), ``stats["interrupted"]`` set.
        ``on_rows_done(rows, results)`` is called at those syncs with the rows that ended since the last one
        (indices into ``prompts``) and their (tokens, log-probs, stopped), as the result will hold them: a
        caller can hand them on before the call returns.
        """
        t_start = time.perf_counter()
        n = len(prompts)
        limits, stops = check_request(prompts, max_new_tokens, stop_ids, temperature, top_p, top_k, self.max_stop_ids)
        if n == 0:
            return DecodeResult([], [], [], {})
        self._make_ready(max(len(p) for p in prompts) + max(limits))
        if self._fused is not None:
            self._fused.refresh()  # the weights may have changed since the last call (a sync, a resume)
        mode = self._set_sampling(temperature, top_p, top_k, stops, seed)

        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        stopped = [False] * n
        # prefill_rows: rows the prefill forwards covered (equal prompts of a chunk once).
        stats = {"waves": 0, "steps": 0, "compactions": 0, "prefill_s": 0.0, "decode_s": 0.0, "prefill_rows": 0}
        stats["buckets"] = []
        captures0, capture_s0 = self.graphs.captures, self.graphs.capture_s
        stop_set = set(stops)
        stats["interrupted"] = False
        for lo in range(0, n, self.rows):
            if should_stop is not None and should_stop():
                stats["interrupted"] = True
                break
            idx = list(range(lo, min(n, lo + self.rows)))
            report = None
            if on_rows_done is not None:

                def report(rows, tok, lp, idx=idx):
                    done = cut_at_stops(tok, lp, [limits[idx[r]] for r in rows], stop_set)
                    on_rows_done([idx[r] for r in rows], done)

            out_tok, out_lp = self._wave(
                [prompts[i] for i in idx], [limits[i] for i in idx], mode, stats, should_stop, report
            )
            rows = cut_at_stops(out_tok.tolist(), out_lp.tolist(), [limits[i] for i in idx], stop_set)
            for i, (tok, lp, hit) in zip(idx, rows):
                tokens[i], logprobs[i], stopped[i] = tok, lp, hit
            stats["waves"] += 1
        stats.update(
            rows=self.rows,
            max_seq_len=self.max_seq_len,
            mode=mode.name,
            cuda_graphs=self.graphs.enabled,
            fallback_reason=self.graphs.fallback_reason,
            compiled=self._compiled_step() is not None,
            compile_fallback_reason=self.compile_fallback_reason,
            fused=self._fused is not None,
            fused_fallback_reason=self.fused_fallback_reason,
            sampler_noise=self._sampler_noise(),
            sampler_fallback_reason=self.sampler_fallback_reason,
            decode_attention=self.decode_attention,
            flex_fallback_reason=self.flex_fallback_reason,
            graph_captures=self.graphs.captures - captures0,
            capture_s=self.graphs.capture_s - capture_s0,
            graphs_cached=len(self.graphs.graphs),
            new_tokens=sum(len(t) for t in tokens),
            seconds=time.perf_counter() - t_start,
        )
        self.last_stats = stats
        with self._totals_lock:
            self._totals.add(stats)
        return DecodeResult(tokens=tokens, logprobs=logprobs, stopped=stopped, stats=stats)

    def take_totals(self) -> DecodeStats:
        """The stats of every ``generate`` since the last call (then zero again)."""
        with self._totals_lock:
            out, self._totals = self._totals, DecodeStats()
        return out

    def _make_ready(self, need: int) -> None:
        """A cache and graphs that fit ``need`` positions (reallocated when longer than before)."""
        if need > self.max_seq_len:
            self.max_seq_len = -(-need // 64) * 64
            self.release()
        if self.cache is None:
            self.allocate()
        elif self._released_in_place():
            raise RuntimeError("fast decode: the KV cache is released; resume kv_cache before generating")
        self.graphs.check(self._signature())

    def _set_sampling(self, temperature: float, top_p: float, top_k: int, stops: list[int], seed: int | None):
        """Write the call's sampling parameters and stop ids into the step buffers; seed the generator."""
        # Buffers whose contents a step trusts are rewritten every call: a memory backend may have
        # handed them back uninitialised (the cache is cleared per wave, in ``_wave``).
        torch.arange(self.max_seq_len, out=self.s_cols)
        torch.arange(2, out=self.s_origin)
        mode = sampling_mode(temperature, top_p, top_k, self.vocab)
        self.s_temp.fill_(float(temperature) if temperature > 0 else 1.0)
        self.s_top_p.fill_(float(top_p))
        self.s_stop.fill_(-1)
        if stops:
            self.s_stop[: len(stops)] = torch.tensor(stops, dtype=torch.long, device=self.device)
        if self._gen is not None:
            # CPU: a private generator, seeded from the global RNG unless a seed is given, so that a
            # caller's torch.manual_seed makes the call reproducible.
            self._gen.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        elif seed is not None:
            # CUDA: the device's default generator, the one captured graphs advance at every replay.
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(int(seed))
        return mode

    def _bucket(self, n: int) -> int:
        for b in batch_buckets(self.rows):
            if b >= n:
                return b
        return self.rows

    def _wave(
        self,
        prompts: list[Sequence[int]],
        limits: list[int],
        mode: SamplingMode,
        stats: dict,
        should_stop: Callable[[], bool] | None = None,
        report: Callable[[list[int], list[list[int]], list[list[float]]], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Generate one wave (at most ``rows`` prompts); returns host ``[n, columns]`` tokens and log-probs
        (``max_new`` columns, fewer when ``should_stop`` cut the wave short). ``report(rows, tokens,
        log-probs)``: the wave rows that ended since the last host sync, with their columns so far."""
        dev = self.device
        n = len(prompts)
        width = max(len(p) for p in prompts)
        max_new = max(limits)
        bs = self._bucket(n)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        start = width - lens
        # Slot state: real rows first, then empty slots up to the bucket (done, writing to the spare row).
        self.s_done.fill_(True)
        self.s_done[:n] = False
        self.s_start.zero_()
        self.s_start[:n] = start.to(dev)
        self.s_limit.zero_()
        self.s_limit[:n] = torch.tensor(limits, dtype=torch.long).to(dev)
        self.s_rowmap.fill_(self.rows)
        self.s_rowmap[:n] = torch.arange(n, device=dev)
        self.s_pos.zero_()
        self.s_tok.fill_(self.pad_id)
        # Columns a step may read (its KV length rounds up to kv_block; flex reads whole blocks) must hold
        # finite values.
        block = self._flex.block if self._flex is not None else self.kv_block
        self.cache.zero_(rows=bs, cols=min(self.max_seq_len, -(-(width + max_new) // block) * block))

        t0 = time.perf_counter()
        with torch.profiler.record_function("tidal.prefill"):  # a label in --profile traces; free otherwise
            for r0, r1 in prefill_chunks(prompts, width, self.prefill_tokens, self.share_prompts):
                stats["prefill_rows"] += self._prefill(prompts[r0:r1], r0, width, mode)
            self.s_pos[:n] = lens.to(dev)
            self.s_cpos.fill_(width)
            self.s_step.fill_(1)
            # A row can end on its first token (a stop id, or a limit of 1).
            first = self.s_out_tok[:n, 0]
            self.s_done[:n] |= (first[:, None] == self.s_stop[None, :]).any(-1) | (self.s_limit[:n] <= 1)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        stats["prefill_s"] += t1 - t0

        steps, columns, reported = 0, max_new, set()
        with torch.profiler.record_function("tidal.decode"):
            for t in range(1, max_new):
                if (t - 1) % self.check_every == 0:
                    active = torch.nonzero(~self.s_done[:bs]).squeeze(1)
                    left = int(active.numel())  # the loop's one host sync, every check_every steps
                    if report is not None and n - left > len(reported):
                        self._report_ended(bs, n, t, reported, report)
                    if left == 0:
                        break
                    if should_stop is not None and should_stop():
                        columns = t  # columns [0, t) hold the tokens sampled so far
                        stats["interrupted"] = True
                        break
                    smaller = self._bucket(left)
                    if self.compaction and smaller < bs:
                        self._compact(active, smaller, upto=width + t - 1)
                        stats["compactions"] += 1
                        bs = smaller
                column = width + t - 1
                kv_len = self._kv_len(column)
                key = (bs, kv_len, mode)
                if (bs, kv_len, mode.name) not in stats["buckets"]:
                    stats["buckets"].append((bs, kv_len, mode.name))
                self.graphs.run(key, lambda b=bs, k=kv_len: self._step(b, k, mode), self._state())
                steps += 1
            out_tok = self.s_out_tok[:n, :columns].cpu()
            out_lp = self.s_out_lp[:n, :columns].cpu()
        stats["decode_s"] += time.perf_counter() - t1
        stats["steps"] += steps
        return out_tok, out_lp

    def _kv_len(self, column: int) -> int:
        """The static KV length of a step writing ``column``: the next ``kv_block`` multiple, or the whole
        cache with flex (its block mask stops each row at its last written block)."""
        if self._flex is not None:
            return self.max_seq_len
        return min(self.max_seq_len, -(-(column + 1) // self.kv_block) * self.kv_block)

    def _report_ended(self, bs: int, n: int, columns: int, reported: set[int], report) -> None:
        """Hand ``report`` the wave rows that ended since the last call, with their first ``columns`` columns
        (the rest of a row that ended is never read); before a compaction drops their slots."""
        slots = torch.nonzero(self.s_done[:bs]).squeeze(1)
        rows = [r for r in self.s_rowmap[slots].tolist() if r < n and r not in reported]
        if not rows:
            return
        reported.update(rows)
        pick = torch.tensor(rows, dtype=torch.long, device=self.device)
        report(rows, self.s_out_tok[pick, :columns].tolist(), self.s_out_lp[pick, :columns].tolist())

    def _prefill(self, prompts: list[Sequence[int]], row0: int, width: int, mode: SamplingMode) -> int:
        """One forward over a chunk of left-padded prompts (``_prefill_logits``); samples each row's first token.
        Returns the rows the forward covered.

        Rows with equal prompts (a GRPO group's samples) are computed once (``share_prompts``): the forward
        covers the chunk's distinct prompts, in its first rows; every row then takes its prompt's keys,
        values and logits (``tidal.rollout.fast.prefix.share_rows``) and samples its own first token. With
        stored prefixes (``tidal.rollout.fast.prefix``) the forward covers only the columns
        ``[from_col, width)`` and attends to the reused columns before them in the cache.
        """
        dev = self.device
        m = len(prompts)
        firsts, owner = shared_prompts(prompts) if self.share_prompts else (list(range(m)), list(range(m)))
        distinct = [prompts[i] for i in firsts]
        d = len(distinct)
        from_col = self._reuse_prefixes(distinct, row0, width)
        ids = torch.full((d, width - from_col), self.pad_id, dtype=torch.long)
        for i, p in enumerate(distinct):
            tail = list(p)[max(0, from_col - (width - len(p))) :]
            ids[i, ids.shape[1] - len(tail) :] = torch.as_tensor(tail, dtype=torch.long)
        ids = ids.to(dev)
        lens = torch.as_tensor([len(p) for p in distinct], dtype=torch.long).to(dev)
        start = width - lens  # each distinct prompt's first column (its rows' s_start)
        col = self.s_cols[:width]
        q, k = col[from_col:, None], col[None, :]
        real = k[None] >= start[:, None, None]
        mask = ((real & (k <= q)[None]) | (k == q)[None]).unsqueeze(1)  # [d, 1, width - from_col, width]
        pos = (col[None, from_col:] - start[:, None]).clamp(min=0)
        ctx = attention.AttnContext(cache=self.cache, decode=False, rows=d, row0=row0, prefill_from=from_col)
        with attention.active(self.model, ctx), attention.prefill_kernels():
            logits = self._prefill_logits(ids, mask, pos)
        if self.prefixes is not None:
            for k, p in enumerate(distinct):
                self.prefixes.put(p, take_prompt(self.cache, row0 + k, width - len(p), width))
        if d < m:
            share_rows(self.cache, row0, owner, width)
            logits = logits[torch.as_tensor(owner, dtype=torch.long, device=dev)]
        tok, lp = sample(logits, mode, self.s_temp, self.s_top_p, self._gen)
        self.s_tok[row0 : row0 + m] = tok
        self.s_out_tok[row0 : row0 + m, 0] = tok
        self.s_out_lp[row0 : row0 + m, 0] = lp
        return d

    def _prefill_logits(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Last-position logits of a prefill chunk: through the fused step's pieces when the decoder has them
        (compiled, a few dozen calls instead of the model's ~50 eager operations a layer, each launched from
        Python while the device waits: the prefill's cost is host time), else the model's own forward. Pieces
        compiled per batch bucket (``compile_dynamic`` off) would compile again for every new prompt shape, so
        those prefills take the model's forward too."""
        if self._fused is not None and (self._dynamic or not self._fused.compiled):
            return self._logits(ids, mask, pos)
        return self._model_logits(ids, mask, pos)

    def _reuse_prefixes(self, prompts: list[Sequence[int]], row0: int, width: int) -> int:
        """Copy each row's stored prefix KV into its cache row; returns the chunk's first column to compute."""
        return 0 if self.prefixes is None else reuse_prefixes(self.prefixes, self.cache, prompts, row0, width)

    def _step(self, bs: int, kv_len: int, mode: SamplingMode) -> None:
        """One decode step of slots ``[0, bs)`` attending to ``kv_len`` columns; static buffers only."""
        if self._dynamic:
            return self._step_body(bs, kv_len, mode)
        # Compiled per batch bucket: up to one graph per bucket for each piece, more than Dynamo's default limit.
        with torch._dynamo.config.patch(**{recompile_limit_name(): RECOMPILES}):
            return self._step_body(bs, kv_len, mode)

    def _step_body(self, bs: int, kv_len: int, mode: SamplingMode) -> None:
        mask, block_mask = self._step_mask(bs, kv_len)
        ctx = attention.AttnContext(
            cache=self.cache,
            decode=True,
            rows=bs,
            cpos=self.s_cpos,
            origin=self.s_origin,
            kv_len=kv_len,
            flex=self._flex,
            block_mask=block_mask,
        )
        with attention.active(self.model, ctx):
            logits = self._logits(self.s_tok[:bs, None], mask, self.s_pos[:bs, None])
        tok, lp = sample(
            logits,
            mode,
            self.s_temp,
            self.s_top_p,
            self._gen,
            fused=self._fused_sampler,
            drawn=self._drawn_sampler,
            blocked=self._blocked_sampler,
        )
        where = (self.s_rowmap[:bs], self.s_step.expand(bs))
        self.s_out_tok.index_put_(where, tok)
        self.s_out_lp.index_put_(where, lp)
        ended = (tok[:, None] == self.s_stop[None, :]).any(-1) | (self.s_step + 1 >= self.s_limit[:bs])
        self.s_done[:bs].logical_or_(ended)
        self.s_tok[:bs].copy_(tok)
        self.s_pos[:bs].add_(1)
        self.s_cpos.add_(1)
        self.s_step.add_(1)

    def _step_mask(self, bs: int, kv_len: int):
        """The step's mask, built once for every layer: ``(additive [bs, 1, 1, kv_len] mask, None)`` for SDPA;
        for flex ``(placeholder, BlockMask)``: the model passes a 4-D mask along untouched, so a
        ``[bs, 1, 1, 1]`` one stands in for it."""
        if self._flex is not None:
            group = self.config.num_attention_heads // self.shape.kv_heads
            # Slots that ended (or are empty) read one block: their outputs are never used.
            block_mask = self._flex.mask(self.s_start, self.s_cpos, bs, group, kv_len, self.s_done[:bs])
            return torch.zeros((bs, 1, 1, 1), dtype=self.dtype, device=self.device), block_mask
        col = self.s_cols[:kv_len]
        valid = (col[None, :] >= self.s_start[:bs, None]) & (col[None, :] <= self.s_cpos)
        # Additive mask in the model dtype, built once per step: SDPA would otherwise convert a
        # boolean mask in every layer. Every slot has a valid column (start <= cpos), so no row is
        # all -inf.
        mask = torch.zeros((bs, 1, 1, kv_len), dtype=self.dtype, device=self.device)
        mask.masked_fill_(~valid.view(bs, 1, 1, kv_len), float("-inf"))
        return mask, None

    def _forward_logits(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Last-position logits ``[rows, vocab]`` of one decode step (attention through the active context)."""
        if self._fused is not None:
            return self._fused(ids, mask, pos)
        return self._model_logits(ids, mask, pos)

    def _model_logits(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Last-position logits through the model's own forward (attention through the active context)."""
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1)
        return out.logits[:, -1]

    def _compiled_step(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """What runs a decode step's forward compiled: the fused forward's pieces or the compiled model forward;
        None when the step is uncompiled (never asked for, or compiling failed)."""
        if self._fused is not None:
            return self._fused if self._fused.compiled else None
        return self._compiled_forward

    def _logits(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        compiled = self._compiled_step()
        if compiled is not None:
            try:
                return compiled(ids, mask, pos)
            except Exception as exc:  # compilation problems surface on the first call: decode uncompiled
                self._disable_compile(exc)
        return self._forward_logits(ids, mask, pos)

    def _samplers(self, noise: str, compile: bool) -> None:
        """The decode step's sampling cores for ``noise`` (``--rollout-sampler-noise``): with ``compile``, the
        compiled ``plain_core`` (greedy and unfiltered with a noise buffer) and ``drawn_core`` for drawn;
        ``blocked_core`` for blocks, compiled or not, where a block size divides the vocabulary (else the
        buffer, with ``sampler_fallback_reason``)."""
        self._fused_sampler = self._compile(plain_core) if compile else None
        self._drawn_sampler = self._compile(drawn_core) if compile and noise == "drawn" else None
        self._blocked_sampler = None
        self.sampler_fallback_reason: str | None = None
        if noise == "blocks":
            vocab = int(self.config.vocab_size)
            if vocab_block(vocab):
                self._blocked_sampler = self._compile(blocked_core) if compile else blocked_core
            else:
                self.sampler_fallback_reason = f"no block of 32-256 words divides the vocabulary ({vocab})"
                log.info("fast decode: sampler noise blocks off (%s)", self.sampler_fallback_reason)

    def _compile(self, fn: Callable) -> Callable:
        """``fn`` through ``torch.compile`` with the decoder's sizes (``compile_dynamic``) and inductor options."""
        return torch.compile(fn, dynamic=self._dynamic, options=self.compile_options)

    def _sampler_noise(self) -> str:
        """The unfiltered sampler's noise in effect: blocks, drawn or buffer."""
        if self._blocked_sampler is not None:
            return "blocks"
        return "drawn" if self._drawn_sampler is not None else "buffer"

    def _disable_compile(self, exc: Exception) -> None:
        first = str(exc).splitlines()[0] if str(exc) else ""
        self.compile_fallback_reason = f"{type(exc).__name__}: {first}"
        log.warning("fast decode: torch.compile off, decoding uncompiled (%s)", self.compile_fallback_reason)
        self._compiled_forward = None
        if self._fused is not None:
            self._fused.set_compiled(False)
        self._fused_sampler = None
        self._drawn_sampler = None
        if self._blocked_sampler is not None:
            self._blocked_sampler = blocked_core

    def _compact(self, active: torch.Tensor, bs: int, upto: int) -> None:
        """Move the running slots ``active`` to the front; slots ``[len(active), bs)`` become empty."""
        n = int(active.numel())
        self.cache.compact(active, upto)
        for buf in (self.s_tok, self.s_pos, self.s_start, self.s_limit, self.s_rowmap, self.s_done):
            buf[:n] = buf.index_select(0, active)
        self.s_done[n:bs] = True
        self.s_rowmap[n:bs] = self.rows
        self.s_start[n:bs] = 0
        self.s_pos[n:bs] = 0
