"""The pieces of one rollout's training that are not FSDP-specific: forward statistics, checks, metric sums.

``TrainerActor.train`` plans the rollout, runs the old-log-prob pass and the optimizer steps with
these. ``token_stats`` is the one model call of the trainer (log-probs, and the entropy from the
same pass over the logits); ``RolloutSums`` keeps every metric sum on the device until one transfer
at the end of the rollout, so the loop never waits for the device; ``rollout_metrics`` turns the
reduced sums into rank 0's metrics.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tidal.compile_cache import compile_seconds
from tidal.errors import UserError
from tidal.rollout.types import Sample
from tidal.trainer.microbatch import MicroBatch
from tidal.trainer.packing import oversized

log = logging.getLogger(__name__)

# Token-weighted loss terms summed per rollout (each micro-batch adds mean * response tokens).
LOSS_KEYS = ("pg_loss", "kl", "entropy", "clipfrac", "ratio_mean")
# SDPA's kernels for the trainer's model calls, in priority order: cuDNN's after flash and memory-efficient.
# cuDNN builds an execution graph for every new shape, forward and backward: ~120 ms a new sequence length on an
# H100 (docs/benchmarks.md, round seven), and a micro-batch's shape (its rows by its longest row) follows the
# responses' lengths, new at almost every micro-batch of a real run. Flash runs the same causal, maskless call
# with no per-shape set-up.
TRAIN_SDPA = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)


def token_stats(
    model,
    mb: MicroBatch,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    compile: bool = True,
    trained_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T-1] of ``mb``'s targets under ``model`` and, with ``entropy``, the entropy [B, T-1]
    from the same pass over the logits (``tidal.algos.logprobs.token_logprobs_and_entropy``;
    ``compile``: its compiled kernels where available).

    ``trained_only`` (``--trained-logits-only``): the LM head and the log-prob kernels run only at the
    positions the loss trains on (``mb.trained_positions``: the response mask), not at prompt,
    environment or pad positions, which every reader of these values masks out; they are 0 there.
    A forward pre-hook hands the head the hidden states of those rows ([N, H] instead of [B, T, H]),
    so whatever the model's own forward does after its head (a logit soft-cap, a scale) still runs.

    No attention mask: rows are right-padded, so causal attention already keeps every real token
    from seeing a pad and the positions of real tokens are 0, 1, ... either way; without a mask
    SDPA takes its causal kernel and transformers neither builds a [B, 1, T, T] mask nor reads
    the padding mask on the host. The log-probs of all T positions are computed on the whole
    (contiguous) logits, the last one against a pad and dropped: cheaper than flattening a
    ``[:, :-1]`` slice, which copies the logits.
    """
    from tidal.algos.logprobs import token_logprobs, token_logprobs_and_entropy

    if trained_only:
        return _trained_token_stats(model, mb, entropy, entropy_grad, compile)
    with model_call():
        logits = model(input_ids=mb.input_ids, use_cache=False).logits
    if entropy:
        logp, ent = token_logprobs_and_entropy(logits, mb.next_ids, with_entropy_grad=entropy_grad, compile=compile)
        return logp[:, :-1], ent[:, :-1]
    return token_logprobs(logits, mb.next_ids, compile=compile)[:, :-1], None


@contextlib.contextmanager
def model_call() -> Iterator[None]:
    """Where the trainer calls its model: transformers' packed-row check skipped (``unpacked_rows``) and SDPA's
    kernels tried in ``TRAIN_SDPA``'s order (the backward runs the kernel its forward chose)."""
    with unpacked_rows(), sdpa_kernel(list(TRAIN_SDPA), set_priority=True):
        yield


@contextlib.contextmanager
def unpacked_rows() -> Iterator[None]:
    """Model calls inside skip transformers' packed-sequence check. Without an attention mask transformers
    looks for several sequences packed into one row (positions that restart) and decides with a
    host-side ``.all()``: a wait for the device at every micro-batch. The trainer's rows are never
    packed (one right-padded sequence each, positions from 0), for which the check returns None: so
    does its stand-in."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a core dependency
        yield
        return
    check = getattr(masking_utils, "find_packed_sequence_indices", None)
    if check is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = _not_packed
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = check


def _not_packed(position_ids: torch.Tensor) -> None:
    return None


class _Rows(torch.autograd.Function):
    """Rows ``pos`` (distinct) of a 2-D tensor. The backward copies the gradient into zeros at ``pos``
    instead of ``index_select``'s accumulating ``index_add`` (atomic adds, for rows that cannot repeat)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pos)
        ctx.rows = x.shape[0]
        return x.index_select(0, pos)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (pos,) = ctx.saved_tensors
        return g.new_zeros((ctx.rows, *g.shape[1:])).index_copy_(0, pos, g), None


