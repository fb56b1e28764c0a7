"""``/generate`` in SGLang's shapes: request -> prompts x sampling parameters -> engine steps -> one object per output.

Input: ``text`` or ``input_ids``, one prompt or a batch; ``sampling_params`` one dict for all or a
list (one per prompt); ``n`` samples per prompt. Output: one object for a single prompt with
``n == 1``, else a list ordered prompt by prompt (the ``n`` samples of prompt 0 first). Each object:
``text``, ``output_ids``, ``meta_info`` with ``id``, ``finish_reason`` (SGLang's:
``{"type": "stop", "matched": <token id or stop string>}``, ``{"type": "length", "length": N}``,
``{"type": "abort", "message": ...}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
``weight_version``, ``e2e_latency``, and with ``return_logprob`` ``output_token_logprobs`` as
``[[logprob, token_id, text or null], ...]`` (text with ``return_text_in_logprobs``). The log-probs
are the raw policy's (temperature 1, no top-k/top-p), what an RL trainer needs as old log-probs.
tidal adds ``engine_step`` and ``engine_step_requests``: which engine step served the output and
how many requests that step held.

As in SGLang, ``output_ids`` keep the token that ended the response (EOS or a stop token) and
``text`` is cut before a matched stop string unless ``no_stop_trim`` is set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import uuid

from tidal.errors import UserError
from tidal.rollout.types import Sample, SamplingParams
from tidal.serve.batcher import GenerateResult
from tidal.serve.protocol import (
    UNSUPPORTED_REQUEST,
    UNSUPPORTED_SAMPLING,
    GenerateReqInput,
    SamplingParamsIn,
    present_unsupported,
)


def _prompts(req: GenerateReqInput, tokenizer) -> tuple[list[list[int]], bool]:
    """(token ids per prompt, whether the request was a batch)."""
    if (req.text is None) == (req.input_ids is None):
        raise UserError("give exactly one of text or input_ids")
    if req.text is not None:
        batch = isinstance(req.text, list)
        texts = req.text if batch else [req.text]
        ids = [tokenizer(t)["input_ids"] for t in texts]
    else:
        batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        ids = req.input_ids if batch else [req.input_ids]
    if not ids:
        raise UserError("the batch is empty; send at least one prompt")
    for i, p in enumerate(ids):
        if not p:
            raise UserError(f"prompt {i} is empty (no tokens); every prompt needs at least one token")
    return [list(p) for p in ids], batch


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != count:
            raise UserError(
                f"{name} is a list of {len(value)} for {count} prompts; give one per prompt or a single value"
            )
        return value
    return [value] * count


def to_sampling(sp: SamplingParamsIn, vocab: int) -> SamplingParams:
    bad = present_unsupported(sp, UNSUPPORTED_SAMPLING)
    if bad:
        raise UserError(f"sampling_params.{bad[0]} is not supported by tidal serve; leave it unset")
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    ids = list(sp.stop_token_ids or [])
    for t in ids:
        if not 0 <= t < vocab:
            raise UserError(f"stop_token_ids: {t} is not a token id of this model (vocabulary {vocab})")
    if sp.top_k < -1 or sp.top_k == 0:
        raise UserError(f"top_k={sp.top_k}: use -1 (off) or a positive number")
    return SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=0 if sp.top_k == -1 else sp.top_k,
        max_new_tokens=sp.max_new_tokens,
        stop=stop,
        stop_token_ids=ids,
        seed=sp.sampling_seed,
    )


ABORTED = {"type": "abort", "message": "generation was paused with mode abort"}


def finish_reason(s: Sample, sampling: SamplingParams, end_ids: list[int]) -> dict:
    if s.status in ("aborted", "pending"):  # cut short (or never started) by an abort pause
        return dict(ABORTED)
    if s.status == "truncated":
        return {"type": "length", "length": sampling.max_new_tokens}
    if s.response_ids and s.response_ids[-1] in set(end_ids) | set(sampling.stop_token_ids):
        return {"type": "stop", "matched": s.response_ids[-1]}
    for stop in sampling.stop:
        if stop and stop in s.response_text:
            return {"type": "stop", "matched": stop}
    return {"type": "stop", "matched": None}


def trim_stop(text: str, stop: list[str]) -> str:
    cuts = [text.find(s) for s in stop if s and s in text]
    return text[: min(cuts)] if cuts else text


@dataclasses.dataclass
class RequestTiming:
    """Where one ``/generate`` request spent its time in the server, on ``time.monotonic()`` (one clock for
    every process of the host, so a client on the same host can put its own times next to these)."""

    rid: str
    arrived: float  # the handler got the request (its body not read yet)
    queued: float = 0.0  # body parsed and checked, rows handed to the engine thread
    step: int = -1  # engine step that served it (-1: aborted before it ran)
    started: float = 0.0  # that step's engine call began / ended
    ended: float = 0.0
    resumed: float = 0.0  # the handler ran again after the step (the event loop had turns for others first)
    rendered: float = 0.0  # the reply's JSON bytes are ready to send


class GenerateHandler:
    def __init__(self, server) -> None:
        self.server = server

    async def __call__(self, req: GenerateReqInput, timing: RequestTiming | None = None) -> dict | list:
        """The reply object(s); ``timing`` (when given) gets the queue and step times filled in."""
        t0 = time.perf_counter()
        bad = present_unsupported(req, UNSUPPORTED_REQUEST)
        if bad:
            raise UserError(f"{bad[0]} is not supported by tidal serve (text-only models)")
        if req.stream:
            raise UserError("stream=true is not supported by tidal serve; send stream=false")
        nums = req.top_logprobs_num if isinstance(req.top_logprobs_num, list) else [req.top_logprobs_num]
        if any(k > 0 for k in nums):
            raise UserError(
                "top_logprobs_num > 0 is not supported: the engine records the sampled token's log-prob only"
            )
        engine = self.server.engine
        prompts, batch = _prompts(req, engine.tokenizer)
        count = len(prompts)
        params = _per_prompt(req.sampling_params or SamplingParamsIn(), count, "sampling_params")
        logprob = _per_prompt(req.return_logprob, count, "return_logprob")
        rids = _per_prompt(req.rid, count, "rid") if req.rid is not None else [uuid.uuid4().hex for _ in prompts]
        vocab = self.server.vocab_size
        for i, p in enumerate(prompts):
            if min(p) < 0 or max(p) >= vocab:
                raise UserError(f"prompt {i} holds token ids outside the vocabulary of {vocab}")
        sampling = [to_sampling(sp, vocab) for sp in params]
        if timing is not None:
            timing.rid, timing.queued = rids[0], time.monotonic()
        # Queued here and now, not from a task a turn later, so the engine sees a burst once its last request
        # is parsed; one request of one prompt (a rollout's usual shape) awaits its future without a gather.
        futures = [
            self.server.worker.submit_generate([p] * sp.n, s, eager=batch)
            for p, sp, s in zip(prompts, params, sampling)
        ]
        results: list[GenerateResult] = [await futures[0]] if len(futures) == 1 else await asyncio.gather(*futures)
        latency = time.perf_counter() - t0
        ran = [r.step for r in results if r.step is not None]
        if timing is not None:
            timing.resumed = time.monotonic()
            if ran:
                timing.step, timing.started, timing.ended = ran[0].step, ran[0].started, max(i.ended for i in ran)
        out = []
        for i, res in enumerate(results):
            for j in range(params[i].n):
                rid = rids[i] if params[i].n == 1 else f"{rids[i]}-{j}"
                out.append(self._one(res, j, rid, prompts[i], params[i], sampling[i], logprob[i], req, latency))
        return out if batch or len(out) > 1 else out[0]

    def _one(self, res: GenerateResult, j, rid, prompt, sp: SamplingParamsIn, sampling, want_lp, req, latency) -> dict:
        version = self.server.weight_version
        s = res.samples[j]
        tok = self.server.engine.tokenizer
        text = s.response_text
        if not sp.skip_special_tokens:
            text = tok.decode(s.response_ids, skip_special_tokens=False)
        if not (sp.model_extra or {}).get("no_stop_trim"):
            text = trim_stop(text, sampling.stop)
        meta = {
            "id": rid,
            "finish_reason": finish_reason(s, sampling, self.server.end_ids),
            "prompt_tokens": len(prompt),
            "completion_tokens": len(s.response_ids),
            "cached_tokens": 0,
            "weight_version": version,
            "e2e_latency": latency,
            "engine_step": res.step.step if res.step is not None else -1,  # -1: aborted before it ran
            "engine_step_requests": res.step.requests if res.step is not None else 0,
        }
        if want_lp:
            texts = [tok.decode([t]) for t in s.response_ids] if req.return_text_in_logprobs else itertools.repeat(None)
            # Tuples render as JSON arrays; zip builds them without a Python loop per token.
            meta["output_token_logprobs"] = list(zip(s.response_logprobs, s.response_ids, texts))
        return {"text": text, "output_ids": s.response_ids, "meta_info": meta}
