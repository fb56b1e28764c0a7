"""The Megatron-core trainer rank (``--train-backend megatron``): TP/PP/DP GPT stages behind the ``Trainer`` interface.

One ``MegatronTrainer`` per GPU, built and called like the FSDP2 backend (``tidal.trainer.base``).
``init`` starts one process group with two backends (gloo for host tensors, NCCL for device
tensors; Megatron's groups inherit both), Megatron's parallel state (``--tensor-model-parallel-size``,
``--pipeline-model-parallel-size``, ``--context-parallel-size``), builds this rank's ``GPTModel``
stage from the same seeded Hugging Face model the engines build (``tidal.trainer.megatron.model``),
wraps it in Megatron's ``DistributedDataParallel`` (fp32 main grads in its buffers; reduce-scatter
with ``--use-distributed-optimizer``) and builds Megatron's optimizer (AdamW over the fp32
parameters, global-norm clipping across TP/PP, ZeRO-1 with the distributed optimizer).

Per rollout, ``train`` does what the FSDP2 backend does, with the same pieces: the rollout plan
over the data-parallel ranks (``tidal.trainer.packing``), ``MicroBatch``, ``RolloutObjective``
(``tidal.algos``' losses, estimators and corrections) and ``RolloutSums``. Micro-batches run
through Megatron's pipeline schedule (``get_forward_backward_func``), forward under bf16 autocast.
Log-probs and the entropy come from the vocabulary-sharded logits without gathering the vocabulary
(``tidal.trainer.megatron.vocab``; with TP = 1 the same fused kernel as FSDP2's). The loss handed to
the schedule is scaled so that, after the schedule's division by the number of micro-batches and
DDP's average over data-parallel ranks, each micro-batch contributes its share of the token mean
over the whole global batch.

Memory: see ``tidal.trainer.megatron.memory`` (parameters and optimizer state backed up, gradient
buffers in a region without backup under ``--offload-train``); Megatron's process groups are
destroyed at a pause and rebuilt at the resume (``tidal.trainer.megatron.groups``).
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Iterator

import torch

from tidal.dtypes import as_dtype, default_dtype_name
from tidal.errors import UserError
from tidal.memory.base import StateClass
from tidal.memory.home import Adopter, rehome
from tidal.memory.telemetry import device_used_bytes
from tidal.rollout.types import Sample
from tidal.trainer.base import Trainer
from tidal.trainer.groups import place
from tidal.trainer.megatron import mapping
from tidal.trainer.megatron import model as mm
from tidal.trainer.megatron.groups import MegatronGroups
from tidal.trainer.megatron.memory import grad_buffers, optimizer_tensors, param_buffer_holders
from tidal.trainer.megatron.state import MegatronState
from tidal.trainer.megatron.weights import Topology, iter_hf_weights, shard_shapes
from tidal.trainer.microbatch import MicroBatch
from tidal.trainer.objective import RolloutObjective
from tidal.trainer.packing import plan_rollout
from tidal.trainer.schedule import LRSchedule
from tidal.trainer.step import RolloutSums, check_samples

CPU_REFUSAL = (
    "--train-backend megatron needs CUDA (Megatron-core's forward and DistributedDataParallel run on GPUs only); "
    "use --train-backend fsdp on CPU"
)


class MegatronTrainer(Trainer):
    """One rank of the Megatron-core trainer; see the module docstring and ``docs/trainer.md``."""

    def __init__(self, *args, release_process_groups: bool | None = None, **kwargs):
        """The arguments of ``Trainer.__init__``, and ``release_process_groups``: destroy Megatron's process
        groups at a pause and rebuild them at the resume (default: on CUDA, where NCCL communicators hold
        device memory; the CPU tests turn it on over gloo to run the same path)."""
        super().__init__(*args, **kwargs)
        self.release_groups = (self.device_type == "cuda") if release_process_groups is None else release_process_groups
        # The seed's rule: under --offload-train gradient buffers are paused without a host backup.
        derived = self.memory_cfg.disable_grad_buffers_cpu_backup
        self.grads_unbacked = self.offload if derived is None else bool(derived)

    # ---- setup -------------------------------------------------------------------------------------
    def init(self) -> dict:
        """Process groups, parallel state, GPT stage(s) loaded from the HF weights, DDP, optimizer, memory."""
        if self.device_type != "cuda":
            raise UserError(CPU_REFUSAL)
        mm.require_megatron()
        t0 = time.perf_counter()
        self._place()
        self._parallel_state()
        self.build()
        return self._sizes(time.perf_counter() - t0)

    def build(self) -> None:
        """Everything after the process groups: the HF model from the shared seed, this rank's stage(s) loaded
        from it, DDP, the optimizer, the memory backend and its registrations. Runs on ``self.device``
        (the CPU tests call it over gloo, with Megatron's hard-coded CUDA device arguments redirected)."""
        from tidal.memory import make_backend
        from tidal.memory.history import MemoryHistory
        from tidal.model.load import build_model, load_tokenizer, resolve_model

        if self.algo.use_critic:
            raise UserError(
                "--advantage-estimator ppo trains a critic, which --train-backend megatron does not have; use --train-backend fsdp"
            )
        device = self.device.type
        self._history = MemoryHistory(self.memory_cfg, device, f"trainer-rank{self.rank}")
        self.spec = resolve_model(self.model_cfg.model, self.model_cfg.tokenizer, self.model_cfg.trust_remote_code)
        self.model_path = self.spec.path
        self.tokenizer = load_tokenizer(self.spec)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        # Drawn where the FSDP2 backend and the engines draw it (--init-on-device), so all start from the same weights.
        hf = build_model(self.spec, dtype=torch.float32, seed=self.cfg.seed, device=self._init_device())
        self.hf_config, self.generation_config = hf.config, getattr(hf, "generation_config", None)
        self.arch = mapping.arch_from_hf(hf.config)
        mapping.check_parallel(self.arch, self.par.tp, self.par.pp)
        full = {n: p.detach() for n, p in hf.named_parameters()}
        self.hf_shapes = {n: tuple(t.shape) for n, t in full.items()}
        param_dtype = self.cfg.param_dtype if self.cfg.param_dtype != "auto" else default_dtype_name(device)
        self.compute_dtype = as_dtype(param_dtype)
        self.te = mm.choose_transformer_impl(self.cfg.transformer_impl) == "transformer_engine"
        self.memory = make_backend(self.memory_cfg, device=device, role="trainer", offload_train=self.grads_unbacked)
        with self.memory.region(StateClass.WEIGHTS):
            self.stage = self._build_stage(full)
            if self.algo.use_kl_loss:
                self.ref_model = self._build_stage(full)
                self.ref_model.requires_grad_(False)
        del hf, full
        # DDP allocates its gradient buffers (and, with the distributed optimizer, parameter buffers)
        # as it is built: build it inside GRADS, then move the parameter buffers to WEIGHTS.
        with self.memory.region(StateClass.GRADS):
            self.ddp = self._wrap_ddp(self.stage)
        self.grad_bytes = sum(g.untyped_storage().nbytes() for g in grad_buffers(self.ddp))
        self.weights_rehomed = rehome(param_buffer_holders(self.ddp), lambda: self.memory.region(StateClass.WEIGHTS))
        with self.memory.region(StateClass.OPTIMIZER):
            self._optimizer_and_schedule()
        self.optimizer_home = Adopter(lambda: self.memory.region(StateClass.OPTIMIZER))
        self._register()
        self.local = dict(self.stage.named_parameters())
        self.shapes = shard_shapes(self.local, self.topo, self.groups.host)
        gc.collect()
        gc.freeze()

    def _sizes(self, init_s: float) -> dict:
        local_bytes = sum(p.numel() * p.element_size() for p in self.stage.parameters())
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "num_params": sum(int(torch.tensor(s).prod()) for s in self.hf_shapes.values()),
            "local_param_bytes": local_bytes,
            "grad_buffer_bytes": self.grad_bytes,
            "param_dtype": str(self.compute_dtype).removeprefix("torch."),
            "use_kl_loss": self.ref_model is not None,
            "critic_params": 0,
            "layer_spec": "transformer_engine" if self.te else "local",
            "parallel": {"tp": self.par.tp, "pp": self.par.pp, "cp": self.par.cp, "dp": self.topo.dp},
            "grad_buffers_cpu_backup": not self.grads_unbacked,
            "init_s": init_s,
        }

    def _place(self) -> None:
        """This rank's device and the default process group: gloo for host tensors (counts, metrics, weight
        gathers), NCCL for device tensors on CUDA; Megatron's groups are created from it."""
        backend = "cpu:gloo,cuda:nccl" if self.device_type == "cuda" else "gloo"
        self.device, self.groups = place(self, separate_compute_group=False, world_backend=backend, mesh=False)

    def _parallel_state(self) -> None:
        """Megatron's parallel state over the initialised process group, and this rank's place in it."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        self.par = mm.Parallel.from_trainer(self.cfg)
        model_ranks = self.par.tp * self.par.pp * self.par.cp
        if self.world_size % model_ranks:
            raise UserError(
                f"{self.world_size} trainer ranks do not split into tensor {self.par.tp} x pipeline {self.par.pp} x "
                f"context {self.par.cp} parallel groups; use sizes whose product divides the trainer ranks"
            )
        self.parallel_groups = MegatronGroups(tp=self.par.tp, pp=self.par.pp, cp=self.par.cp, device=self.device.type)
        self.parallel_groups.initialize()
        if self.device.type == "cuda":
            model_parallel_cuda_manual_seed(self.cfg.seed)
        self.topo = Topology(
            rank=self.rank, tp=self.par.tp, cp=self.par.cp, dp=self.world_size // model_ranks, pp=self.par.pp
        )
        self.tp_rank, _, self.dp_rank, self.pp_rank = self.topo.coords()
        if (self.tp_rank, self.pp_rank) != (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()):
            raise RuntimeError(
                "Megatron's rank order differs from tidal's (tp-cp-dp-pp); the weight source would be wrong"
            )
        # Metrics are counted once per model replica: on TP rank 0 of the last stage.
        self.reports = self.tp_rank == 0 and self.pp_rank == self.par.pp - 1

    def _build_stage(self, full: dict[str, torch.Tensor]):
        config = mm.transformer_config(
            self.arch,
            self.par,
            recompute=self.cfg.gradient_checkpointing,
            autocast=self.compute_dtype != torch.float32,
        )
        spec = mm.layer_spec(self.arch, self.te)
        stage = mm.build_stage(self.arch, config, spec, tp=self.par.tp, pp_rank=self.pp_rank, pp_size=self.par.pp)
        stage.to(self.device)
        mm.load_hf(
            stage,
            self.arch,
            full.__getitem__,
            tp_rank=self.tp_rank,
            tp_size=self.par.tp,
            pp_rank=self.pp_rank,
            pp_size=self.par.pp,
            te=self.te,
        )
        return stage

    def _wrap_ddp(self, stage):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.par.distributed_optimizer,
            nccl_ub=self.cfg.use_nccl_ub,
        )
        ddp = DistributedDataParallel(config=stage.config, ddp_config=ddp_config, module=stage)
        # The schedule finishes the grad reduction (and SP's layer-norm / PP's embedding all-reduces).
        stage.config.finalize_model_grads_func = finalize_model_grads
        stage.config.no_sync_func = ddp.no_sync
        return ddp

    def _optimizer_and_schedule(self) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        oc = OptimizerConfig(
            optimizer="adam",
            lr=self.cfg.lr,
            min_lr=self.cfg.min_lr,
            weight_decay=self.cfg.weight_decay,
            adam_beta1=self.cfg.adam_beta1,
            adam_beta2=self.cfg.adam_beta2,
            adam_eps=self.cfg.adam_eps,
            clip_grad=self.cfg.clip_grad,
            bf16=False,
            params_dtype=torch.float32,
            use_distributed_optimizer=self.par.distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(oc, [self.ddp])
        self.schedule = LRSchedule.of(self.cfg, self.total_steps)

    def _register(self) -> None:
        models = [m for m in (self.stage, self.ref_model) if m is not None]
        self.memory.register(StateClass.WEIGHTS, lambda: [p for m in models for p in m.parameters()])
        self.memory.register(StateClass.OPTIMIZER, lambda: optimizer_tensors(self.optimizer))
        self.memory.register(StateClass.GRADS, lambda: grad_buffers(self.ddp))

    # ---- training ----------------------------------------------------------------------------------
    def train(self, samples: list[Sample], rollout_id: int) -> dict:
        """All optimizer steps of one rollout; rank 0 returns the metrics reduced over ranks."""
        from tidal.trainer.megatron.step import train_rollout

        out = self._profiled(lambda: train_rollout(self, samples, rollout_id))
        snapshot = self._history.step()
        if snapshot and out:
            out["memory_snapshot"] = snapshot
        return out

    def plan(self, samples: list[Sample]) -> list[list[MicroBatch]]:
        """This data-parallel rank's micro-batches per optimizer step (every TP/PP rank of a replica alike)."""
        self.residency.require_active("train")
        self._warned_oversized |= check_samples(
            samples,
            vocab=self.arch.vocab_size,
            model_name=self.model_cfg.model,
            max_tokens=self.cfg.max_tokens_per_gpu,
            warn=not self._warned_oversized,
        )
        plan = plan_rollout(
            [s.total_len for s in samples],
            world_size=self.topo.dp,
            global_batch_size=self.cfg.global_batch_size,
            max_tokens=self.cfg.max_tokens_per_gpu,
        )
        return [
            [MicroBatch(samples, mb, self.pad_id, self.device) for mb in step[self.dp_rank].micro_batches]
            for step in plan
        ]

    def new_sums(self) -> tuple[RolloutSums, RolloutObjective]:
        return RolloutSums(self.device), RolloutObjective(self.algo, self.device, self.custom_correction)

    # ---- memory --------------------------------------------------------------------------------------
    def _free_transients(self) -> None:
        self.optimizer.zero_grad()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _release_groups(self) -> dict[str, float]:
        t0 = time.perf_counter()
        used = device_used_bytes(self.device) if self.device.type == "cuda" else 0
        released = self.parallel_groups.release() if self.release_groups else 0
        freed = used - device_used_bytes(self.device) if self.device.type == "cuda" else 0
        return {"groups_released": released, "groups_freed_bytes": freed, "groups_s": time.perf_counter() - t0}

    def _rebuild_groups(self) -> dict[str, float]:
        t0 = time.perf_counter()
        rebuilt = self.parallel_groups.released is not None
        repointed = self.parallel_groups.rebuild([self.stage, self.ref_model, self.ddp, self.optimizer])
        return {"groups_rebuilt": int(rebuilt), "groups_repointed": repointed, "groups_s": time.perf_counter() - t0}

    # ---- weight source and state surface -------------------------------------------------------------
    def read(self, t: torch.Tensor) -> torch.Tensor:
        """A parameter or optimizer tensor as it can be read now: live, or its host backup while paused."""
        return self.memory.host_view(t) if self.weights_from_backup else t

    def gather(self, local: dict[str, torch.Tensor], dtype, on_device: bool = False, read=None):
        """HF tensors of ``local`` (this rank's tensors by Megatron name, in the parameters' layout); ``read``
        replaces ``self.read`` for tensors that are not registered state (assembled copies)."""
        from tidal.weight_sync.stream import to_host

        return iter_hf_weights(
            local,
            self.arch,
            self.topo,
            shapes=self.shapes,
            dtype=dtype,
            read=read or self.read,
            host=to_host,
            group=self.groups.host,
            te=self.te,
            on_device=on_device and self.world_size == 1,
        )

    def iter_weights(
        self, dtype: str | torch.dtype | None = None, *, on_device: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(HF name, full tensor in dtype)`` on rank 0 (TP shards gathered, QKV and fc1 un-fused), None elsewhere."""
        return self.gather(self.local, as_dtype(dtype), on_device)

    def checkpoint_state(self) -> MegatronState:
        return MegatronState(self)

    def shutdown(self) -> None:
        from megatron.core import parallel_state as ps

        super().shutdown()
        ps.destroy_model_parallel()
        self.groups.destroy()


def schedule_call(trainer: MegatronTrainer, model, mbs: list[MicroBatch], loss_fn, *, forward_only: bool):
    """Run ``mbs`` through Megatron's schedule (1F1B with PP > 1); ``loss_fn(mb, logits)`` on the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    multiple = trainer.par.tp if trainer.par.sequence_parallel else 1

    def forward_step(data_iterator, module):
        mb = next(data_iterator)
        ids = mb.input_ids
        pad = (-ids.shape[1]) % multiple
        if pad:
            ids = torch.nn.functional.pad(ids, (0, pad), value=trainer.pad_id)
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        out = module(ids, pos, None)
        return out, functools.partial(loss_fn, mb, width=mb.input_ids.shape[1])

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=[model],
        num_microbatches=len(mbs),
        seq_length=max(mb.input_ids.shape[1] for mb in mbs),
        micro_batch_size=max(mb.input_ids.shape[0] for mb in mbs),
        forward_only=forward_only,
    )
