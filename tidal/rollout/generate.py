"""Generation helpers of the embedded engine: padding, policy log-probs, stop handling, chunking.

The engine samples with transformers ``generate``; these functions are the parts around it that
decide what a response *is*:

- ``left_pad``: prompts of different lengths share one batch, padded on the left so that every row's
  next token is in the last column.
- ``PolicyLogprobRecorder``: a logits processor that records the log-probability of each sampled
  token under the *raw* model distribution (temperature 1, no top-k/top-p). The trainer's ratio
  needs the policy's log-probs, not those of the processed ``scores`` that sampling used. It is
  handed to ``generate`` as the first processor of a fresh ``GenerationConfig`` with no penalties,
  so the logits it sees are the model's own (transformers appends temperature/top-k/top-p after
  custom processors). It keeps one ``[batch, vocab]`` tensor at a time; ``output_logits=True``
  would keep ``[batch, new_tokens, vocab]`` (80 GB of fp32 for 512 rows x 256 tokens at a 152k
  vocabulary), which is why it is not used for the log-probs.
- ``StopStrings``: ends a row once its response text contains a stop string.
- ``finish_response``: cuts a row after its first EOS / stop token / stop string (tokens after it
  are padding or sampled past the end) and assigns its status.
- ``Interrupt`` and ``extend_response``: a generate call the engine was asked to pause
  (``pause_generation``) stops at the next step; a row it cut short is ``aborted`` and keeps what it
  sampled, and a later call continues it from prompt + response so far with the budget left, each
  token's weight version recorded (``--partial-rollout``, docs/async.md).
- ``shared_prefill``: a rollout samples each prompt several times (a GRPO group); the rows of one
  prompt are identical, so their prompt's keys and values are computed once and copied to every
  row that repeats it, instead of once per row as ``generate`` alone would (n times fewer prefill
  tokens for groups of n). ``python -m tidal.bench.rollout --paths generate`` prints the engine's
  tokens/s next to plain ``generate`` on the same batch.
- ``teacher_forced_logprobs``: the same log-probs from one forward pass over prompt + response, as
  the trainer recomputes them; tests and the benchmark compare the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, StoppingCriteria

from tidal.errors import UserError
from tidal.rollout.types import Sample, SamplingParams


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of shape ``[rows, longest]`` with padding on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


class PolicyLogprobRecorder(LogitsProcessor):
    """Records ``log_softmax(raw logits)[sampled token]`` for every generated position.

    A processor sees the logits of step ``t`` before token ``t`` is sampled; the token shows up as
    the last column of ``input_ids`` at step ``t + 1``. So each call gathers the previous step's
    log-prob and keeps the current log-softmax; ``finish(sequences)`` gathers the last one.
    """

    def __init__(self) -> None:
        self._prev: torch.Tensor | None = None
        self._steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._prev is not None:
            self._steps.append(self._prev.gather(1, input_ids[:, -1:]).squeeze(1))
        self._prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """``[rows, new_tokens]`` log-probs of the generated tokens (the tail of ``sequences``)."""
        if self._prev is not None:
            self._steps.append(self._prev.gather(1, sequences[:, -1:]).squeeze(1))
            self._prev = None
        if not self._steps:
            return torch.zeros((sequences.shape[0], 0), dtype=torch.float32, device=sequences.device)
        return torch.stack(self._steps, dim=1)


class StopStrings(StoppingCriteria):
    """Marks a row done when the text of its last few response tokens contains a stop string.

    A new occurrence must end in the newest token, so decoding a short tail suffices; the window is
    wide enough for a stop string even when tokens decode to single bytes. ``finish_response`` later
    finds the exact token that completed it.
    """

    def __init__(self, stop: Sequence[str], tokenizer, prompt_width: int) -> None:
        self.stop = [s for s in stop if s]
        self.tokenizer = tokenizer
        self.prompt_width = prompt_width
        self.window = 4 * max(len(s) for s in self.stop) + 4

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        start = max(self.prompt_width, input_ids.shape[1] - self.window)
        tails = self.tokenizer.batch_decode(input_ids[:, start:].tolist(), skip_special_tokens=True)
        done = [any(s in t for s in self.stop) for t in tails]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@dataclass
class Finished:
    """One response after cutting: ids, log-probs, text and status (completed | truncated)."""

    ids: list[int]
    logprobs: list[float]
    text: str
    status: str


def finish_response(
    ids: Sequence[int], logprobs: Sequence[float], *, end_ids: Iterable[int], stop: Sequence[str], tokenizer
) -> Finished:
    """Cut a generated row after its first end token or stop string; status says which ended it.

    The end token and the stop string stay in the response: the policy sampled them, and the trainer
    must learn to emit them. A row that ran to ``max_new_tokens`` without either is ``truncated``.
    """
    ids = list(ids)
    end = first_of(ids, set(end_ids))
    cut, status = (len(ids), "truncated") if end is None else (end + 1, "completed")
    ids, logprobs = ids[:cut], logprobs[:cut]
    k = stop_prefix_len(ids, stop, tokenizer)
    if k is not None:
        ids, logprobs, status = ids[:k], logprobs[:k], "completed"
    text = decode_ids(tokenizer, ids)
    return Finished(ids=ids, logprobs=list(map(float, logprobs)), text=text, status=status)


def first_of(ids: list[int], wanted: set[int]) -> int | None:
    """The position of the first id of ``ids`` in ``wanted``, or None: list scans in C rather than a Python
    loop over every id (512 rows of 256 ids: ~1 ms against ~3 ms on a 2-core CPU; most rows hold none)."""
    if wanted.isdisjoint(ids):
        return None
    if len(wanted) > 8:
        return next(k for k, t in enumerate(ids) if t in wanted)
    best = len(ids)
    for t in wanted:
        try:
            best = ids.index(t, 0, best)
        except ValueError:
            pass
    return best


def decode_ids(tokenizer, ids: list[int]) -> str:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` of a list of ints, without its argument check.

    transformers' ``decode`` first converts its argument to Python objects, testing every id of a list in
    Python (``to_py_obj``), then calls the tokenizer's ``_decode``; for a list of ints that conversion is the
    identity and costs more than the decode itself (512 responses of 256 tokens: ~7 of ~16 ms on a 2-core
    CPU). Tokenizers without ``_decode`` (not transformers') go through ``decode``."""
    inner = getattr(tokenizer, "_decode", None)
    if inner is None:
        return tokenizer.decode(ids, skip_special_tokens=True)
    return inner(ids, skip_special_tokens=True)


