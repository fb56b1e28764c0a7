"""The embedded rollout engine: a copy of the policy inside the engine actor, sampled with transformers.

The engine builds its model with ``tidal.model`` from the same spec and seed as the trainer (fp32 on
CPU, bf16 on CUDA), so both start from the same weights; after that only weight syncs change it.
``generate`` sorts rows by prompt length, cuts them into chunks whose size bounds KV-cache and logits
memory, and runs each chunk through ``_generate_chunk``, the one place that runs the model: the fast
decode path (``tidal.rollout.fast``: static KV cache, on-device sampling, CUDA graphs) when it is on
and supports the model, else transformers ``generate`` over a left-padded batch with a logits
processor that records each sampled token's log-prob under the raw policy (``tidal.rollout.generate``).
Responses are cut after EOS / stop tokens / stop strings and marked ``completed`` or ``truncated``.

Why padded ``generate`` and not transformers' continuous batching (``generate_batch``) as the
transformers path: padded ``generate`` is faster on CPU. ``python -m tidal.bench.rollout --with-cb
--paths generate`` measures both in one run (``hf_generate_tokens_per_s`` vs
``cb_generate_batch_tokens_per_s``); on the 2-core CPU machine, fp32:

    tiny preset, 256 rows x 16 prompt x 16 new, 1 thread           generate 3815 tok/s   generate_batch   52 tok/s
    tiny preset, 256 rows x 16 prompt x 4 new, 2 threads           generate 1316 tok/s   generate_batch  646 tok/s
    qwen2.5-0.5b-shape, 8 rows x 16 prompt x 8 new, 1 thread       generate  5.2 tok/s   generate_batch  2.0 tok/s

(the first and last on a machine busy with other work, which hurts continuous batching's scheduler
thread most). An RL rollout is one fixed batch sampled together, which is what padded ``generate``
is made for; continuous batching pays per-step scheduling to interleave arriving requests, and its
log-probs are taken after temperature/top-k/top-p, so they would need a second forward pass to
become policy log-probs.

Memory: weights and the KV cache are released and resumed through the memory backend
(``tidal.memory.make_backend``, engine policy: both discarded). The order is kv_cache then weights on
release, weights then kv_cache on resume, as slime does: the weight sync lands between the two
resumes so the peak is weights + sync buffers, never + KV. ``EngineResidency`` refuses generating
with anything released and syncing into released weights, before any memory is touched.

Weights: taking syncs, loading tensors by name and checksums are ``EngineWeights``
(``tidal.rollout.embedded_weights``), the mixin this engine is built on.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from tidal.config.schema import (
    MemoryConfig,
    ModelConfig,
    RolloutConfig,
    TrainerConfig,
    WeightSyncConfig,
    init_on_device_default,
)
from tidal.dtypes import as_dtype, default_dtype
from tidal.errors import ResidencyError, UserError
from tidal.memory import make_backend
from tidal.memory.base import MemoryFigures, StateClass
from tidal.memory.residency import EngineResidency, EngineState
from tidal.model import build_model, load_tokenizer, resolve_model
from tidal.model.load import preset_init_device
from tidal.rollout.embedded_weights import EngineWeights
from tidal.rollout.engine import TAGS
from tidal.rollout.generate import (
    Interrupt,
    PolicyLogprobRecorder,
    StopStrings,
    cache_keyword,
    check_sampling,
    extend_response,
    left_pad,
    shared_prefill,
    unfinished,
)
from tidal.rollout.types import DecodeStats, Sample, SamplingParams, WarmUpReport

log = logging.getLogger(__name__)

# Seeds of different engines must differ, or two engines given the same seed sample the same streams.
_RANK_SEED_STRIDE = 7919


def _buffers_out_of_region(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Give every buffer (and tensor attribute aliasing one) its own copy on ``device``, outside any paused region.

    A backend that pauses by region (torch_memory_saver) releases everything allocated inside the
    ``weights`` region without a host copy, and a weight sync restores only parameters. A buffer
    such as the rotary ``inv_freq`` left in that region comes back as whatever the fresh pages hold
    (zeros, usually), and the engine then samples from a different policy than the trainer's. Moved
    out here, buffers are never released: they are a few KB.
    """
    with torch.no_grad():
        for module in model.modules():
            moved: dict[int, torch.Tensor] = {}
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    moved[id(buf)] = module._buffers[name] = buf.to(device, copy=True)
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and id(value) in moved:
                    setattr(module, name, moved[id(value)])  # e.g. rotary ``original_inv_freq``
    return model


