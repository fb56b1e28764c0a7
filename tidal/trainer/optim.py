"""AdamW and gradient clipping for the FSDP2 trainer's DTensor parameters, without DTensor's per-tensor dispatch.

``build_adamw`` picks AdamW's kernels (``--adamw-impl``: fused on CUDA, foreach on CPU) and returns a
``ShardAdamW``, whose steps run on the parameters' local shards; ``clip_one_rank`` is
``clip_grad_norm_`` on one rank's local gradients. Both do what torch does over DTensors, bit for bit
(``tests/unit/test_trainer.py``), for a fraction of the host time: going through DTensor costs its
dispatch over every one of the model's tensors (290 for Qwen2.5-0.5B), after the device has finished
the backward, so the device waits for it.
"""

from __future__ import annotations

import torch


def build_adamw(params: list, cfg, device_type: str) -> torch.optim.AdamW:
    """AdamW over ``params`` with ``cfg``'s (a ``TrainerConfig``) rate, betas, eps and decay, and its kernels
    (``--adamw-impl``; auto: fused on CUDA, foreach on CPU).

    foreach runs one kernel per operation over all tensors, on CPU too (torch picks it only for CUDA
    tensors; the per-tensor loop cost the default CPU run 8.2 ms a step against 2.9). fused runs the
    whole update as one kernel over every tensor, reading each parameter, gradient and moment once
    (foreach's seven operations pass over them about three times as often); its step counters live on
    the device. FSDP2's DTensor parameters take either (DTensor shards the fused op like any
    element-wise one).
    """
    kw = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    impl = cfg.adamw_impl if cfg.adamw_impl != "auto" else ("fused" if device_type == "cuda" else "foreach")
    return ShardAdamW(params, **kw, **{impl: True})


def clip_one_rank(params: list, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm) for FSDP2 parameters on one rank, on the gradients' local
    tensors (there, the whole gradients): the same operations in the same order, without DTensor's
    dispatch over every tensor twice. Returns the total norm before clipping."""
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter tensors; its "step" counter is kept apart


def adamw_state(p: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    """``p``'s AdamW state as torch's AdamW creates it at its first step (its lazy state initialisation), for a
    param group (or an optimizer's ``defaults``) ``group``: zero moments like the parameter (a DTensor for a
    DTensor), the step counter on the device with fused or capturable kernels, else a host scalar."""
    from torch.optim.optimizer import _get_scalar_dtype

    fused = bool(group.get("fused"))
    if fused or group.get("capturable"):
        step = torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
    else:
        step = torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
    moments = {k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in MOMENTS}
    return {"step": step, **moments}


class ShardAdamW(torch.optim.AdamW):
    """AdamW whose steps update FSDP2's DTensor parameters through their local shards.

    AdamW is element-wise, so each rank updating its own shards of the parameters, gradients and
    moments is the update DTensor would make; going through DTensor instead costs its dispatch over
    every tensor of the one fused (or foreach) call, tens of milliseconds of host time a step for a
    model of 290 tensors, after the device has finished the backward. The first step costs far more
    there (DTensor works out each operation's sharding for every new list of tensors: 0.18 s of a 0.4 s
    first train call of the tiny model on the CPU), so it too runs on the shards, after creating the
    moments as torch's first step does (``adamw_state``: DTensors, for checkpoints and the memory backend).
    Any configuration this does not cover (amsgrad, maximize, capturable, a closure) runs torch's own
    step. The state is torch's: saving, loading and ``zero_grad`` are unchanged.
    """

    @torch.no_grad()
    def step(self, closure=None):
        plain = closure is not None or any(
            g["amsgrad"] or g["maximize"] or g.get("capturable") or g.get("differentiable") for g in self.param_groups
        )
        if plain:
            return super().step(closure)
        from torch.optim.adamw import adamw

        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and not self.state.get(p):
                    self.state[p].update(adamw_state(p, g))

        def local(t):  # a DTensor's local shard without to_local()'s autograd wrapper, or the tensor itself
            return getattr(t, "_local_tensor", t)

        for g in self.param_groups:
            live = [p for p in g["params"] if p.grad is not None]
            states = [self.state[p] for p in live]
            adamw(
                [local(p) for p in live],
                [local(p.grad) for p in live],
                [local(s["exp_avg"]) for s in states],
                [local(s["exp_avg_sq"]) for s in states],
                [],
                [s["step"] for s in states],
                foreach=g["foreach"],
                fused=g["fused"],
                amsgrad=False,
                beta1=g["betas"][0],
                beta2=g["betas"][1],
                lr=g["lr"],
                weight_decay=g["weight_decay"],
                eps=g["eps"],
                maximize=False,
            )
        return None

    @torch.no_grad()
    def warm_up(self) -> None:
        """The first step's one-time work done ahead of it, changing nothing: the moments created as that step
        would (``adamw_state``), then one step at a learning rate of zero over the present gradients, which must
        be zero (the trainer's warm-up passes: a loss times zero), so that its kernels and allocations are in
        place; the step counters are set back to zero after it. With zero gradients and moments every term
        of AdamW's update is zero and the decoupled decay multiplies by exactly one, so the parameters and the
        moments come out bit for bit as they went in, and the next step is the first one's. Once any state
        exists (a step was taken, or a checkpoint loaded) it does nothing: a step at rate zero would decay
        the moments."""
        if any(self.state.get(p) for g in self.param_groups for p in g["params"]):
            return
        rates = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = g["lr"] * 0
        try:
            self.step()
        finally:
            for g, lr in zip(self.param_groups, rates, strict=True):
                g["lr"] = lr
        for state in self.state.values():
            state["step"].zero_()