def stop_prefix_len(ids: Sequence[int], stop: Sequence[str], tokenizer) -> int | None:
    """The length of the shortest prefix of ``ids`` whose text holds a stop string (the token that completed
    it is its last), or None when the whole text holds none. Found by bisection: a prefix whose text holds
    a stop string still holds it when it grows, so each step decodes one prefix instead of every one."""
    stop = [s for s in stop if s]

    def holds(k: int) -> bool:
        text = decode_ids(tokenizer, ids[:k])
        return any(s in text for s in stop)

    if not stop or not ids or not holds(len(ids)):
        return None
    lo, hi = 1, len(ids)  # holds(hi); the least k with holds(k)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
    return hi


def check_sampling(sampling: SamplingParams) -> None:
    """Reject sampling parameters that cannot work, with the fix in one line."""
    if sampling.max_new_tokens < 1:
        raise UserError(
            f"max_new_tokens={sampling.max_new_tokens}: must be at least 1; raise --rollout-max-response-len"
        )
    if sampling.temperature < 0:
        raise UserError(f"temperature={sampling.temperature}: must be >= 0 (0 is greedy); fix --rollout-temperature")
    if not 0 < sampling.top_p <= 1:
        raise UserError(f"top_p={sampling.top_p}: must be in (0, 1]; fix --rollout-top-p")
    if sampling.top_k < 0:
        raise UserError(f"top_k={sampling.top_k}: must be >= 0 (0 disables); fix --rollout-top-k")


