"""Correction functions loaded by path in tests (through --custom-tis-function-path, as a user would)."""

from __future__ import annotations

import torch

from tidal.algos.correction import Correction


def halve(inputs, cfg):
    """Every token's loss weighted by 0.5, nothing dropped."""
    m = inputs.mask.to(torch.bool)
    return Correction(torch.full(m.shape, 0.5), torch.ones_like(m), torch.zeros_like(m))


def not_a_correction(inputs, cfg):
    return {"weights": 1.0}
