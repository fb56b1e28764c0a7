"""The Megatron backend's state surface for checkpoints and export: full tensors by HF name, and back.

Speaks ``tidal.checkpoint.store.TrainState`` and ``tidal.checkpoint.export.ExportSource`` over a
``MegatronTrainer``, so checkpoints are tidal's format (safetensors by HF names, loadable with any
TP/PP/DP layout and by the FSDP2 backend) and export is a plain HF folder. Parameters are the fp32
masters; AdamW's moments have their parameter's layout, so they go through the same weight source
(``MegatronTrainer.gather``: TP shards gathered, QKV and fc1 un-fused) and come back through the
same ``mapping.to_megatron``. A paused trainer reads host backups.

The distributed optimizer keeps moments as flat data-parallel shards, not per-parameter tensors;
its checkpoints are refused in one line for now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tidal.errors import UserError
from tidal.memory.base import StateClass
from tidal.trainer.megatron.mapping import to_megatron
from tidal.trainer.megatron.model import load_hf, stage_parameters

MOMENTS = ("exp_avg", "exp_avg_sq")


class MegatronState:
    def __init__(self, trainer):
        self.tr = trainer
        self.rank, self.world_size = trainer.rank, trainer.world_size
        self.model_name = trainer.model_cfg.model

    def _check(self) -> None:
        if self.tr.par.distributed_optimizer:
            raise UserError(
                "checkpoints with --use-distributed-optimizer are not supported by the megatron backend yet; "
                "drop --use-distributed-optimizer or --save/--load"
            )

    def _inner(self) -> dict[int, Any]:
        """Parameter identity -> the torch optimizer that owns it."""
        out = {}
        for opt in getattr(self.tr.optimizer, "chained_optimizers", [self.tr.optimizer]):
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    out[id(p)] = opt.optimizer
        return out

    def _params(self):
        t = self.tr
        return stage_parameters(t.stage, t.arch, pp_rank=t.pp_rank, pp_size=t.par.pp, te=t.te)

    # ---- collectives ---------------------------------------------------------------------------
    def barrier(self) -> None:
        self.tr.groups.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=self.tr.groups.host)
        return box[0]

    # ---- reading -------------------------------------------------------------------------------
    def model_state(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        return self.tr.gather(self.tr.local, None)

    def optimizer_state(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        self._check()
        inner = self._inner()
        params = self._params()
        if not all(inner[id(p)].state.get(p) for _, p in params):
            return  # no step taken yet (the same on every rank)
        for k in MOMENTS:
            local = {e.megatron: inner[id(p)].state[p][k] for e, p in params}
            for name, full in self.tr.gather(local, None):
                yield f"{name}/{k}", full

    def optimizer_steps(self) -> dict[str, float]:
        inner = self._inner()
        steps = [float(inner[id(p)].state[p]["step"]) for _, p in self._params() if inner[id(p)].state.get(p)]
        step = max(steps, default=None)
        if self.world_size > 1:
            step = max((s for s in self._all(step) if s is not None), default=None)
        return {} if step is None else dict.fromkeys(self.tr.hf_shapes, step)

    def _all(self, value):
        out = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.tr.groups.host)
        return out

    def schedule_state(self) -> dict:
        return self.tr.schedule.state_dict()

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.tr.hf_shapes)

    def hf_parts(self) -> tuple[Any, Any, Any]:
        return self.tr.hf_config, self.tr.generation_config, self.tr.tokenizer

    # ---- loading -------------------------------------------------------------------------------
    def load_model_state(self, get: Callable[[str], torch.Tensor]) -> None:
        t = self.tr
        load_hf(t.stage, t.arch, get, tp_rank=t.tp_rank, tp_size=t.par.tp, pp_rank=t.pp_rank, pp_size=t.par.pp, te=t.te)

    def load_optimizer_state(
        self, get: Callable[[str], torch.Tensor], names: set[str], steps: dict[str, float]
    ) -> None:
        self._check()
        t, inner = self.tr, self._inner()
        with torch.no_grad(), t.memory.region(StateClass.OPTIMIZER):
            for e, p in self._params():
                if f"{e.hf[0]}/exp_avg" not in names:
                    continue
                state = inner[id(p)].state[p]
                if not state:  # as AdamW's first step creates it
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for k in MOMENTS:
                        state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"].fill_(steps[e.hf[0]])
                for k in MOMENTS:
                    state[k].copy_(to_megatron(e, lambda n, k=k: get(f"{n}/{k}"), t.arch, t.tp_rank, t.par.tp))

    def load_schedule_state(self, state: dict) -> None:
        self.tr.schedule.load_state_dict(state)