@torch.no_grad()
def shared_prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor):
    """The KV cache of ``ids[:, :-1]`` for a left-padded batch whose rows repeat prompts, or None.

    Each distinct row runs through the model once; its cache rows are then indexed out to every row
    equal to it (``DynamicCache.batch_select_indices``). Positions follow the attention mask as in
    ``generate``, which then continues from this cache with the last prompt column, so the tokens
    and log-probs are those of a plain ``generate`` over the whole batch. None when no row repeats or
    the prompts are one column wide (nothing to share).
    """
    from transformers import DynamicCache

    if ids.shape[1] < 2:
        return None
    rows = [tuple(r) for r in torch.cat([ids, mask], dim=1).tolist()]
    first: dict[tuple, int] = {}
    index = [first.setdefault(r, len(first)) for r in rows]
    if len(first) == len(rows):
        return None
    seen: dict[int, int] = {}
    for row, u in enumerate(index):
        seen.setdefault(u, row)
    pick = torch.tensor([seen[u] for u in range(len(first))], device=ids.device)
    u_ids, u_mask = ids[pick, :-1], mask[pick, :-1]
    positions = (u_mask.long().cumsum(-1) - 1).masked_fill(u_mask == 0, 0)
    cache = DynamicCache(config=model.config)
    model(
        input_ids=u_ids,
        attention_mask=u_mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{cache_keyword(model): cache},
    )
    cache.batch_select_indices(torch.tensor(index, device=ids.device))
    return cache


def cache_keyword(model: torch.nn.Module) -> str:
    """The name ``forward`` and ``generate`` take a KV cache by: ``cache`` in newer transformers
    releases, ``past_key_values`` before (and deprecated after)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def teacher_forced_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    batch_bytes: int = 2 << 30,
) -> list[list[float]]:
    """Log-probs of each response token given its prompt, from forward passes without a cache.

    Rows are right-padded (the trainer's layout), so positions need no correction; the result is
    what a trainer recomputing old log-probs would get from the same weights. Rows go in batches
    whose fp32 logits stay under ``batch_bytes``.
    """
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    width_all = max((len(p) + len(r) for p, r in zip(prompts, responses)), default=1)
    batch_rows = max(1, batch_bytes // (2 * 4 * vocab * width_all))
    out: list[list[float]] = []
    for lo in range(0, len(prompts), batch_rows):
        ps, rs = prompts[lo : lo + batch_rows], responses[lo : lo + batch_rows]
        seqs = [list(p) + list(r) for p, r in zip(ps, rs)]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.as_tensor(s)
            mask[i, : len(s)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        del logits
        for i, (p, r) in enumerate(zip(ps, rs)):
            out.append(logp[i, len(p) - 1 : len(p) - 1 + len(r)].cpu().tolist())
    return out


class Interrupt(StoppingCriteria):
    """Ends every row at once when ``should_stop()`` answers True (the engine was asked to pause)."""

    def __init__(self, should_stop) -> None:
        self.should_stop = should_stop

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), bool(self.should_stop()), dtype=torch.bool, device=input_ids.device)


def unfinished(samples: Sequence[Sample]) -> list[Sample]:
    """The samples a generate call works on: new ones, and ones an earlier call left ``aborted``."""
    return [s for s in samples if s.status in ("pending", "aborted")]


def extend_response(
    sample: Sample,
    ids: Sequence[int],
    logprobs: Sequence[float],
    *,
    version: int,
    max_new_tokens: int,
    end_ids: Iterable[int],
    stop: Sequence[str],
    tokenizer,
) -> None:
    """Append one call's new tokens (sampled by weights ``version``) to ``sample``'s response so far.

    The whole response is cut again (``finish_response``; a stop string may span the two pieces). A
    row that neither ended nor reached ``max_new_tokens`` was cut short by a pause: ``aborted``.
    ``weight_version`` is the version of the first token (the oldest); ``response_versions`` holds
    one version per token once a response spans two or more (empty: every token is ``weight_version``'s).
    """
    before = sample.token_versions
    if not sample.response_ids:
        sample.weight_version = version
    done = finish_response(
        list(sample.response_ids) + list(ids),
        list(sample.response_logprobs) + list(logprobs),
        end_ids=end_ids,
        stop=stop,
        tokenizer=tokenizer,
    )
    if done.status == "truncated" and len(done.ids) < max_new_tokens:
        done.status = "aborted"
    versions = (before + [version] * len(ids))[: len(done.ids)]
    sample.response_ids, sample.response_logprobs, sample.response_text, sample.status = (
        done.ids,
        done.logprobs,
        done.text,
        done.status,
    )
    sample.response_versions = versions if len(set(versions)) > 1 else []
