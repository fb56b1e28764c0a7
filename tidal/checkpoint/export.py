"""Export a trainer's current weights as a Hugging Face folder (``from_pretrained`` loads it).

The folder holds ``config.json``, ``generation_config.json`` when the model has one,
``model.safetensors`` (the fp32 master weights by their HF names, tied weights once, which
``from_pretrained`` re-ties from the config) and the tokenizer files. It is written into a temp
folder next to the target and renamed into place, so a reader never sees a half-written export and
an older export at the same path is replaced whole. Collective: every rank takes part in the
gather, rank 0 writes.

The trainer is read through ``ExportSource`` (its weights through ``TrainState.model_state``), so
any training backend exports the same way. ``tidal export`` (a checkpoint to a folder, without a
cluster) lives in ``tidal.cli``.
"""

from __future__ import annotations

import copy
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors.torch import save_file

from tidal.atomic import publish_dir
from tidal.checkpoint.store import plain


@runtime_checkable
class ExportSource(Protocol):
    """What an export reads from a trainer (collective like ``TrainState``)."""

    rank: int

    def barrier(self) -> None: ...

    def model_state(self) -> Iterator[tuple[str, torch.Tensor | None]]: ...

    def hf_parts(self) -> tuple[Any, Any, Any]:
        """``(config, generation_config or None, tokenizer)`` of the model, as transformers objects."""


def export_hf(source: ExportSource, out_dir: str) -> dict:
    """Write ``out_dir`` from ``source``; returns ``{path, bytes, seconds}`` on rank 0."""
    t0 = time.perf_counter()
    tensors = {}
    for name, full in source.model_state():
        if full is not None:
            tensors[name] = plain(full)
    if source.rank != 0:
        source.barrier()
        return {}
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(out_dir)}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    config, gen, tokenizer = source.hf_parts()
    config = copy.deepcopy(config)
    config.use_cache = True  # training turned the KV cache off; an exported model generates
    config.save_pretrained(tmp)
    if gen is not None:
        try:
            gen.save_pretrained(tmp)
        except ValueError:
            pass  # an invalid generation config is the model's own; the weights are what matters here
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    publish_dir(tmp, out_dir)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    source.barrier()
    return {"export/path": out_dir, "export/bytes": nbytes, "export/seconds": time.perf_counter() - t0}
