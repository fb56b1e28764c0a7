"""The Megatron backend's training path on CPU next to the FSDP2 backend: ``python tests/megatron_cpu_train.py PORT OUT``.

Run by ``tests/unit/test_megatron_backend.py``. One process, one gloo rank, both backends on the same
seeded ``tiny-qwen2`` (tied embeddings, QKV bias) with a KL reference model and the portable memory
backend with ``--offload-train``: the same rollouts through ``MegatronTrainer.train`` (Megatron's
``GPTModel``, ``DistributedDataParallel``, optimizer and pipeline schedule) and ``TrainerActor.train``;
then pause/resume, save while paused, load, and the checkpoint loaded into the FSDP2 backend.

``MegatronTrainer.init`` refuses a CPU device, so this builds it the way ``init`` does after its
device and process-group setup (``_parallel_state``, ``build``). Megatron-core hard-codes
``device="cuda"`` in a few allocations (its DDP buffers ask ``torch.cuda.current_device()``, the
schedule's token counter, the default causal mask, the FP32 optimizer's loss scale), moves an embedding
tied across pipeline stages with ``.cuda()``, synchronises CUDA around the stages' shape exchange and
forks a CUDA RNG tracker around dropout (0 here): those are redirected to the CPU, and the
distributed optimizer's check of a parameter's type name (``torch.cuda.FloatTensor``) sees the CUDA
name. Gradient clipping asserts CUDA tensors, so both backends run with ``--clip-grad 0``.

Memory is moved into its regions as on a torch without ``UntypedStorage._swap_data_ptr_`` (2.11, the
GPU host's): every tensor on a moved storage is re-pointed (``tidal.memory.home``), and a storage
with users the trainer did not name stops the run. A third trainer, Megatron with the distributed
optimizer (its parameter buffers moved that way), trains the same two rollouts.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _redirect_cuda_devices() -> None:
    def host(fn):
        def call(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        return call

    for name in ("zeros", "ones", "tensor", "empty"):
        setattr(torch, name, host(getattr(torch, name)))
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None  # pipeline stages' shape exchange
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # an embedding tied across pipeline stages
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    type_name = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        out = type_name(self, *args, **kwargs)
        return out.replace("torch.", "torch.cuda.", 1) if not (args or kwargs) and self.device.type == "cpu" else out

    torch.Tensor.type = cuda_type_name


def _samples(seed: int) -> list:
    from tidal.rollout.types import Sample

    rng = random.Random(seed)
    return [
        Sample(
            index=i,
            group=i // 4,
            prompt="",
            prompt_ids=[rng.randint(4, 40) for _ in range(rng.randint(3, 9))],
            response_ids=[rng.randint(4, 40) for _ in range(rng.randint(1, 5))],
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(16)
    ]


def _sections(backend: str) -> dict:
    from tidal.config.schema import AlgorithmConfig, MemoryConfig, ModelConfig, TrainerConfig, WeightSyncConfig

    return dict(
        model=ModelConfig(model="tiny-qwen2"),
        trainer=TrainerConfig(
            train_backend=backend, lr=1e-3, param_dtype="fp32", compile_logprobs=False, clip_grad=0.0, seed=7
        ),
        algorithm=AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.05),
        memory=MemoryConfig(
            offload_train=True,
            disable_grad_buffers_cpu_backup=True,
            memory_backend="portable",
            offload_host_memory="release",
        ),
        weight_sync=WeightSyncConfig(),
        device="cpu",
    )


def _megatron(port: int, distributed_optimizer: bool = False):
    from tidal.trainer.megatron.trainer import MegatronTrainer

    sections = _sections("megatron")
    sections["trainer"].use_distributed_optimizer = distributed_optimizer
    tr = MegatronTrainer(0, 1, "127.0.0.1", port, release_process_groups=not distributed_optimizer, **sections)
    tr._place()
    tr._parallel_state()
    tr.build()
    return tr


def _metrics(m: dict) -> dict:
    keys = ("loss", "pg_loss", "kl", "entropy", "grad_norm", "tokens", "response_tokens", "optimizer_steps")
    return {k: float(m[k]) for k in keys}


def _groups_after_rebuild(ps, old: list) -> dict:
    """What the rebuild left: the old groups still referenced from anywhere (reference counts see every
    holder, containers the garbage collector does not track included), whether Megatron's getters and
    DDP hand out new groups, and whether every new group is registered with torch.distributed."""
    new = [g for g in ps._global_process_group_list if g is not None]
    registered = dist.distributed_c10d._world.pg_map
    return {
        "old": len(old),
        "new": len(new),
        # held only by ``old`` and getrefcount's argument
        "stale": [i for i in range(len(old)) if sys.getrefcount(old[i]) > 2],
        "old_registered": sum(g in registered for g in old),
        "new_registered": sum(g in registered for g in new),
        "fresh_getters": all(
            all(x is not g for g in old)
            for x in (ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(), ps.get_model_parallel_group())
        ),
    }


def _adopted(meg, fsdp) -> dict:
    """After the first step: how many optimizer state tensors each backend has, and whether each is one the
    trainer moved into its OPTIMIZER region (by identity: a DTensor's local tensor for FSDP2)."""
    from tidal.trainer.megatron.memory import optimizer_tensors

    out = {}
    for name, home, state in (
        ("megatron", meg.optimizer_home, optimizer_tensors(meg.optimizer)),
        ("fsdp", fsdp.optimizer_home, fsdp._optimizer_tensors()),
    ):
        out[name] = {"tensors": len(state), "adopted": sum(map(home.holds, state))}
    return out


def main() -> None:
    port, out_path = int(sys.argv[1]), sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    _redirect_cuda_devices()
    from megatron.core import parallel_state as ps

    from tidal.memory import home

    home.CAN_SWAP = False  # as torch 2.11

    from tidal.trainer.actor import TrainerActor

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    fsdp = TrainerActor(0, 1, "127.0.0.1", port, **_sections("fsdp"))
    fsdp.init()
    meg = _megatron(port)
    res: dict = {"start_equal": dict(meg.iter_weights()).keys() == dict(fsdp.iter_weights()).keys()}
    res["start_equal"] &= all(
        torch.equal(a, b) for (_, a), (_, b) in zip(sorted(meg.iter_weights()), sorted(fsdp.iter_weights()))
    )
    rollouts = []
    old = [g for g in ps._global_process_group_list if g is not None]
    for i, gbs in enumerate((None, 8)):  # one optimizer step, then two (old log-probs recomputed)
        for t in (meg, fsdp):
            t.cfg.global_batch_size = gbs
            if i:
                res.setdefault("resume", t.resume().metrics)
        if i:  # Megatron's groups were destroyed at the pause and rebuilt at this resume
            res["groups"] = _groups_after_rebuild(ps, old)
            del old
        rollouts.append((_metrics(meg.train(_samples(i), i)), _metrics(fsdp.train(_samples(i), i))))
        res.setdefault("adopted", _adopted(meg, fsdp))
        res.setdefault("pause", meg.pause().metrics)
        fsdp.pause()
    res["rollouts"] = rollouts
    w_m, w_f = dict(meg.iter_weights()), dict(fsdp.iter_weights())  # read from the host backups (paused)
    res["weights_max_abs_diff"] = max(float((w_m[n] - w_f[n]).abs().max()) for n in w_f)
    state = meg.state_checksums()
    ckpt = os.path.join(os.path.dirname(out_path), "ckpt")
    meg.save(ckpt, {"rollout_id": 1})
    meg.resume()
    res["resume_bit_exact"] = meg.state_checksums() == state
    meg.train(_samples(5), 2)
    meg.load(ckpt)
    res["load_bit_exact"] = meg.state_checksums() == state
    fsdp.resume()
    fsdp.load(ckpt)
    res["fsdp_loads_it"] = fsdp.state_checksums() == state
    dist_opt = _megatron(port, distributed_optimizer=True)
    res["distributed_optimizer"] = {
        "param_buffers_moved": dist_opt.weights_rehomed,
        "rollouts": [],
    }
    for i, gbs in enumerate((None, 8)):
        dist_opt.cfg.global_batch_size = gbs
        res["distributed_optimizer"]["rollouts"].append(_metrics(dist_opt.train(_samples(i), i)))
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
