"""Per-step JSON-lines files (metrics.jsonl, samples.jsonl): the rows a continued run keeps.

A run continued with ``--load`` into its old run folder starts again at the rollout after its checkpoint;
the rows an earlier process wrote for later rollouts describe steps that are about to run again, so they are
removed before the new rows are appended (``keep_before``), leaving one row per step.
"""

from __future__ import annotations

import json
import os

from tidal.atomic import write_text_atomic


def keep_before(path: str, step: int | None) -> tuple[list[dict], int]:
    """The JSON rows of ``path`` whose ``step`` is below ``step`` (all rows when None), and how many others there
    were. Those others (and a torn last line, written when a process died mid-line) are removed from the file,
    which is replaced whole (``write_text_atomic``), so a crash here leaves the old file or the new one."""
    if not os.path.isfile(path):
        return [], 0
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    kept: list[str] = []
    rows: list[dict] = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if step is None or row.get("step", -1) < step:
            kept.append(line)
            rows.append(row)
    if len(kept) != len(lines):
        write_text_atomic(path, "".join(x + "\n" for x in kept))
    return rows, len(lines) - len(kept)
