"""Two gloo ranks of the Megatron backend's training path on CPU: ``python tests/megatron_cpu_parallel.py RANK PORT OUT``.

Run by ``tests/unit/test_megatron_backend.py`` next to ``tests/megatron_cpu_train.py`` (one rank):
the same seeded ``tiny-qwen2`` (tied embeddings), sections and rollouts through
``MegatronTrainer.train``, first with tensor parallelism 2 (vocabulary-parallel log-probs, sharded
QKV/MLP, the gradient norm over both shards), then, in the same two processes, as two pipeline
stages (Megatron's schedule sending activations between them, the tied embedding's gradient summed
across the first and last stage). Each pauses and resumes between its rollouts, destroying and
rebuilding Megatron's groups of two ranks. Rank 0 writes each layout's metrics; the test compares
them with the one-rank run's. CUDA-only calls are redirected as in ``megatron_cpu_train``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_cpu_train import _metrics, _redirect_cuda_devices, _samples, _sections  # noqa: E402

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


def _rollouts(rank: int, port: int, tp: int, pp: int) -> list[dict]:
    from tidal.trainer.megatron.trainer import MegatronTrainer

    sections = _sections("megatron")
    sections["trainer"].tensor_model_parallel_size = tp
    sections["trainer"].pipeline_model_parallel_size = pp
    tr = MegatronTrainer(rank, 2, "127.0.0.1", port, release_process_groups=True, **sections)
    tr._place()
    tr._parallel_state()
    tr.build()
    out = []
    for i, gbs in enumerate((None, 8)):  # as megatron_cpu_train: one optimizer step, then two
        tr.cfg.global_batch_size = gbs
        if i:
            tr.resume()
        m = tr.train(_samples(i), i)
        out.append(_metrics(m) if rank == 0 else {})  # rank 0 returns the metrics reduced over ranks
        tr.pause()
    tr.resume()
    return out


def main() -> None:
    rank, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    _redirect_cuda_devices()
    from megatron.core import parallel_state as ps

    from tidal.memory import home

    home.CAN_SWAP = False  # as torch 2.11
    results = {}
    for name, (tp, pp) in LAYOUTS.items():
        results[name] = _rollouts(rank, port, tp, pp)
        ps.destroy_model_parallel()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
