"""Export the trainer's current weights as a Hugging Face folder (``from_pretrained`` loads it).

The folder holds ``config.json``, ``generation_config.json`` when the model has one,
``model.safetensors`` (the fp32 master weights by their HF names, tied weights once, which
``from_pretrained`` re-ties from the config) and the tokenizer files. It is written into a temp
folder next to the target and renamed into place, so a reader never sees a half-written export and
an older export at the same path is replaced whole. Collective: every rank takes part in the
gather, rank 0 writes.
"""

from __future__ import annotations

import copy
import os
import time
import uuid

from safetensors.torch import save_file

from tidal.checkpoint.store import plain, replace_dir


def export_hf(trainer, out_dir: str) -> dict:
    """Write ``out_dir`` from a ``TrainerActor``; returns ``{path, bytes, seconds}`` on rank 0."""
    t0 = time.perf_counter()
    rank = trainer.rank
    tensors = {}
    for name, full in trainer._iter_named(list(trainer.model.named_parameters()), None):
        if full is not None:
            tensors[name] = plain(full)
    if rank != 0:
        trainer.groups.barrier()
        return {}
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(out_dir)}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    config = copy.deepcopy(trainer.model.config)
    config.use_cache = True  # training turned the KV cache off; an exported model generates
    config.save_pretrained(tmp)
    gen = getattr(trainer.model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(tmp)
        except ValueError:
            pass  # an invalid generation config is the model's own; the weights are what matters here
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    trainer.tokenizer.save_pretrained(tmp)
    replace_dir(tmp, out_dir)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    trainer.groups.barrier()
    return {"export/path": out_dir, "export/bytes": nbytes, "export/seconds": time.perf_counter() - t0}


def export_checkpoint(load_dir: str, out_dir: str, cfg) -> str:
    """``tidal export``: load the newest checkpoint under ``load_dir`` into a one-rank trainer in
    this process (no Ray) and write it as a Hugging Face folder at ``out_dir``."""
    import socket

    from tidal.checkpoint.store import find_latest
    from tidal.errors import UserError
    from tidal.trainer.actor import TrainerActor

    if not os.path.isdir(load_dir) or find_latest(load_dir) is None:
        raise UserError(
            f"--load {load_dir}: no complete checkpoint there; pass the directory given to --save during training"
        )
    if os.path.exists(out_dir):
        raise UserError(f"--out {out_dir}: already exists; choose a new folder")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainer = TrainerActor(
        0,
        1,
        "127.0.0.1",
        port,
        model=cfg.model,
        trainer=cfg.trainer,
        algorithm=cfg.algorithm,
        memory=cfg.memory,
        weight_sync=cfg.weight_sync,
        device=cfg.cluster.device,
    )
    try:
        trainer.init()
        trainer.load(load_dir)
        trainer.export(out_dir)
    finally:
        trainer.shutdown()
    return out_dir
