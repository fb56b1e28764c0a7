"""Models and tokenizers: built-in presets (built from a config, random init) and local HF folders."""

from tidal.model.load import ModelSpec, build_model, load_tokenizer, resolve_model

__all__ = ["ModelSpec", "build_model", "load_tokenizer", "resolve_model"]