def _trained_token_stats(model, mb: MicroBatch, entropy: bool, entropy_grad: bool, compile: bool):
    """``token_stats`` with the head at ``mb.trained_positions`` only; the values spread back to [B, T-1]."""
    from tidal.algos.logprobs import token_logprobs, token_logprobs_and_entropy

    pos = mb.trained_positions

    def rows_only(_head, args):
        h = args[0]
        return (_Rows.apply(h.reshape(-1, h.shape[-1]), pos), *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(rows_only)
    try:
        with model_call():
            logits = model(input_ids=mb.input_ids, use_cache=False).logits
    finally:
        handle.remove()
    if logits.shape[:-1] != pos.shape:
        raise RuntimeError(
            f"--trained-logits-only: the model's logits are {tuple(logits.shape)} for {pos.numel()} trained "
            "positions (its forward reshapes the head's output); run with --no-trained-logits-only"
        )
    targets = mb.next_ids.reshape(-1).index_select(0, pos)
    if entropy:
        logp, ent = token_logprobs_and_entropy(logits, targets, with_entropy_grad=entropy_grad, compile=compile)
    else:
        logp, ent = token_logprobs(logits, targets, compile=compile), None
    b, t = mb.input_ids.shape

    def spread(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(b * t).index_copy(0, pos, x).view(b, t)[:, :-1]

    return spread(logp), (spread(ent) if ent is not None else None)


def check_samples(samples: list[Sample], *, vocab: int, model_name: str, max_tokens: int, warn: bool) -> bool:
    """Raise on token ids outside the vocabulary or a response without a prompt; log once (when ``warn``)
    about samples over the micro-batch budget. Returns whether it logged."""
    top = max((max(max(s.prompt_ids, default=0), max(s.response_ids, default=0)) for s in samples), default=0)
    if top >= vocab:
        raise UserError(
            f"token id {top} is outside the vocabulary ({vocab}) of --model {model_name}; "
            "pass a --tokenizer that belongs to the model"
        )
    for s in samples:
        if s.response_ids and not s.prompt_ids:
            raise ValueError(f"sample {s.index} has a response but no prompt tokens (at least a BOS is needed)")
        if s.loss_mask and (len(s.loss_mask) != len(s.response_ids) or any(m not in (0, 1) for m in s.loss_mask)):
            raise ValueError(
                f"sample {s.index} has a loss mask of {len(s.loss_mask)} entries for {len(s.response_ids)} response "
                "tokens; give one 0/1 per response token (or none)"
            )
    too_long = oversized([s.total_len for s in samples], max_tokens)
    if too_long and warn:
        log.warning(
            "%d sample(s) are longer than --max-tokens-per-gpu %d (longest %d tokens); each runs alone in a "
            "micro-batch over the budget. Raise --max-tokens-per-gpu if this runs out of memory.",
            len(too_long),
            max_tokens,
            max(samples[i].total_len for i in too_long),
        )
        return True
    return False


class RolloutSums:
    """Metric sums of one rollout on one rank: device tensors while training, host floats at the end.

    ``sums`` holds ``[loss_sum / global_norm, then mean * tokens of each LOSS_KEYS entry]`` added per
    micro-batch; the engine log-prob difference is a device sum with a host count; token counts are
    host integers (from the micro-batches' host copies).
    """

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(1 + len(LOSS_KEYS), dtype=torch.float32, device=device)
        self.lp_abs_diff = torch.zeros((), dtype=torch.float32, device=device)
        self.lp_count = 0
        self.response_tokens = 0
        self.tokens = 0
        self.grad_norms: list[torch.Tensor] = []

    def engine_diff(self, mb: MicroBatch, logprobs: torch.Tensor) -> None:
        """Add |trainer log-prob - engine log-prob| over the positions that have an engine log-prob."""
        if mb.num_engine_logprobs:
            diff = (logprobs.detach().float() - mb.engine_logprobs).abs()
            self.lp_abs_diff += torch.where(mb.has_engine_logprobs, diff, 0.0).sum()
            self.lp_count += mb.num_engine_logprobs

    def add_loss(self, mb: MicroBatch, metrics: dict, global_norm: float) -> None:
        n = mb.num_response_tokens
        self.response_tokens += n
        self.tokens += 0 if mb.empty else mb.tokens
        zero = metrics["loss_sum"].new_zeros(())
        self.sums += torch.stack(
            [metrics["loss_sum"] / global_norm, *(metrics[k] * n if k in metrics else zero for k in LOSS_KEYS)]
        )

    def add_grad_norm(self, grad_norm: torch.Tensor) -> None:
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.grad_norms.append(grad_norm.detach().float().reshape(()))

    def reduce(self, groups) -> tuple[dict[str, float], list[float]]:
        """The one device -> host transfer of the rollout, then a sum over ranks: the summed values by
        name and this rank's grad norms (equal on every rank after clipping's all-reduce)."""
        s = self.sums
        host = torch.cat([s, self.lp_abs_diff.reshape(1), *(g.to(s.device).reshape(1) for g in self.grad_norms)])
        host = host.tolist()
        n = len(s)
        values = [*host[:n], float(self.response_tokens), float(self.tokens), host[n], float(self.lp_count)]
        names = ("loss_sum", *LOSS_KEYS, "response_tokens", "tokens", "lp_abs_diff", "lp_count")
        return dict(zip(names, groups.all_reduce_host(values))), host[n + 1 :]


@dataclass
class RolloutClock:
    """Wall-clock seconds of one rollout's phases; ``train_s`` counts from ``start``, ``train_compile_s`` (the
    seconds of it spent in ``torch.compile``: a first step that compiles what the warm-up did not reach) from
    ``compiled``."""

    start: float = field(default_factory=time.perf_counter)
    compiled: float = field(default_factory=lambda: compile_seconds()[0])
    recompute_s: float = 0.0
    optimizer_s: float = 0.0
    lr: float = 0.0


def rollout_metrics(tr, sums: RolloutSums, objective, clock: RolloutClock, *, steps: int, recomputed: bool) -> dict:
    """Reduce one rollout's ``sums`` and ``objective`` metrics over the trainer's ranks (collective: every
    rank calls it), then rank 0's metrics (token-weighted means), ``{}`` elsewhere. ``tr`` is the
    backend rank (its ``groups``, ``rank``, ``ref_model``)."""
    red, grad_norms = sums.reduce(tr.groups)
    extra = objective.metrics(tr.groups)
    train_s = time.perf_counter() - clock.start
    recompute_s, optimizer_s, lr = clock.recompute_s, clock.optimizer_s, clock.lr
    if tr.rank != 0:
        return {}
    denom = max(red["response_tokens"], 1.0)
    out = {
        "loss": red["loss_sum"] / max(1, steps),
        "pg_loss": red["pg_loss"] / denom,
        "entropy": red["entropy"] / denom,
        "clipfrac": red["clipfrac"] / denom,
        "ratio_mean": red["ratio_mean"] / denom,
        "grad_norm": sum(grad_norms) / max(1, len(grad_norms)),
        "lr": lr,
        "tokens": red["tokens"],
        "response_tokens": red["response_tokens"],
        "optimizer_steps": steps,
        "tokens_per_s": red["tokens"] / train_s if train_s > 0 else 0.0,
        "train_s": train_s,
        "logprob_recompute_s": recompute_s,
        "logprob_recomputed": 1.0 if recomputed else 0.0,
        "optimizer_s": optimizer_s,
        "train_compile_s": compile_seconds()[0] - clock.compiled,
        "logprob_diff": red["lp_abs_diff"] / red["lp_count"] if red["lp_count"] else 0.0,
    }
    # Without a reference model there is no KL term; 0 keeps the metric schema the same.
    out["kl"] = red["kl"] / denom if tr.ref_model is not None else 0.0
    out.update(extra)
    return out
