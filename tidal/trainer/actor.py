"""The FSDP2 trainer rank (``--train-backend fsdp``): model shards, optimizer, GRPO steps, pause/resume, weight source.

One ``TrainerActor`` per device (process on CPU), implementing ``tidal.trainer.base.Trainer`` (the
contract, and what every backend shares: weight sync, checksums, save/load/export). The cluster
code wraps the class with ``ray.remote`` and calls every method on all ranks at once; rank 0
returns the reduced result (other ranks return ``{}`` where a result only makes sense once). Its
state surface for checkpoints and export is ``tidal.trainer.fsdp_state.FSDPState``; its models are
built and sharded by ``tidal.trainer.sharding``.

Per rollout, ``train(samples, rollout_id)``:

1. plans the rollout (``tidal.trainer.packing``): optimizer steps of ``global_batch_size`` samples,
   each rank's share balanced by tokens, micro-batches under ``max_tokens_per_gpu``, the same
   number of micro-batches on every rank (empty ones are zero-weight fillers);
2. recomputes old log-probs (and reference log-probs when ``use_kl_loss``) for every micro-batch with
   the weights as they are before any update of this rollout, in ``no_grad``. When the rollout is one
   optimizer step (the default) the weights are still those when the training pass runs, so its own
   log-probs, detached, are the old ones and only the reference pass remains (``--recompute-logprobs``
   forces the separate pass);
3. per optimizer step: token count all-reduced first, so every micro-batch's loss is its share of
   the token-mean over the whole global batch (``tidal.algos.objectives.rl_loss`` with an external
   normaliser); backward per micro-batch; global-norm clipping; AdamW with the scheduled rate.

Log-probs and the entropy come from one fused pass over each micro-batch's logits
(``token_logprobs_and_entropy``; the recompute takes the log-probs alone). The loop never waits for
the device: micro-batches are sent once per rollout (pinned, asynchronous), host-side counts come
from the host copies, and metric sums, the engine log-prob difference and the grad norms stay on the
device until one transfer at the end of the rollout (plus one synchronisation after the recompute,
so ``logprob_recompute_s`` stays a wall-clock time).

Memory: parameters' local shards (WEIGHTS), AdamW moments (OPTIMIZER) and gradients (GRADS) are
registered with the memory backend and allocated inside its regions; ``pause()`` frees activations
and cached blocks, destroys the NCCL compute group, then pauses the classes. Weight source:
``iter_weights(dtype)`` reads live shards when ACTIVE and host backups when PAUSED (never paused
device memory), see ``tidal.trainer.weights``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import torch

from tidal.compile_cache import compile_seconds, freeze_if_compiled
from tidal.config.schema import trained_logits_only_default
from tidal.dtypes import as_dtype, default_dtype_name
from tidal.memory.base import StateClass
from tidal.memory.home import Adopter
from tidal.rollout.types import Sample, WarmUpReport
from tidal.trainer.base import Trainer
from tidal.trainer.fsdp_state import FSDPState, fsdp_modules, reshard
from tidal.trainer.groups import place
from tidal.trainer.microbatch import HostStaging, MicroBatches
from tidal.trainer.objective import RolloutObjective
from tidal.trainer.optim import build_adamw, clip_one_rank
from tidal.trainer.packing import plan_rollout
from tidal.trainer.schedule import LRSchedule
from tidal.trainer.sharding import build_sharded, mixed_precision, shard
from tidal.trainer.step import RolloutClock, RolloutSums, check_samples, rollout_metrics, token_stats
from tidal.trainer.weights import iter_full_tensors, local_shard


def warm_up_shapes(max_tokens: int) -> list[tuple[int, int, int]]:
    """The trainer warm-up's micro-batches as (rows, prompt tokens, response tokens): 2 rows of 48 tokens, then
    half of ``max_tokens`` (at least 3 rows) in rows of 256 tokens where that fits three of them, else of 24,
    then 4 rows of 32 tokens.

    Half, not all: every token of these rows is a response token, so a full-size one would need more memory
    than a real micro-batch of the same size (whose prompts carry no log-prob kernels), and its peak would come
    on top of the engine's own warm-up. Half still runs the log-prob kernels over several chunks. The compiled
    layers' graphs have dynamic sizes from the first call (``sharding.DynamicRowsForward``), but inductor's
    graph guards on the size being small or large (a fusion heuristic's ``896 * rows * length < 5242880`` for
    the 0.5B shape): the first shape compiles the small graph a rollout's last micro-batch uses, the second the
    large one; the last (a small one again) meets the first's graph, and would compile the small graph where
    the layers were compiled without the marks (a rollout's small last micro-batch compiled it in the first
    step: 0.7 s with a warm cache, 4.9 s cold, on an H100). Their widths (48, 256, 32 tokens) are multiples
    of 8, as every CUDA micro-batch's is (``microbatch.WIDTH_MULTIPLE``: the compiled attention's graphs guard
    on it)."""
    response = 248 if max_tokens >= 6 * 256 else 16
    return [(2, 8, 40), (max(3, max_tokens // 2 // (8 + response)), 8, response), (4, 8, 24)]


class TrainerActor(Trainer):
    """One rank of the FSDP2 trainer; see the module docstring and ``docs/design.md`` for the contract."""

    settles_optimizer = True  # _optimizer_step and _warm_up_step settle the optimizer state first

    def __init__(
        self,
        *args,
        release_process_groups: bool | None = None,
        one_rank_fsdp: bool | None = None,
        late_release: bool | None = None,
        **kwargs,
    ):
        """The arguments of ``Trainer.__init__``, and ``release_process_groups``: destroy/rebuild the compute
        group around pause/resume (default: on NCCL only; tests turn it on over gloo to exercise the same
        path on CPU); ``one_rank_fsdp``: see below (default: on one CUDA rank; tests turn it on over gloo);
        ``late_release``: see ``Trainer.late_release`` (default: decided by the room on the device)."""
        super().__init__(*args, **kwargs)
        self.late_release = late_release
        self.release_groups = (self.device_type == "cuda") if release_process_groups is None else release_process_groups
        self.critic = None  # PPO's value model (tidal.trainer.critic), with --advantage-estimator ppo
        # One CUDA rank: FSDP2's collectives are copies there, so the layers keep their gathered copy from
        # forward to backward and the gradients are reduced once per optimizer step, not per micro-batch
        # (each micro-batch's is added to the unsharded one in fp32). Everywhere else as FSDP2 does by default.
        default = self.world_size == 1 and self.device_type == "cuda"
        self.one_rank_fsdp = default if one_rank_fsdp is None else one_rank_fsdp and self.world_size == 1
        # Page-locked buffers the micro-batches cross to the device in, kept for the run (CUDA).
        self._staging = HostStaging() if self.device_type == "cuda" else None

    # ---- setup ------------------------------------------------------------------------------
    def init(self) -> dict:
        """Process groups, model (same seed on every rank), FSDP2, AdamW, schedule, memory backend."""
        from tidal.memory.history import MemoryHistory

        # Started first, so the snapshot shows every allocation of the actor's life.
        self._history = MemoryHistory(self.memory_cfg, self.device_type, f"trainer-rank{self.rank}")

        from tidal.memory import make_backend
        from tidal.model.load import build_model, load_tokenizer, resolve_model

        t0 = time.perf_counter()
        self._place()
        self.spec = resolve_model(self.model_cfg.model, self.model_cfg.tokenizer, self.model_cfg.trust_remote_code)
        self.model_path = self.spec.path
        tok = load_tokenizer(self.spec)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
        self.tokenizer = tok

        param_dtype = self.cfg.param_dtype
        if param_dtype == "auto":
            param_dtype = default_dtype_name(self.device_type)
        self.compute_dtype = as_dtype(param_dtype)
        # fp32 master parameters always; bf16 is only the compute copy FSDP all-gathers.
        self.mp = mixed_precision(self.compute_dtype)

        self.memory = make_backend(self.memory_cfg, device=self.device_type, role="trainer", offload_train=self.offload)
        t_build = time.perf_counter()
        # The region wraps the sharding only (a model built on the device is a temporary).
        self.model = self._build_sharded(build_model, trainable=True)
        if self.algo.use_kl_loss:
            self.ref_model = self._build_sharded(build_model, trainable=False)
        build_s = time.perf_counter() - t_build
        with self.memory.region(StateClass.WEIGHTS):
            if self.algo.use_critic:
                from tidal.trainer.critic import Critic

                self.critic = Critic(self.spec, self.cfg, self.algo, shard=self._shard, total_steps=self.total_steps)
        if self.algo.custom_tis_function_path:
            from tidal.trainer.objective import load_custom_correction

            self.custom_correction = load_custom_correction(self.algo.custom_tis_function_path)

        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._optimizer_and_schedule()
        self.optimizer_home = Adopter(lambda: self.memory.region(StateClass.OPTIMIZER))
        self.memory.register(StateClass.WEIGHTS, self._weight_tensors)
        self.memory.register(StateClass.OPTIMIZER, self._optimizer_tensors)
        self.memory.register(StateClass.GRADS, self._grad_tensors)
        # Everything alive now (imported modules, the model) lives for the whole run. Freezing it out of
        # the collector's generations makes the gc.collect() before every pause scan only what was
        # created since (about 1 s -> milliseconds on a 2-core host with transformers loaded).
        gc.collect()
        gc.freeze()
        num_params = self.num_params = sum(p.numel() for p in self.model.parameters())
        local_bytes = sum(local_shard(p).numel() * local_shard(p).element_size() for p in self.model.parameters())
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "num_params": num_params,
            "local_param_bytes": local_bytes,
            "param_dtype": str(self.compute_dtype).removeprefix("torch."),
            "use_kl_loss": self.ref_model is not None,
            "critic_params": sum(p.numel() for p in self.critic.model.parameters()) if self.critic else 0,
            "init_s": time.perf_counter() - t0,
            "build_s": build_s,  # policy (and reference) built from the seed and sharded
            "init_on_device": self._init_device().type != "cpu",
        }

    def _place(self) -> None:
        """This rank's device (CUDA: LOCAL_RANK's) and its process groups."""
        self.device, self.groups = place(self, separate_compute_group=self.release_groups)

    def _optimizer_and_schedule(self) -> None:
        """AdamW over the trainable parameters and the learning-rate schedule."""
        self.optimizer = build_adamw(self.params, self.cfg, self.device_type)
        self.schedule = LRSchedule.of(self.cfg, self.total_steps)

    def _build_sharded(self, build_model, *, trainable: bool) -> torch.nn.Module:
        return build_sharded(
            build_model,
            self.spec,
            self._shard,
            seed=self.cfg.seed,
            trainable=trainable,
            gradient_checkpointing=self.cfg.gradient_checkpointing,
            init_device=self._init_device(),
            region=lambda: self.memory.region(StateClass.WEIGHTS),
        )

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        return shard(
            model,
            self.groups.mesh,
            self.mp,
            self.model_cfg.model,
            compile_layers=self.cfg.compile_layers,
            reshard_after_forward=not self.one_rank_fsdp,
        )

    # ---- tensors per state class (called by the memory backend at every pause) -----------------
    def _weight_tensors(self):
        models = [m for m in (self.model, self.ref_model) if m is not None]
        critic = self.critic.weight_tensors() if self.critic else []
        return [local_shard(p) for m in models for p in m.parameters()] + critic

    def _optimizer_tensors(self):
        # AdamW's "step" counters are host scalars (scalars on the device with fused kernels: 4 bytes a
        # tensor, left where they are); only the moments are backed up.
        return [
            local_shard(v)
            for state in self.optimizer.state.values()
            for k, v in state.items()
            if k != "step" and torch.is_tensor(v)
        ] + (self.critic.optimizer_tensors() if self.critic else [])

    def _grad_tensors(self):
        critic = self.critic.grad_tensors() if self.critic else []
        return [local_shard(p.grad) for p in self.params if p.grad is not None] + critic

    @property
    def _models(self) -> list:
        """Every FSDP2 model of this rank (policy, reference, critic; None where absent)."""
        return [self.model, self.ref_model, self.critic.model if self.critic else None]

    # ---- training -----------------------------------------------------------------------------
    @property
    def _stats_kw(self) -> dict:
        """``token_stats``'s kernel choices from the config (``--trained-logits-only`` unset: on with CUDA)."""
        trained = self.cfg.trained_logits_only
        return {
            "compile": self.cfg.compile_logprobs,
            "trained_only": trained_logits_only_default(self.device_type) if trained is None else trained,
        }

    def _sync(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)

    def train(self, samples: list[Sample], rollout_id: int) -> dict:
        """All optimizer steps of one rollout; rank 0 returns the metrics reduced over ranks. A rollout that
        compiled (no warm-up, or a shape it did not reach) leaves what it compiled out of the collector
        (``freeze_if_compiled``), as the warm-up does, so that each pause's ``gc.collect`` stays short."""
        compiled = compile_seconds()[0]
        out = self._profiled(lambda: self._train(samples, rollout_id))
        freeze_if_compiled(compiled)
        snapshot = self._history.step()
        if snapshot and out:
            out["memory_snapshot"] = snapshot
        return out

    def _train(self, samples: list[Sample], rollout_id: int) -> dict:
        """One rollout. Nothing here waits for the device until the end: metric sums, the engine
        log-prob difference and the grad norms stay device tensors (``RolloutSums``) and come to the
        host in one ``tolist()``; host-side counts come from each ``MicroBatch``. (One synchronisation
        after the recompute keeps ``logprob_recompute_s`` a wall-clock figure.)"""
        self.residency.require_active("train")
        clock = RolloutClock()
        reserve = self.reserve_transients()  # inside the train's clock: its seconds count
        self._warned_oversized |= check_samples(
            samples,
            vocab=int(self.model.config.vocab_size),
            model_name=self.model_cfg.model,
            max_tokens=self.cfg.max_tokens_per_gpu,
            warn=not self._warned_oversized,
        )
        plan = plan_rollout(
            [s.total_len for s in samples],
            world_size=self.world_size,
            global_batch_size=self.cfg.global_batch_size,
            max_tokens=self.cfg.max_tokens_per_gpu,
        )
        # Built as the loop reaches them (MicroBatches), so the host builds one while the device runs the last.
        steps, slots = [], 0
        for step in plan:
            mbs = step[self.rank].micro_batches
            steps.append(MicroBatches(samples, mbs, self.pad_id, self.device, self._staging, first_slot=slots))
            slots += len(mbs)
        self.model.train()
        # With one optimizer step per rollout the weights do not change before the training pass, so
        # the old log-probs are that pass's own, detached (ratio 1): no separate pass unless asked for.
        old_from_train_pass = len(steps) == 1 and not self.cfg.recompute_logprobs
        sums = RolloutSums(self.device)
        objective = RolloutObjective(self.algo, self.device, self.custom_correction)
        with torch.profiler.record_function("tidal.old_logprobs"):  # labels of --profile-rollouts' phases
            self._old_logprobs(steps, sums, objective, recompute=not old_from_train_pass)
        clock.recompute_s = time.perf_counter() - clock.start
        for mbs in steps:
            step_s, clock.lr = self._optimizer_step(mbs, sums, objective, old_from_train_pass)
            clock.optimizer_s += step_s
        reshard(self._models)  # the root keeps its all-gathered parameters after forward; free them
        self.last_rollout_id = rollout_id
        out = rollout_metrics(self, sums, objective, clock, steps=len(steps), recomputed=not old_from_train_pass)
        if out:
            out.update(reserve)
        return out

    def warm_up(self, recompute: bool = False) -> WarmUpReport:
        """The first rollout's compiling, done before it (``--warm-up``): the policy's training pass (forward,
        log-probs and entropy, backward) over three micro-batches of pad tokens (``warm_up_shapes``: a small
        one, one of half ``--max-tokens-per-gpu`` and another small one), and the no-grad passes a rollout also
        runs (the reference's; the policy's when the rollout recomputes old log-probs: ``recompute``). The
        compiled layers and log-prob kernels compile with dynamic sizes from the first shape on; the second
        (large) shape compiles the layers' large-size graph and runs the log-prob kernels over several chunks.
        Each micro-batch goes through ``token_stats`` with the trainer's own kernel choices, and the gradient
        sync is the training loop's (one CUDA rank: on the last). The loss is zero; its zero gradients go
        through the clipping and an AdamW step at a learning rate of zero (``_warm_up_step``: the first step's
        one-time work, its moments created as that step would) and are then dropped (set to None), as are the
        gathered copies and the allocator's cached blocks; weights, moments (zero), step counts and schedule are
        as before, and the first real step makes the update it would have made. Every rank runs it at once
        (FSDP2's collectives). The critic is not warmed."""
        start = WarmUpReport.start()
        self.residency.require_active("warm up")
        kw = self._stats_kw
        entropy_grad = self.algo.entropy_coef != 0.0
        self.model.train()
        shapes = warm_up_shapes(self.cfg.max_tokens_per_gpu)
        for k, (rows, prompt, response) in enumerate(shapes):
            samples = [
                Sample(index=i, group=i, prompt="", prompt_ids=[self.pad_id] * prompt,
                       response_ids=[self.pad_id] * response, response_logprobs=[0.0] * response)
                for i in range(rows)
            ]  # fmt: skip
            (mb,) = MicroBatches(samples, [list(range(rows))], self.pad_id, self.device)
            with torch.no_grad():
                if self.ref_model is not None:
                    token_stats(self.ref_model, mb, **kw)
                if recompute:
                    token_stats(self.model, mb, **kw)
            if self.one_rank_fsdp:
                self.model.set_requires_gradient_sync(k == len(shapes) - 1)
            logprobs, ent = token_stats(self.model, mb, entropy=True, entropy_grad=entropy_grad, **kw)
            with self.memory.region(StateClass.GRADS):
                (logprobs.float().sum() * 0.0 + ent.float().sum() * 0.0).backward()
            del logprobs, ent, mb
        self._warm_up_step()
        reshard(self._models)
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        gc.freeze()  # the compiled graphs live for the whole run (see init)
        if self.device_type == "cuda":
            # Blocks cut for the warm-up's shapes would not fit the real micro-batches' and the first step would
            # reserve more beside them (an 80 GB card ran out of memory on the 0.5B preset): hand them back.
            torch.cuda.empty_cache()
        return WarmUpReport.since(start, warmed=["trainer"])

    def _warm_up_step(self) -> None:
        """The optimizer step's first-call work over the warm-up's zero gradients: the gradient clipping (over
        DTensors, each operation's sharding worked out once) and AdamW's ``warm_up`` (moments created and moved
        into OPTIMIZER as the first step would, its kernels run at a learning rate of zero). Both leave the
        weights bit for bit as they were. An optimizer without ``warm_up`` (torch's own) is left to its first
        step."""
        clip = clip_one_rank if self.one_rank_fsdp else torch.nn.utils.clip_grad_norm_
        clip(self.params, max_norm=self.cfg.clip_grad if self.cfg.clip_grad > 0 else float("inf"))
        if hasattr(self.optimizer, "warm_up"):
            self.memory.settle([StateClass.OPTIMIZER])
            self.optimizer.warm_up()
            self.optimizer_home.adopt(self._optimizer_tensors())

    def _old_logprobs(
        self, steps: list[MicroBatches], sums: RolloutSums, objective: RolloutObjective, *, recompute: bool
    ) -> None:
        """Old log-probs (when ``recompute``; with the correction they imply), reference log-probs (with a
        reference model) and the critic's old values and GAE advantages (PPO) of every micro-batch, with
        the weights as they are before any update of this rollout, in ``no_grad``. With none of the three to
        compute it builds nothing: each micro-batch is then built when the training loop reaches it, while the
        device runs the one before (building them all here left the device idle ~40 ms of a 1.03 s train on an
        H100, the host filling 133k tokens' arrays)."""
        if not (recompute or self.ref_model is not None or self.critic is not None):
            return
        with torch.no_grad():
            for mbs in steps:
                for mb in mbs:
                    if recompute:
                        old = token_stats(self.model, mb, **self._stats_kw)[0].float()
                        sums.engine_diff(mb, old)
                        objective.prepare(mb, old)
                    if self.ref_model is not None:
                        mb.ref_logprobs = token_stats(self.ref_model, mb, **self._stats_kw)[0].float()
                    if self.critic is not None:
                        objective.prepare_values(mb, self.critic)
        self._sync()

    def _optimizer_step(
        self, mbs: MicroBatches, sums: RolloutSums, objective: RolloutObjective, old_from_train_pass: bool
    ) -> tuple[float, float]:
        """One optimizer step over this rank's micro-batches: token-mean loss over the whole global batch,
        backward per micro-batch, global-norm clipping, AdamW at the scheduled rate. Returns
        ``(seconds in optimizer.step, learning rate)``. The loss is ``objective``'s (``rl_loss``); a critic
        runs its value loss's backward per micro-batch and steps with the policy."""
        agg = self.algo.loss_agg_mode
        entropy_grad = self.algo.entropy_coef != 0.0
        local_norm = mbs.normalizer(agg)  # from the samples on the host: no sync, nothing built yet
        (global_norm,) = self.groups.all_reduce_host([local_norm])
        global_norm = max(global_norm, 1.0)
        # FSDP2 averages gradients over ranks, so each rank's share is scaled back by world_size.
        normalizer = global_norm / self.world_size
        for k, mb in enumerate(mbs):
            if self.one_rank_fsdp:
                self.model.set_requires_gradient_sync(k == len(mbs) - 1)
            with torch.profiler.record_function("tidal.micro_batch"):
                self._micro_batch(mb, sums, objective, old_from_train_pass, entropy_grad, normalizer, global_norm)
        with torch.profiler.record_function("tidal.optimizer"):
            max_norm = self.cfg.clip_grad if self.cfg.clip_grad > 0 else float("inf")
            clip = clip_one_rank if self.one_rank_fsdp else torch.nn.utils.clip_grad_norm_
            sums.add_grad_norm(clip(self.params, max_norm=max_norm))
            lr = self.schedule.apply(self.optimizer)
            t_opt = time.perf_counter()
            # A resume may have left the state's copy back running beside the passes above (settles_optimizer).
            self.memory.settle([StateClass.OPTIMIZER])
            # Outside any region, so the step's temporaries are not backed up; the state its first step creates
            # is moved into OPTIMIZER afterwards (tidal.memory.home).
            self.optimizer.step()
            if self.critic is not None:
                objective.critic_step(self.critic)
            self.optimizer_home.adopt(self._optimizer_tensors())
            step_s = time.perf_counter() - t_opt
        self.schedule.advance()
        self.optimizer.zero_grad(set_to_none=True)
        return step_s, lr

    def _micro_batch(self, mb, sums, objective, old_from_train_pass: bool, entropy_grad: bool, normalizer, global_norm):
        """One micro-batch of an optimizer step: forward (log-probs and entropy), loss, backward (and the critic's)."""
        # The current policy's entropy comes from the same pass as the log-probs: a gradient
        # only for an entropy bonus, otherwise a detached metric.
        logprobs, ent = token_stats(self.model, mb, entropy=True, entropy_grad=entropy_grad, **self._stats_kw)
        if old_from_train_pass:
            old = logprobs.detach().float()
            sums.engine_diff(mb, old)
            objective.prepare(mb, old)
        loss, m = objective.loss(mb, logprobs, ent, normalizer)
        with self.memory.region(StateClass.GRADS):
            loss.backward()
        del logprobs, ent, loss
        if self.critic is not None:
            objective.critic_backward(mb, self.critic, normalizer, self.memory.region(StateClass.GRADS))
        sums.add_loss(mb, m, global_norm)

    # ---- memory ---------------------------------------------------------------------------------
    def _free_transients(self) -> None:
        reshard(self._models)
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device_type == "cuda":
            torch.cuda.empty_cache()

    def _release_groups(self) -> dict[str, float]:
        return {"groups_released": int(self.groups.release())}

    def _rebuild_groups(self) -> dict[str, float]:
        return {"groups_rebuilt": int(self.groups.rebuild(fsdp_modules(self._models)))}

    # ---- weight source and state surface -------------------------------------------------------------
    def iter_weights(
        self, dtype: str | torch.dtype | None = None, *, on_device: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(name, full tensor in dtype)`` on rank 0, ``(name, None)`` elsewhere; all ranks iterate together.
        named_parameters() lists tied weights once (HF names), which is what engines expect."""
        return self._gather(list(self.model.named_parameters()), as_dtype(dtype), on_device)

    def _gather(self, named, dtype, on_device: bool = False):
        backups = self.weights_from_backup
        return iter_full_tensors(
            named,
            dtype,
            rank=self.rank,
            world_size=self.world_size,
            host_group=self.groups.host,
            host_view=self.memory.host_view if backups else None,
            device_gather=self.device_type == "cuda" and not backups,
            on_device=on_device,
        )

    def checkpoint_state(self) -> FSDPState:
        return FSDPState(
            rank=self.rank,
            world_size=self.world_size,
            model_name=self.model_cfg.model,
            model=self.model,
            params=self.params,
            optimizer=self.optimizer,
            schedule=self.schedule,
            groups=self.groups,
            memory=self.memory,
            tokenizer=self.tokenizer,
            gather=self._gather,
            critic=self.critic,
        )

    def export(self, dir: str) -> dict:
        """The policy as a Hugging Face folder; a critic stays in checkpoints only."""
        from tidal.checkpoint.export import export_hf

        state = self._settled_state()
        state.critic = None
        return export_hf(state, dir)

    def shutdown(self) -> None:
        """Close the weight-sync strategy and the process groups (call on all ranks)."""
        super().shutdown()
        self.groups.destroy()
