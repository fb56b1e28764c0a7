"""Atomic trainer checkpoints: full fp32 weights and AdamW moments as safetensors, RNG, schedule, ``extra``.

Layout of one checkpoint, ``<dir>/iter_{rollout:07d}/``::

    model-00001.safetensors ...     fp32 master weights by HF name (tied weights once)
    optim-00001.safetensors ...     AdamW moments, "<name>/exp_avg" and "<name>/exp_avg_sq"
    rng_rank{r}.pt                  each rank's torch / CUDA / Python / NumPy RNG state
    meta.json                       tensor index, AdamW step counts, LR schedule, extra
    manifest.json                   written last: size and XXH3-128 of every file (tidal.checkpoint.manifest)

and ``<dir>/latest`` names the newest complete one.

The format knows nothing of any training backend: it reads and fills a trainer through
``TrainState``, the public state surface every backend offers (``tidal.trainer.base.Trainer``
declares it; the FSDP2 backend implements it in ``tidal.trainer.fsdp_state``).

Why full tensors gathered to rank 0 rather than ``torch.distributed.checkpoint`` (DCP):

- the driver saves while the trainer is *paused* (engines own the device). The FSDP2 gather
  already reads host backups then (``tidal.trainer.weights``), so saving never touches released
  device memory and needs no resume; DCP would read the DTensors' device storage;
- a checkpoint is plain safetensors by HF names: readable without torch.distributed, loadable with
  any number of ranks (each rank slices its own rows), and its weights are the export's weights;
- the cost is rank-0 host memory for one file shard at a time (files are cut at 1 GiB) and a
  gather through rank 0, acceptable at the sizes this trainer targets (one host).

Atomicity: everything is written into ``<dir>/.tmp-iter_XXXXXXX-<random>/`` (ignored by readers),
``manifest.json`` last, then the folder is renamed to its final name, then ``latest`` is replaced
atomically. A crash at any point leaves either the previous checkpoint or the new one, never a
half-written folder that ``load`` would pick. Every rank must see the same filesystem (one host, or
a shared mount).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tidal.atomic import publish_dir, write_text_atomic
from tidal.checkpoint.manifest import find_loadable, write_manifest
from tidal.errors import UserError

FORMAT = 1
_SHARD_BYTES = 1 << 30


@runtime_checkable
class TrainState(Protocol):
    """What a checkpoint reads from and writes into a trainer: its public state surface.

    Every method is collective (all ranks call it in the same order). Tensors are full, by Hugging
    Face parameter name (tied weights once), on rank 0 and ``None`` elsewhere; optimizer tensors
    are named ``"<param>/<moment>"``. A backend keeps its own layout (shards, buckets, pipeline
    stages) and converts at this surface, so one checkpoint loads into any number of ranks.
    """

    rank: int
    world_size: int
    model_name: str  # the --model the weights belong to (recorded, and named in errors)

    def barrier(self) -> None: ...

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""

    def model_state(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """fp32 master weights."""

    def optimizer_state(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Optimizer tensors (AdamW: ``<param>/exp_avg``, ``<param>/exp_avg_sq``)."""

    def optimizer_steps(self) -> dict[str, float]:
        """Per-parameter optimizer step counts."""

    def schedule_state(self) -> dict: ...

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shape of every weight ``load_model_state`` will ask for."""

    def load_model_state(self, get: Callable[[str], torch.Tensor]) -> None:
        """Fill every weight from ``get(name)`` (a full tensor, the same on every rank)."""

    def load_optimizer_state(
        self, get: Callable[[str], torch.Tensor], names: set[str], steps: dict[str, float]
    ) -> None:
        """Fill optimizer tensors that are in ``names`` from ``get``, with the step counts ``steps``."""

    def load_schedule_state(self, state: dict) -> None: ...


def iter_name(rollout_id: int) -> str:
    return f"iter_{int(rollout_id):07d}"


class ShardedWriter:
    """Streams named tensors into ``<prefix>-NNNNN.safetensors`` files of at most ~1 GiB each."""

    def __init__(self, folder: str, prefix: str, max_bytes: int = _SHARD_BYTES):
        self.folder, self.prefix, self.max_bytes = folder, prefix, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.index: dict[str, str] = {}
        self.files = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        t = plain(t)
        if self.pending and self.pending_bytes + t.numel() * t.element_size() > self.max_bytes:
            self.flush()
        self.pending[name] = t
        self.pending_bytes += t.numel() * t.element_size()

    def flush(self) -> None:
        if not self.pending:
            return
        self.files += 1
        fname = f"{self.prefix}-{self.files:05d}.safetensors"
        save_file(self.pending, os.path.join(self.folder, fname), metadata={"format": "pt"})
        for name in self.pending:
            self.index[name] = fname
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> dict[str, str]:
        self.flush()
        return self.index


class ShardedReader:
    """Reads single tensors from the files of an index without loading whole files."""

    def __init__(self, folder: str, index: dict[str, str]):
        self.folder, self.index = folder, index
        self.handles: dict[str, object] = {}

    def get(self, name: str) -> torch.Tensor:
        fname = self.index[name]
        if fname not in self.handles:
            self.handles[fname] = safe_open(os.path.join(self.folder, fname), framework="pt")
        return self.handles[fname].get_tensor(name)


def plain(t: torch.Tensor) -> torch.Tensor:
    """A plain contiguous tensor: host views (a guarded subclass aliasing a backup) are copied out."""
    t = t.detach()
    return t.clone().contiguous() if type(t) is not torch.Tensor else t.contiguous()


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "meta.json"))


def find_latest(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (``latest`` first, else the highest complete ``iter_*``)."""
    if is_complete(root):
        return root  # a checkpoint folder itself (--load DIR/iter_0000005)
    if not os.path.isdir(root):
        return None
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        if name and is_complete(os.path.join(root, name)):
            return os.path.join(root, name)
    # The pointer is written last, so a crash between rename and pointer leaves a newer complete folder.
    done = sorted(d for d in os.listdir(root) if d.startswith("iter_") and is_complete(os.path.join(root, d)))
    return os.path.join(root, done[-1]) if done else None


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(state: TrainState, root: str, extra: dict) -> dict:
    """Write one checkpoint of ``state`` under ``root``; collective over the trainer's ranks, rank 0 writes.

    A write that fails (no space left, quota, I/O error) removes the temp folder and raises a
    ``UserError``: the previous checkpoint and the ``latest`` pointer were never touched.
    """
    rollout_id = int(extra.get("rollout_id", 0))
    # Rank 0 picks the temp name and tells the others.
    name = state.broadcast_object(f".tmp-{iter_name(rollout_id)}-{uuid.uuid4().hex[:8]}" if state.rank == 0 else None)
    tmp = os.path.join(root, name)
    try:
        return _save(state, root, tmp, rollout_id, extra)
    except (OSError, SafetensorError) as e:  # safetensors reports a failed write as its own error
        if state.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        before = find_loadable(root).path
        kept = f"{os.path.basename(before)} is intact" if before else "no earlier checkpoint was touched"
        raise UserError(
            f"--save {root}: writing the checkpoint of rollout {rollout_id} failed ({getattr(e, 'strerror', None) or e}); {kept}; "
            f"free space and continue with --load {root}"
        ) from None


