"""The Megatron backend's state surface for checkpoints and export: full tensors by HF name, and back.

Speaks ``tidal.checkpoint.store.TrainState`` and ``tidal.checkpoint.export.ExportSource`` over a
``MegatronTrainer``, so checkpoints are tidal's format (safetensors by HF names, loadable with any
TP/PP/DP layout and by the FSDP2 backend) and export is a plain HF folder. Parameters are the fp32
masters; AdamW's moments have their parameter's layout, so they go through the same weight source
(``MegatronTrainer.gather``: TP shards gathered, QKV and fc1 un-fused) and come back through the
same ``mapping.to_megatron``. A paused trainer reads host backups.

With ``--use-distributed-optimizer`` the moments are flat data-parallel shards: this rank's range of
each parameter (``_get_model_param_range_map``). Saving puts each rank's range into a zero tensor of the
parameter's shape and sums them over the data-parallel (gloo) group, which rebuilds the whole moment
on every replica; loading slices each rank's range back out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tidal.memory.base import StateClass
from tidal.trainer.megatron.mapping import to_megatron
from tidal.trainer.megatron.model import load_hf, stage_parameters
from tidal.trainer.optim import MOMENTS


class MegatronState:
    def __init__(self, trainer):
        self.tr = trainer
        self.rank, self.world_size = trainer.rank, trainer.world_size
        self.model_name = trainer.model_cfg.model

    def _slots(self) -> list[tuple[Any, torch.nn.Parameter, Any, torch.Tensor | None, tuple[int, int] | None]]:
        t = self.tr
        return self._slots_of(stage_parameters(t.stage, t.arch, pp_rank=t.pp_rank, pp_size=t.par.pp, te=t.te))

    def _slots_of(
        self, params
    ) -> list[tuple[Any, torch.nn.Parameter, Any, torch.Tensor | None, tuple[int, int] | None]]:
        """Per mapped parameter of this stage: (entry, parameter, its torch optimizer, the tensor its optimizer
        state is keyed by, and with the distributed optimizer this rank's flat range of it). A parameter
        outside this data-parallel rank's shard has no optimizer (None), and with the distributed optimizer an
        empty range (its moments come from the other ranks)."""
        by_id: dict[int, tuple] = {}
        opts = getattr(self.tr.optimizer, "chained_optimizers", [self.tr.optimizer])
        outside = (None, None, (0, 0)) if any(hasattr(o, "shard_fp32_groups") for o in opts) else (None, None, None)
        for opt in opts:
            if hasattr(opt, "shard_fp32_groups"):  # the distributed optimizer: state keyed by shard views
                for models, shards in zip(opt.model_fp32_groups, opt.shard_fp32_groups):
                    for mp, sp in zip(models, shards):
                        r = opt._get_model_param_range_map(mp)["param"]
                        by_id[id(mp)] = (opt.optimizer, sp, (r.start, r.end))
            else:
                for group in opt.optimizer.param_groups:
                    for p in group["params"]:
                        by_id[id(p)] = (opt.optimizer, p, None)
        return [(e, p, *by_id.get(id(p), outside)) for e, p in params]

    def _tied_copy(self):
        """PP > 1 with tied embeddings: the last stage's output layer (a copy of the embedding Megatron keeps
        equal: same gradients, so the same AdamW state), as a slot that loads from the embedding's tensors."""
        from tidal.trainer.megatron.mapping import Entry

        out = dict(self.tr.stage.named_parameters()).get("output_layer.weight")
        if not (self.tr.arch.tied and out is not None):
            return []
        entry = Entry("output_layer.weight", ("model.embed_tokens.weight",), "vocab")
        return self._slots_of([(entry, out)])

    def _moment(self, p, inner, key, rng, k: str) -> torch.Tensor:
        """Moment ``k`` of ``p`` in the parameter's own (TP-shard) shape; with the distributed optimizer rebuilt
        on the host from every data-parallel rank's range (collective over the data-parallel gloo group)."""
        if rng is None:
            return inner.state[key][k]
        from tidal.weight_sync.stream import to_host

        full = torch.zeros(p.numel(), dtype=torch.float32)
        if inner is not None and inner.state.get(key):
            full[rng[0] : rng[1]] = to_host(self.tr.read(inner.state[key][k]), torch.float32).reshape(-1)
        if self.tr.topo.dp > 1:
            dist.all_reduce(full, group=self.tr.parallel_groups.dp_gloo)
        return full.view(p.shape)

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
        if not self.optimizer_steps():
            return  # no step taken yet (decided alike on every rank)
        slots = self._slots()
        for k in MOMENTS:
            local = {e.megatron: self._moment(p, inner, key, rng, k) for e, p, inner, key, rng in slots}
            # Distributed: already host tensors assembled here, read as they are.
            read = (lambda t: t) if any(rng is not None for *_, rng in slots) else None
            for name, full in self.tr.gather(local, None, read=read):
                yield f"{name}/{k}", full

    def optimizer_steps(self) -> dict[str, float]:
        steps = [
            float(inner.state[key]["step"]) for _, _, inner, key, _ in self._slots() if inner and inner.state.get(key)
        ]
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
        t = self.tr
        with torch.no_grad(), t.memory.region(StateClass.OPTIMIZER):
            for e, _, inner, key, rng in self._slots() + self._tied_copy():
                if inner is None or f"{e.hf[0]}/exp_avg" not in names:
                    continue
                state = inner.state[key]
                if not state:  # as AdamW's first step creates it
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for k in MOMENTS:
                        state[k] = torch.zeros_like(key, memory_format=torch.preserve_format)
                state["step"].fill_(steps[e.hf[0]])
                for k in MOMENTS:
                    full = to_megatron(e, lambda n, k=k: get(f"{n}/{k}"), t.arch, t.tp_rank, t.par.tp)
                    piece = full if rng is None else full.reshape(-1)[rng[0] : rng[1]]
                    state[k].copy_(piece.reshape(state[k].shape))

    def load_schedule_state(self, state: dict) -> None:
        self.tr.schedule.load_state_dict(state)
