"""``--record-memory-history``: the CUDA caching allocator's history, as snapshots for PyTorch's viewer.

Each trainer rank and each engine records allocator events from its start and, after
``--memory-snapshot-steps`` train steps (trainer) or rollouts (engine), writes
``<memory-snapshot-dir>/<actor>.pickle`` and stops recording. The files open in
https://pytorch.org/memory_viz (drag and drop). On CPU the flag is refused by the configuration
check, with a message that it needs CUDA.
"""

from __future__ import annotations

import os

import torch

MAX_ENTRIES = 100_000


class MemoryHistory:
    def __init__(self, memory_cfg, device: str, name: str):
        self.name = name
        self.dir = memory_cfg.memory_snapshot_dir
        self.left = int(memory_cfg.memory_snapshot_steps)
        self.enabled = bool(memory_cfg.record_memory_history) and device == "cuda" and torch.cuda.is_available()
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)

    def step(self) -> str | None:
        """Count one step; after the last one write the snapshot and stop recording. Returns its path."""
        if not self.enabled or self.left <= 0:
            return None
        self.left -= 1
        if self.left:
            return None
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"{self.name}.pickle")
        tmp = path + ".tmp"
        torch.cuda.memory._dump_snapshot(tmp)
        os.replace(tmp, path)
        torch.cuda.memory._record_memory_history(enabled=None)
        return path
