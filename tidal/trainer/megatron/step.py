"""One rollout of the Megatron backend: old log-probs, optimizer steps through Megatron's schedule, metrics.

The same stages as the FSDP2 backend's ``train`` (``docs/trainer.md``), over this data-parallel
rank's micro-batches. Differences, all from Megatron's schedule and layout:

- every micro-batch's loss is computed on the last pipeline stage, on each TP rank (the loss is
  replicated there), so metric sums count only TP rank 0 of the last stage (``trainer.reports``);
- the schedule divides each micro-batch's loss by the number of micro-batches and DDP averages
  gradients over data-parallel ranks, so the token-mean normaliser handed to ``rl_loss`` is
  ``global_norm / (dp * micro_batches)``: the gradient is then exactly that of
  ``sum over the global batch / global_norm``, as in FSDP2;
- log-probs and entropy come from vocabulary-sharded logits (``tidal.trainer.megatron.vocab``); with
  TP = 1 from the FSDP2 backend's own fused kernel (``tidal.algos.logprobs``).
"""

from __future__ import annotations

import time

import torch

from tidal.trainer.megatron.memory import optimizer_tensors
from tidal.trainer.microbatch import MicroBatch
from tidal.trainer.step import RolloutClock, rollout_metrics


def token_stats(tr, logits, mb: MicroBatch, width: int, *, entropy: bool = False, entropy_grad: bool = False):
    """Log-probs [B, T-1] (and the entropy) of ``mb``'s targets from this rank's logits [B, T', V/tp]."""
    if logits.shape[1] != width:
        logits = logits[:, :width].contiguous()  # sequence-parallel padding
    if tr.par.tp == 1:
        from tidal.algos.logprobs import token_logprobs, token_logprobs_and_entropy

        compile = tr.cfg.compile_logprobs
        if entropy:
            lp, ent = token_logprobs_and_entropy(logits, mb.next_ids, with_entropy_grad=entropy_grad, compile=compile)
            return lp[:, :-1], ent[:, :-1]
        return token_logprobs(logits, mb.next_ids, compile=compile)[:, :-1], None
    from megatron.core import parallel_state as ps

    from tidal.trainer.megatron.vocab import chunked_vocab_parallel_stats

    per = logits.shape[-1]
    lp, ent = chunked_vocab_parallel_stats(
        logits,
        mb.next_ids,
        vocab_start=tr.tp_rank * per,
        vocab_size=tr.arch.vocab_size,
        group=ps.get_tensor_model_parallel_group(),
    )
    if not entropy:
        return lp[:, :-1], None
    return lp[:, :-1], (ent if entropy_grad else ent.detach())[:, :-1]


def old_logprobs(tr, steps, sums, objective, *, recompute: bool) -> None:
    """Old (when ``recompute``) and reference log-probs of every micro-batch, before any update, in no_grad."""
    from tidal.trainer.megatron.trainer import schedule_call

    def set_old(mb, logits, width):
        old = token_stats(tr, logits, mb, width)[0].float()
        sums.engine_diff(mb, old)
        objective.prepare(mb, old)
        return old.new_zeros(()), {}

    def set_ref(mb, logits, width):
        mb.ref_logprobs = token_stats(tr, logits, mb, width)[0].float()
        return mb.ref_logprobs.new_zeros(()), {}

    with torch.no_grad():
        for mbs in steps:
            if recompute:
                schedule_call(tr, tr.ddp, mbs, set_old, forward_only=True)
            if tr.ref_model is not None:
                schedule_call(tr, tr.ref_model, mbs, set_ref, forward_only=True)
    if tr.device.type == "cuda":
        torch.cuda.synchronize(tr.device)


def optimizer_step(tr, mbs: list[MicroBatch], sums, objective, old_from_train_pass: bool) -> tuple[float, float]:
    """One optimizer step over this replica's micro-batches; returns (seconds in optimizer.step, lr)."""
    from tidal.algos.losses import loss_normalizer
    from tidal.trainer.megatron.trainer import schedule_call

    agg = tr.algo.loss_agg_mode
    entropy_grad = tr.algo.entropy_coef != 0.0
    local = sum(float(loss_normalizer(mb.host_mask, agg)) for mb in mbs)  # host tensors: no sync
    (total,) = tr.groups.all_reduce_host([local])
    replicas = tr.par.tp * tr.par.pp * tr.par.cp  # ranks of one replica hold the same micro-batches
    global_norm = max(total / replicas, 1.0)
    normalizer = global_norm / (tr.topo.dp * len(mbs))

    def loss_fn(mb, logits, width):
        logprobs, ent = token_stats(tr, logits, mb, width, entropy=True, entropy_grad=entropy_grad)
        if old_from_train_pass:
            old = logprobs.detach().float()
            sums.engine_diff(mb, old)
            objective.prepare(mb, old)
        loss, m = objective.loss(mb, logprobs, ent, normalizer)
        sums.add_loss(mb, m, global_norm)
        return loss, {}

    tr.ddp.zero_grad_buffer()  # undefined after a pause without backup; zeroed before every step anyway
    tr.optimizer.zero_grad()
    # Gradients land in the DDP buffers (already in the GRADS region); autograd's per-parameter
    # grads are transient, added into them by DDP's hooks and dropped.
    schedule_call(tr, tr.ddp, mbs, loss_fn, forward_only=False)
    lr = tr.schedule.apply(tr.optimizer)
    t0 = time.perf_counter()
    _, grad_norm, _ = tr.optimizer.step()  # outside any region: its temporaries are not backed up
    tr.optimizer_home.adopt(optimizer_tensors(tr.optimizer))  # state the first step created
    step_s = time.perf_counter() - t0
    tr.schedule.advance()
    sums.add_grad_norm(torch.tensor(float(grad_norm or 0.0), device=tr.device))
    return step_s, lr


def _silence(sums, objective) -> None:
    """Zero a non-reporting rank's metric sums (TP peers and earlier stages would count them again)."""
    sums.sums.zero_()
    sums.lp_abs_diff.zero_()
    sums.lp_count = sums.response_tokens = sums.tokens = 0
    objective.sums.zero_()
    objective.extremes.fill_(float("-inf"))


def train_rollout(tr, samples, rollout_id: int) -> dict:
    """One rollout on every rank; rank 0 returns the metrics (the FSDP2 backend's keys)."""
    clock = RolloutClock()
    steps = tr.plan(samples)
    tr.stage.train()
    old_from_train_pass = len(steps) == 1 and not tr.cfg.recompute_logprobs
    sums, objective = tr.new_sums()
    old_logprobs(tr, steps, sums, objective, recompute=not old_from_train_pass)
    clock.recompute_s = time.perf_counter() - clock.start
    for mbs in steps:
        step_s, clock.lr = optimizer_step(tr, mbs, sums, objective, old_from_train_pass)
        clock.optimizer_s += step_s
    if not tr.reports:
        _silence(sums, objective)
    tr.last_rollout_id = rollout_id
    return rollout_metrics(tr, sums, objective, clock, steps=len(steps), recomputed=not old_from_train_pass)