class EmbeddedEngine(EngineWeights):
    """A transformers model that generates, releases/resumes its memory and takes weight syncs.

    The in-process half of the embedded engine: ``tidal.rollout.actor.EngineActor`` wraps it behind
    the typed ``tidal.rollout.engine.RolloutEngine`` interface (this class returns plain stats dicts).

    ``seed`` is the model-init seed and must equal the trainer's (``--seed``); ``max_rows`` caps the
    rows of one ``generate`` call and ``chunk_bytes`` bounds the memory one chunk may use (default:
    1 GiB on CPU, half the free device memory on CUDA).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        rollout: RolloutConfig,
        memory: MemoryConfig,
        weight_sync: WeightSyncConfig | None = None,
        *,
        device: str = "cpu",
        engine_rank: int = 0,
        seed: int = TrainerConfig.seed,
        dtype: str | torch.dtype | None = None,
        max_rows: int = 1024,
        chunk_bytes: int | None = None,
    ) -> None:
        self.rollout = rollout
        self.model_cfg = model_cfg
        self.weight_sync_cfg = weight_sync if weight_sync is not None else WeightSyncConfig()
        self.device = torch.device(device)
        self.engine_rank = engine_rank
        if dtype is None:
            dtype = default_dtype(self.device.type)
        self.dtype = as_dtype(dtype)
        self.max_rows = max_rows
        self.chunk_bytes = chunk_bytes
        self.spec = resolve_model(model_cfg.model, model_cfg.tokenizer, model_cfg.trust_remote_code)
        self.tokenizer = load_tokenizer(self.spec)
        self.residency = EngineResidency(f"engine {engine_rank}")
        self.backend = make_backend(memory, device=self.device.type, role="engine")
        self.last_memory: MemoryFigures | None = None  # process memory after the last release / resume
        self._fast_decoder = None  # built on first generate (tidal.rollout.fast.plug)
        t_build = time.perf_counter()
        self.model = self._build(seed)
        self.build_s = time.perf_counter() - t_build
        self.model.requires_grad_(False)
        # Every name a sender may use, tied aliases included (lm_head.weight -> the embedding).
        self._params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters(remove_duplicate=False))
        # Only parameters are released: non-persistent buffers (rotary inv_freq) are not synced, so
        # discarding them would lose them for good; they are a few KB.
        self.backend.register(StateClass.WEIGHTS, lambda: list(self.model.parameters()))
        self._version = -1
        self._receiver = None
        self._custom_generate = None
        if rollout.custom_generate_function_path:
            from tidal.rollout.plugins import load_callable

            self._custom_generate = load_callable(
                rollout.custom_generate_function_path, "--custom-generate-function-path"
            )
        self._end_ids = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self._end_ids[0]
        # A neutral generation config: a pretrained folder's generation_config.json (repetition
        # penalty, top_k=20, ...) would otherwise fill every field SamplingParams leaves unset.
        self.model.generation_config = GenerationConfig(
            bos_token_id=self.tokenizer.bos_token_id, eos_token_id=self._end_ids or None, pad_token_id=self._pad_id
        )
        self._calls = 0
        self._generate_s = 0.0  # seconds in generate_default since the last take_decode_stats
        self._flushed_version: int | None = None
        # Set by pause_generation (from another thread, beside a running generate): the call stops at its next
        # step boundary and rows it cut short come back aborted; continue_generation clears it.
        self.paused = threading.Event()
        # Everything alive now lives for the whole run: freezing it out of the collector keeps each
        # flush's gc.collect() to what was created since (hundreds of ms -> ms with transformers loaded).
        gc.collect()
        gc.freeze()

    def _build(self, seed: int) -> torch.nn.Module:
        """The policy in the engine dtype on the engine device, its weights allocated as class ``weights``.

        A preset is initialised exactly as the trainer initialises it (fp32, from ``seed``, on the
        host or with ``--init-on-device`` on the device, as the trainer does) and only then cast:
        drawing the init in bf16 would give different numbers. Only parameters are cast, each into
        the weights region (the fp32 model built on the device is a temporary); buffers such as the
        rotary ``inv_freq`` keep their fp32 precision.
        """
        if not self.spec.is_preset:
            with self.backend.region(StateClass.WEIGHTS):
                model = build_model(self.spec, dtype=self.dtype, seed=seed, device=self.device).eval()
            return _buffers_out_of_region(model, self.device)
        on_device = self.model_cfg.init_on_device
        on_device = init_on_device_default(self.device.type) if on_device is None else on_device
        init_device = preset_init_device(self.spec, self.device, on_device)
        model = build_model(self.spec, dtype=torch.float32, seed=seed, device=init_device).eval()
        if self.dtype == torch.float32 and self.device.type == "cpu":
            return model
        with torch.no_grad(), self.backend.region(StateClass.WEIGHTS):
            for p in model.parameters():
                p.data = p.data.to(device=self.device, dtype=self.dtype, copy=True)
        model.config.dtype = self.dtype
        if init_device.type == "cuda":
            torch.cuda.empty_cache()  # the fp32 temporaries' blocks
        return _buffers_out_of_region(model, self.device)

    # ------------------------------------------------------------------ generation

    def generate(self, samples: list[Sample], sampling: SamplingParams, on_done=None) -> list[Sample]:
        self.residency.require_generate()
        check_sampling(sampling)
        if not samples:
            return []
        if self._custom_generate is not None:
            return self._check_custom(self._custom_generate(self, samples, sampling), len(samples))
        return self.generate_default(samples, sampling, on_done)

    def _check_custom(self, out: Any, expected: int) -> list[Sample]:
        """A custom generate function's result must be as complete as the built-in one's."""
        where = f"--custom-generate-function-path {self.rollout.custom_generate_function_path}"
        if not isinstance(out, list) or len(out) != expected:
            got = f"{len(out)} items" if isinstance(out, list) else type(out).__name__
            raise UserError(f"{where}: returned {got}, expected the list of {expected} samples it was given")
        # A pause (--partial-rollout) cuts the generate_default a custom function calls: its rows come back
        # aborted with the tokens so far (and their versions), to be continued by a later call.
        statuses = ("completed", "truncated", "aborted") if self.paused.is_set() else ("completed", "truncated")
        for s in out:
            if len(s.response_logprobs) != len(s.response_ids) or s.status not in statuses:
                raise UserError(
                    f"{where}: sample {s.index} has {len(s.response_ids)} response ids, {len(s.response_logprobs)} "
                    f"log-probs and status {s.status!r}; fill one log-prob per token (0.0 where loss_mask is 0) "
                    "and status completed or truncated"
                )
            if s.loss_mask and len(s.loss_mask) != len(s.response_ids):
                raise UserError(
                    f"{where}: sample {s.index} has {len(s.loss_mask)} loss-mask entries for {len(s.response_ids)} "
                    "response ids; give one 0/1 per response token (0: supplied by the environment), or none"
                )
            if s.weight_version < 0:  # generate_default set it (its first token's version) where it ran
                s.weight_version = self._version
        return out

    def generate_default(self, samples: list[Sample], sampling: SamplingParams, on_done=None) -> list[Sample]:
        """The built-in generate step (a custom generate function may call it for its inner sampling).

        ``on_done(samples)``: called from inside the call with samples whose responses are final before the
        call returns (the fast path hands rows that ended on at its host syncs; the others are final when
        the call returns)."""
        self.residency.require_generate()
        t0 = time.perf_counter()
        limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        for s in samples:
            if not s.prompt_ids:
                raise UserError(f"sample {s.index} has an empty prompt; every prompt needs at least one token")
            if limit is not None and len(s.prompt_ids) + sampling.max_new_tokens > limit:
                raise UserError(
                    f"sample {s.index}: prompt of {len(s.prompt_ids)} tokens + {sampling.max_new_tokens} new tokens exceeds "
                    f"the model's {limit} positions; lower --rollout-max-prompt-len or --rollout-max-response-len"
                )
        seed = sampling.seed if sampling.seed is not None else self.rollout.rollout_seed + self._calls
        self._calls += 1
        torch.manual_seed(seed + _RANK_SEED_STRIDE * self.engine_rank)
        end_ids = list(dict.fromkeys(self._end_ids + list(sampling.stop_token_ids)))
        todo = unfinished(samples)  # new rows, and rows a paused call cut short (continued from where they were)
        # Similar lengths share a chunk so that little of it is padding.
        order = sorted(range(len(todo)), key=lambda i: todo[i].total_len)
        rows = self._rows_per_chunk(max(s.total_len for s in todo), sampling.max_new_tokens, end_ids) if todo else 1
        extend = functools.partial(
            extend_response,
            version=self._version,
            max_new_tokens=sampling.max_new_tokens,
            end_ids=end_ids,
            stop=sampling.stop,
            tokenizer=self.tokenizer,
        )
        for lo in range(0, len(order), rows):
            part = [todo[i] for i in order[lo : lo + rows]]
            limits = [sampling.max_new_tokens - len(s.response_ids) for s in part]
            early: set[int] = set()  # rows of the chunk handed on before it returned

            def rows_done(ended, results, part=part, limits=limits, early=early):
                for j, (ids, lps, _) in zip(ended, results):
                    extend(part[j], ids[: limits[j]], lps[: limits[j]])
                    early.add(j)
                on_done([part[j] for j in ended])

            if self.paused.is_set():  # asked to pause: rows not started stay aborted, with what they have
                new_ids, logprobs = [[] for _ in part], [[] for _ in part]
            else:
                contexts = [list(s.prompt_ids) + list(s.response_ids) for s in part]
                hook = rows_done if on_done is not None else None
                new_ids, logprobs = self._generate_chunk(contexts, sampling, end_ids, limits, hook)
            for j, (s, ids, lps, limit) in enumerate(zip(part, new_ids, logprobs, limits)):
                if j not in early:
                    extend(s, ids[:limit], lps[:limit])
        if self._calls == 1:
            # The first call compiled and captured the decode step: its graphs, guards and caches live
            # for the whole run, so they leave the collector too (else every flush walks them: ~0.2 s).
            gc.collect()
            gc.freeze()
        self._generate_s += time.perf_counter() - t0
        return samples

    def take_decode_stats(self) -> DecodeStats:
        """The fast decoder's stats of every generate call since the last ask (zeros without the fast path)."""
        from tidal.rollout.fast.plug import OFF

        dec = self._fast_decoder
        if dec is None or dec == OFF:
            return DecodeStats()
        out = dec.take_totals()
        out.engine_s, self._generate_s = self._generate_s, 0.0
        return out

    def warm_up(self, rows: int, sampling: SamplingParams) -> WarmUpReport:
        """Compile and capture the decode step a first ``generate`` of ``rows`` samples would (``--warm-up``).

        One fast-decode call of two new tokens at as many rows as that call's first wave (``_rows_per_chunk``
        at the longest prompt, the decoder's rows) and ``sampling``'s mode: the step is compiled and its graph
        captured for that batch bucket, and the prefill (two distinct prompts) compiled where it runs through
        the compiled pieces. Nothing of it reaches later calls: the prompts are pad tokens, no
        stop id can end a row before its step, the call count that seeds each call is unchanged, and a graph
        captured here restores the device RNG as a capture inside the call would. Later batch buckets (rows
        that end early) are still captured when reached. Nothing to warm: the fast path is off (transformers
        generate compiles nothing). Where the step is neither compiled nor captured (CPU) the call only runs it."""
        from tidal.rollout.fast.plug import OFF

        start = WarmUpReport.start()
        self.residency.require_generate()
        dec = self._decoder()
        if dec == OFF or rows < 1:
            return WarmUpReport()
        prompt_len = max(2, min(self.rollout.rollout_max_prompt_len, 8))
        n = min(rows, self._rows_per_chunk(self.rollout.rollout_max_prompt_len, sampling.max_new_tokens, []))
        warm = dataclasses.replace(sampling, max_new_tokens=2, stop=[], stop_token_ids=[])
        # Two distinct prompts (lengths prompt_len and prompt_len - 1): a compiled prefill then sees a token count
        # (rows by width) it may not specialise on, as a rollout's prefill of many distinct prompts will, and that
        # the pieces' graph shares with the decode steps (tidal.rollout.fast.fused).
        prompts = [[self._pad_id] * (prompt_len - i % 2) for i in range(n)]
        self._generate_chunk(prompts, warm, [], [2] * n)
        stats = dec.last_stats
        dec.take_totals()  # the first rollout's decode/* metrics are its own
        if dec.prefixes is not None:
            dec.prefixes.clear()  # the pad prompts are no prefix of anything real
        gc.collect()
        gc.freeze()  # the compiled step's objects live for the whole run (see generate_default)
        return WarmUpReport.since(
            start,
            warmed=["decode step"],
            rows=min(n, dec.rows),
            graph_captures=int(stats.get("graph_captures", 0)),
            capture_s=float(stats.get("capture_s", 0.0)),
        )

    def _rows_per_chunk(self, prompt_len: int, new_tokens: int, end_ids: Sequence[int]) -> int:
        """Rows of one ``_generate_chunk`` call.

        The fast decoder (when it takes the call) sized its KV cache once, from ``--rollout-mem-fraction``: a
        chunk is one wave of the rows that cache holds. Sizing it by the device's free memory instead would
        split a call into a full wave and a small one whenever the trainer holds more memory at that moment:
        a second wave of decode steps and a new CUDA graph for its batch size. For transformers ``generate``:
        the rows whose KV cache, prefill activations and per-step logits fit the chunk budget."""
        from tidal.rollout.fast.plug import wave_rows

        wave = wave_rows(self._decoder(), end_ids)
        if wave is not None:
            return max(1, min(self.max_rows, wave))
        cfg = self.model.config.get_text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        elem = torch.finfo(self.dtype).bits // 8
        kv = 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem * (prompt_len + new_tokens)
        prefill = prompt_len * (cfg.hidden_size * 4 + getattr(cfg, "intermediate_size", 4 * cfg.hidden_size) * 3) * elem
        logits = 3 * cfg.vocab_size * 4  # fp32 logits, their log-softmax, the sampling probabilities
        budget = self.chunk_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = free // 2
            else:
                budget = 1 << 30
        return int(max(1, min(self.max_rows, budget // (kv + prefill + logits))))

    def _decoder(self):
        """The fast decoder this engine owns, built on first use (``tidal.rollout.fast.plug.OFF`` when unused)."""
        if self._fast_decoder is None:
            from tidal.rollout.fast.plug import build_decoder

            self._fast_decoder = build_decoder(
                self.model,
                self.rollout,
                device_type=self.device.type,
                pad_id=self._pad_id,
                backend=self.backend,
                name=self.residency.name,
            )
        return self._fast_decoder

    @torch.no_grad()
    def _generate_chunk(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        end_ids: list[int],
        limits: Sequence[int] | None = None,
        on_rows_done=None,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one chunk: new token ids (padded past the end) and their policy log-probs, per row.

        ``limits``: new tokens per row (default ``sampling.max_new_tokens``; the generate path samples
        up to the largest, the caller cuts). A ``pause_generation`` stops the chunk at its next step
        boundary with the tokens so far. ``on_rows_done``: the fast path hands it the rows that ended at
        each host sync (``fast_generate_chunk``). The only place that runs the model for generation; a
        faster decoding path replaces this.
        """
        # Fast decode path (tidal.rollout.fast): static KV cache, on-device sampling, CUDA graphs.
        from tidal.rollout.fast.plug import fast_generate_chunk

        fast = fast_generate_chunk(
            self._decoder(), prompts, sampling, end_ids, limits, self.paused.is_set, on_rows_done
        )
        if fast is not None:
            return fast
        if limits is not None:
            sampling = dataclasses.replace(sampling, max_new_tokens=max(limits))
        ids, mask = left_pad(prompts, self._pad_id, self.device)
        greedy = sampling.temperature == 0
        # Greedy decoding takes no sampling knobs (transformers warns about them when given).
        knobs = (
            {}
            if greedy
            else dict(temperature=float(sampling.temperature), top_k=int(sampling.top_k), top_p=float(sampling.top_p))
        )
        config = GenerationConfig(
            do_sample=not greedy,
            **knobs,
            max_new_tokens=int(sampling.max_new_tokens),
            min_new_tokens=0,
            eos_token_id=end_ids or None,
            pad_token_id=self._pad_id,
            bos_token_id=self.tokenizer.bos_token_id,
            repetition_penalty=1.0,
            num_beams=1,
            use_cache=True,
            return_dict_in_generate=True,
        )
        recorder = PolicyLogprobRecorder()
        stopping = StoppingCriteriaList([Interrupt(self.paused.is_set)])
        if any(sampling.stop):
            stopping.append(StopStrings(sampling.stop, self.tokenizer, prompt_width=ids.shape[1]))
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=config,
            logits_processor=LogitsProcessorList([recorder]),
            stopping_criteria=stopping,
            **{cache_keyword(self.model): shared_prefill(self.model, ids, mask)},  # a group's prompt prefilled once
        )
        new = out.sequences[:, ids.shape[1] :]
        logprobs = recorder.finish(out.sequences)
        return new.cpu().tolist(), logprobs.cpu().tolist()

    def pause_generation(self) -> None:
        """SGLang's ``pause_generation`` in ``abort`` mode: a running call returns at its next step boundary,
        rows it cut short ``aborted`` with the tokens they have, and calls made while paused return at once."""
        self.paused.set()

    def continue_generation(self) -> None:
        self.paused.clear()

    def flush_cache(self) -> None:
        """Drop the stored prefixes of multi-turn requests, then on CUDA ``gc.collect()`` and
        ``torch.cuda.empty_cache()``, returning the caching allocator's free blocks to the driver
        (before a release or a sync).

        The only KV contents that outlive a ``generate`` call are the fast path's stored prompt
        prefixes (``--rollout-prefix-cache-mb``, ``tidal.rollout.fast.prefix``); they were computed
        with the weights before the sync, so they go (as SGLang's flush drops its radix cache). The
        generate path allocates its cache per call; the fast path zeroes its static cache per call.
        """
        dec = self._fast_decoder
        if dec is not None and not isinstance(dec, str) and dec.prefixes is not None:
            dec.prefixes.clear()
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ memory

    def release_memory(self, tags: Sequence[str] = TAGS) -> dict:
        """Flush the cache, then release kv_cache and weights (whichever are resident) in that order.

        The state machine has one sleeping state, so a release must cover everything still resident;
        a class released earlier (kv_cache while WEIGHTS_ONLY) is skipped, never paused twice.
        """
        wanted = self._tags(tags)
        resident = self._resident()
        left = [t for t in resident if t not in wanted]
        if left:
            raise ResidencyError(
                f"{self.residency.name}: release_memory({list(tags)}) would leave {left} resident while "
                f"{self.residency.state.value}; release {list(resident)} together"
            )
        self.residency.release()
        self.flush_cache()
        report = self.backend.pause([StateClass(t) for t in ("kv_cache", "weights") if t in resident])
        self.last_memory = report.after
        return {**report.metrics("memory/engine_release"), "residency": self.residency.state.value}

    def resume_memory(self, tags: Sequence[str] = TAGS) -> dict:
        """Resume weights (ASLEEP -> WEIGHTS_ONLY) and/or the KV cache (WEIGHTS_ONLY -> AWAKE), in that order.

        Resumed weights hold undefined bytes: generation is refused until a sync rewrote them.
        """
        wanted = self._tags(tags)
        classes = []
        if "weights" in wanted:
            self.residency.resume_weights()
            classes.append(StateClass.WEIGHTS)
        if "kv_cache" in wanted:
            self.residency.resume_kv()
            classes.append(StateClass.KV_CACHE)
        report = self.backend.resume(classes)
        self.last_memory = report.after
        return {**report.metrics("memory/engine_resume"), "residency": self.residency.state.value}

    def _resident(self) -> list[str]:
        state = self.residency.state
        return {EngineState.AWAKE: ["kv_cache", "weights"], EngineState.WEIGHTS_ONLY: ["weights"]}.get(state, [])

    @staticmethod
    def _tags(tags: Sequence[str]) -> set[str]:
        if isinstance(tags, str):
            tags = [tags]
        unknown = [t for t in tags if t not in TAGS]
        if unknown or not tags:
            raise ValueError(f"memory tags {list(tags)}: engine tags are {list(TAGS)}")
        return set(tags)
