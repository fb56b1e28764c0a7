"""Bit-for-bit comparison of trainer and engine weights (``--check-weight-update-equal``).

The driver randomises engine weights before the first sync, syncs, then compares
``trainer.weight_checksums()`` with each ``engine.weight_checksums()`` (name -> checksum of the
tensor's bytes in the engine dtype). Any weight the sync missed keeps its random bytes and shows up
here, as does any weight only one side has.
"""

from __future__ import annotations


def compare_checksums(trainer: dict[str, str], engine: dict[str, str]) -> list[str]:
    """One line per mismatch (missing on either side, or different bytes); empty when equal."""
    out = []
    for name in sorted(set(trainer) | set(engine)):
        if name not in engine:
            out.append(f"{name}: missing on the engine")
        elif name not in trainer:
            out.append(f"{name}: the engine has it, the trainer did not send it")
        elif trainer[name] != engine[name]:
            out.append(f"{name}: bytes differ (trainer {trainer[name][:12]}, engine {engine[name][:12]})")
    return out
