"""dtype names and torch dtypes in one table, and the one default: bf16 on CUDA, fp32 elsewhere.

Config, the wire format of weight buckets and the engines name dtypes by torch's own names
(``"bfloat16"``); flags also take the short forms (``bf16``, ``fp32``, ``fp16``). ``dtype_of``
resolves any name the table knows (buckets carry integer and fp8 tensors too); ``as_dtype`` only
the floating types a model computes in, as a user-facing check. Torch is imported on first use,
so the config layer can use the name rules without it.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from tidal.errors import ConfigError

if TYPE_CHECKING:
    import torch

SHORT = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_COMPUTE = ("float32", "bfloat16", "float16")
WIRE_NAMES = (*_COMPUTE, "float64", "int64", "int32", "int16", "int8", "uint8", "bool", "float8_e4m3fn", "float8_e5m2")


def default_dtype_name(device: str) -> str:
    """The dtype engines hold weights in and the trainer computes in by default: bf16 on CUDA, else fp32."""
    return "bfloat16" if device == "cuda" else "float32"


def default_dtype(device: str) -> torch.dtype:
    return dtype_of(default_dtype_name(device))


def short_name(name: str) -> str:
    """``bfloat16`` -> ``bf16`` (the form of flags like ``--param-dtype``)."""
    return {v: k for k, v in SHORT.items()}.get(name, name)


@cache
def _table() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in WIRE_NAMES}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a full or short name the table knows (``KeyError`` otherwise: a wire-format bug)."""
    return _table()[SHORT.get(name, name)]


def as_dtype(d: str | torch.dtype | None) -> torch.dtype | None:
    """A floating compute dtype from a name (full, short or ``torch.``-prefixed), a dtype, or None."""
    if d is None or not isinstance(d, str):
        return d
    name = d.removeprefix("torch.")
    name = SHORT.get(name, name)
    if name not in _COMPUTE:
        raise ConfigError(f"dtype {d!r}: use float32 or bfloat16")
    return dtype_of(name)