def _save(state: TrainState, root: str, tmp: str, rollout_id: int, extra: dict) -> dict:
    t0 = time.perf_counter()
    rank = state.rank
    final = os.path.join(root, iter_name(rollout_id))
    if rank == 0:
        os.makedirs(tmp, exist_ok=False)
    state.barrier()

    # fp32 master weights and moments (a paused trainer reads them from its host backups).
    nbytes = 0
    indexes = []
    for prefix, tensors in (("model", state.model_state()), ("optim", state.optimizer_state())):
        writer = ShardedWriter(tmp, prefix) if rank == 0 else None
        for tname, full in tensors:
            if full is not None:
                writer.add(tname, full)
                nbytes += full.numel() * full.element_size()
        indexes.append(writer.close() if writer is not None else None)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    steps = state.optimizer_steps()
    state.barrier()

    if rank == 0:
        meta = {
            "format": FORMAT,
            "rollout_id": rollout_id,
            "world_size": state.world_size,
            "model": state.model_name,
            "model_index": indexes[0],
            "optim_index": indexes[1],
            "optim_steps": steps,
            "schedule": state.schedule_state(),
            "extra": extra,
            "saved_at": time.time(),
        }
        write_text_atomic(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1, sort_keys=True))
        write_manifest(tmp)  # last: a checksum of every file above (tidal.checkpoint.manifest)
        publish_dir(tmp, final)
        write_text_atomic(os.path.join(root, "latest"), os.path.basename(final) + "\n")
    state.barrier()
    if rank != 0:
        return {}
    return {"checkpoint/path": final, "checkpoint/bytes": nbytes, "checkpoint/save_s": time.perf_counter() - t0}


def load_checkpoint(state: TrainState, root: str) -> dict:
    """Load the newest complete checkpoint under ``root`` into ``state`` (ACTIVE); returns ``extra`` or {}."""
    path = find_latest(root)
    if path is None:
        return {}
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise UserError(
            f"--load {path}: checkpoint format {meta.get('format')} is not {FORMAT}; save it again with this tidal"
        )
    shapes = state.weight_shapes()
    missing = sorted(set(shapes) - set(meta["model_index"]))
    if missing:
        raise UserError(
            f"--load {path}: checkpoint lacks {len(missing)} weight(s) of --model {state.model_name} "
            f"(e.g. {missing[0]}); load it with the model it was saved from ({meta.get('model')})"
        )
    models = ShardedReader(path, meta["model_index"])

    def weight(name: str) -> torch.Tensor:
        full = models.get(name)
        if tuple(full.shape) != tuple(shapes[name]):
            raise UserError(
                f"--load {path}: {name} has shape {tuple(full.shape)}, the model has {tuple(shapes[name])}; "
                "use the model the checkpoint was saved from"
            )
        return full

    state.load_model_state(weight)
    optim = ShardedReader(path, meta["optim_index"])
    state.load_optimizer_state(optim.get, set(meta["optim_index"]), meta["optim_steps"])
    state.load_schedule_state(meta["schedule"])
    rng_file = os.path.join(path, f"rng_rank{state.rank}.pt")
    if meta.get("world_size") == state.world_size and os.path.isfile(rng_file):
        # Our own file, written by save_checkpoint (Python/NumPy RNG states are not plain tensors).
        _set_rng_state(torch.load(rng_file, weights_only=False))
    state.barrier()
    return dict(meta["extra"])
