"""Resolve ``--model`` into a buildable spec, and build models and tokenizers from it.

``--model`` is either a preset name (a transformers config built here, random init, no download)
or a local Hugging Face folder. Trainer and engines build from the same ``ModelSpec`` with the same
seed, so their initial weights agree before the first sync.

torch and transformers are imported by the functions that build things, not by this module: the
driver of ``tidal train`` resolves presets and plans memory without them (they take seconds to
import on a small host, and every actor process imports them anyway).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tidal.errors import UserError
from tidal.model.tokenizer import CHARS, SPECIALS, DriverCharTokenizer, char_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

_CHAR_VOCAB = len(SPECIALS) + len(CHARS)


# A preset's numbers, in this order (transformers' config names).
_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


def _decoder(*numbers: int, tied: bool, **extra) -> dict:
    """A decoder's config kwargs from its numbers (in ``_FIELDS`` order), tied embeddings or not, and the rest."""
    return {**dict(zip(_FIELDS, numbers, strict=True)), "tie_word_embeddings": tied, **extra}


_TINY = (64, 64, 176, 2, 4, 2, 256)  # vocab: the char tokenizer's, rounded up to 64
# Preset name -> (architecture, config kwargs): vocab, hidden, intermediate, layers, heads, KV heads,
# max positions, tied embeddings, then any other kwargs.
PRESETS: dict[str, tuple[str, dict]] = {
    "tiny": ("llama", _decoder(*_TINY, tied=False)),
    "tiny-qwen2": ("qwen2", _decoder(*_TINY, tied=True)),
    # Shape of Qwen2.5-0.5B with the char tokenizer's vocabulary padded to its real size.
    "qwen2.5-0.5b-shape": ("qwen2", _decoder(151936, 896, 4864, 24, 14, 2, 32768, tied=True, rope_theta=1e6)),
    # Shape of Qwen2.5-7B (untied embeddings), for planning multi-GPU runs.
    "qwen2.5-7b-shape": ("qwen2", _decoder(152064, 3584, 18944, 28, 28, 4, 32768, tied=False, rope_theta=1e6)),
    # Shape of Qwen3-4B.
    "qwen3-4b-shape": (
        "qwen3",
        _decoder(151936, 2560, 9728, 36, 32, 8, 40960, tied=True, head_dim=128, rope_theta=1e6),
    ),
}


@dataclass
class ModelSpec:
    """Everything an actor needs to build the model: a preset config or a local folder."""

    name: str
    path: str | None = None  # local HF folder; None for presets
    arch: str | None = None
    config_kwargs: dict = field(default_factory=dict)
    tokenizer_path: str | None = None
    trust_remote_code: bool = False

    @property
    def is_preset(self) -> bool:
        return self.path is None

    def config_dict(self) -> dict:
        """The config's values without transformers: the preset's kwargs or the folder's config.json
        (``{}`` when it cannot be read; building the model reports why)."""
        if self.is_preset:
            return {"model_type": self.arch, **self.config_kwargs}
        try:
            with open(os.path.join(self.path, "config.json")) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return {}
        return config if isinstance(config, dict) else {}


def resolve_model(model: str, tokenizer: str | None = None, trust_remote_code: bool = False) -> ModelSpec:
    """Turn ``--model`` into a spec, failing with a clear message when it names nothing usable."""
    if model in PRESETS:
        arch, kwargs = PRESETS[model]
        return ModelSpec(name=model, arch=arch, config_kwargs=dict(kwargs), tokenizer_path=tokenizer)
    if model == "smollm2-135m":
        from tidal.model.smollm2 import smollm2_folder

        path = smollm2_folder()
        return ModelSpec(name=model, path=path, tokenizer_path=tokenizer or path)
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise UserError(
                f"--model {model}: folder has no config.json; pass a Hugging Face model folder or a preset ({', '.join(PRESETS)}, smollm2-135m)"
            )
        return ModelSpec(
            name=os.path.basename(os.path.normpath(model)),
            path=model,
            tokenizer_path=tokenizer or model,
            trust_remote_code=trust_remote_code,
        )
    raise UserError(
        f"--model {model}: no such folder or preset; use a local Hugging Face model folder or one of: {', '.join(PRESETS)}, smollm2-135m"
    )


def model_config(spec: ModelSpec) -> PretrainedConfig:
    from transformers import AutoConfig

    if spec.is_preset:
        return AutoConfig.for_model(spec.arch, **spec.config_kwargs)
    return AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)


def build_model(
    spec: ModelSpec, *, dtype: torch.dtype | None = None, seed: int = 0, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """Build the causal LM (``dtype`` None: fp32). Presets are initialised from ``seed`` so every actor
    builds the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    if spec.is_preset:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(model_config(spec), dtype=dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(
            spec.path, dtype=dtype, attn_implementation="sdpa", trust_remote_code=spec.trust_remote_code
        ).to(device)
    model.config.use_cache = True
    return model


# A preset drawn on the device holds its full fp32 copy there for a moment (next to the trainer's
# shards or the engine's cast copy, and the other side doing the same on a shared GPU): only when
# that copy is a small part of the device.
INIT_ON_DEVICE_MAX_FRACTION = 0.125


def preset_init_device(spec: ModelSpec, device: torch.device, on_device: bool) -> torch.device:
    """Where a preset draws its initial weights: ``device`` when ``on_device`` and it is a GPU whose
    memory the fp32 model fits in ``INIT_ON_DEVICE_MAX_FRACTION`` of, else the host. Both sides
    decide from the same numbers (the config and the device's size), so they draw in the same place."""
    import torch

    from tidal.model.shape import count_decoder

    if not (on_device and spec.is_preset and device.type == "cuda"):
        return torch.device("cpu")
    count = count_decoder(spec.arch, spec.config_kwargs)
    total = torch.cuda.get_device_properties(device).total_memory
    if count is None or 4 * count.params > INIT_ON_DEVICE_MAX_FRACTION * total:
        return torch.device("cpu")
    return device


def load_tokenizer(spec: ModelSpec, *, driver: bool = False):
    """The model's tokenizer (transformers'); ``driver``: the char tokenizer of a preset without importing
    transformers (``DriverCharTokenizer``: a run's driver reads the prompts with it beside Ray's start)."""
    if spec.tokenizer_path is None:
        return DriverCharTokenizer() if driver else char_tokenizer()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec.tokenizer_path, trust_remote_code=spec.trust_remote_code)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
