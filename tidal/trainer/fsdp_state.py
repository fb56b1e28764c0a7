"""The FSDP2 trainer's state surface: full tensors out of its shards for checkpoints and export, and back in.

Implements ``tidal.checkpoint.store.TrainState`` and ``tidal.checkpoint.export.ExportSource`` over
the FSDP2 rank's parts (model, AdamW, schedule, process groups, memory backend). Reading goes
through the trainer's weight source (``tidal.trainer.weights.iter_full_tensors``: live shards when
ACTIVE, host backups when PAUSED), so a paused trainer saves without touching released device
memory. Loading slices each full tensor to this rank's rows (``scatter_rows``) and copies them into
the local shards; AdamW state that does not exist yet (no step taken) is created as AdamW's first
step would create it.

With PPO's critic (``tidal.trainer.critic``) the state also holds the critic's weights and AdamW
moments, under ``critic.``-prefixed names in the same files; export leaves it out (``critic=None``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tidal.memory.base import StateClass
from tidal.trainer.optim import MOMENTS, adamw_state
from tidal.trainer.weights import local_shard, scatter_rows

Gather = Callable[[list[tuple[str, torch.Tensor]], torch.dtype | None], Iterator[tuple[str, torch.Tensor | None]]]


def fsdp_modules(models) -> list:
    """Every FSDP2-wrapped module of ``models`` (None entries skipped)."""
    from torch.distributed.fsdp import FSDPModule

    return [x for m in models if m is not None for x in m.modules() if isinstance(x, FSDPModule)]


def reshard(models) -> None:
    """Free the unsharded compute copy a forward leaves on FSDP2 modules (the root keeps its own)."""
    for module in fsdp_modules(models):
        module.reshard()


class FSDPState:
    """One rank's view of the FSDP2 trainer's state; ``gather(named, dtype)`` is its weight source."""

    def __init__(
        self,
        *,
        rank,
        world_size,
        model_name,
        model,
        params,
        optimizer,
        schedule,
        groups,
        memory,
        tokenizer,
        gather: Gather,
        critic=None,
    ):
        self.rank, self.world_size, self.model_name = rank, world_size, model_name
        self.model, self.params, self.optimizer, self.schedule = model, params, optimizer, schedule
        self.groups, self.memory, self.tokenizer, self.gather = groups, memory, tokenizer, gather
        self.critic = critic

    def _parts(self) -> list[tuple[str, Any, list, Any]]:
        """(name prefix, model, trained params, optimizer) of the policy and, with PPO, the critic."""
        parts = [("", self.model, self.params, self.optimizer)]
        if self.critic is not None:
            from tidal.trainer.critic import PREFIX

            parts.append((PREFIX, self.critic.model, self.critic.params, self.critic.optimizer))
        return parts

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        return [(prefix + n, p) for prefix, model, _, _ in self._parts() for n, p in model.named_parameters()]

    # ---- collectives ---------------------------------------------------------------------------------
    def barrier(self) -> None:
        self.groups.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=self.groups.host)
        return box[0]

    # ---- reading -------------------------------------------------------------------------------------
    def _names(self) -> dict[int, str]:
        # named_parameters() lists tied weights once (HF names).
        return {id(p): n for n, p in self._named()}

    def _trained(self) -> list[tuple[torch.Tensor, Any]]:
        return [(p, opt) for _, _, params, opt in self._parts() for p in params]

    def model_state(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        return self.gather(self._named(), None)

    def optimizer_state(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        names, named = self._names(), []
        for p, opt in self._trained():
            state = opt.state.get(p, {})
            named += [(f"{names[id(p)]}/{k}", state[k]) for k in MOMENTS if k in state]
        return self.gather(named, None)

    def optimizer_steps(self) -> dict[str, float]:
        names = self._names()
        return {
            names[id(p)]: float(opt.state[p]["step"]) for p, opt in self._trained() if "step" in opt.state.get(p, {})
        }

    def schedule_state(self) -> dict:
        return self.schedule.state_dict()

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in self._named()}

    def hf_parts(self) -> tuple[Any, Any, Any]:
        return self.model.config, getattr(self.model, "generation_config", None), self.tokenizer

    # ---- loading -------------------------------------------------------------------------------------
    def load_model_state(self, get: Callable[[str], torch.Tensor]) -> None:
        reshard([m for _, m, _, _ in self._parts()])  # an unsharded compute copy would otherwise go stale
        with torch.no_grad():
            for name, p in self._named():
                local = local_shard(p)
                local.copy_(scatter_rows(get(name), self.rank, self.world_size).to(local.dtype))

    def load_optimizer_state(
        self, get: Callable[[str], torch.Tensor], names: set[str], steps: dict[str, float]
    ) -> None:
        param_names = self._names()
        with torch.no_grad(), self.memory.region(StateClass.OPTIMIZER):
            for p, opt in self._trained():
                name = param_names[id(p)]
                if f"{name}/exp_avg" not in names:
                    continue
                state = opt.state[p]
                if not state:  # the state AdamW creates on its first step, filled below
                    state.update(adamw_state(p, opt.defaults))
                state["step"].fill_(steps[name])
                for k in MOMENTS:
                    local = local_shard(state[k])
                    local.copy_(scatter_rows(get(f"{name}/{k}"), self.rank, self.world_size).to(local.dtype))

    def load_schedule_state(self, state: dict) -> None:
        self.schedule.load_state_dict(state)
        if self.critic is not None:
            self.critic.schedule.load_state_dict(state)  # the critic steps with the policy
