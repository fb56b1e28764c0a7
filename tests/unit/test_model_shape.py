"""The memory plan's model shape by arithmetic (``tidal.model.shape``) against the model transformers builds."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tidal.config.plan import _counted, _meta_shape, _shape
from tidal.model.load import PRESETS, ModelSpec, resolve_model
from tidal.model.shape import FAMILIES, count_decoder

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)

CASES = [(name, *PRESETS[name]) for name in PRESETS] + [
    # Each family with only the few numbers set: every other value is transformers' default.
    ("llama-defaults", "llama", dict(SMALL)),
    ("qwen2-defaults", "qwen2", dict(SMALL, num_key_value_heads=2)),
    ("qwen3-defaults", "qwen3", dict(SMALL, num_key_value_heads=2)),
    ("qwen3-default-head-dim", "qwen3", dict(SMALL, num_key_value_heads=4, head_dim=None)),
    ("llama-biases", "llama", dict(SMALL, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    ("llama-head-dim", "llama", dict(SMALL, head_dim=16, num_key_value_heads=1)),
    ("qwen3-bias", "qwen3", dict(SMALL, attention_bias=True, head_dim=8, tie_word_embeddings=True)),
    # SmolLM2-135M's numbers (tied Llama, 9 heads over 3 KV heads).
    (
        "smollm2-135m-shape",
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
        ),
    ),
]


def _built(arch: str, kwargs: dict) -> dict:
    config = AutoConfig.for_model(arch, **{k: v for k, v in kwargs.items() if v is not None})
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    params = list(net.parameters())
    return {
        "arch": type(net).__name__,
        "params": sum(p.numel() for p in params),
        "num_tensors": len(params),
        "largest_tensor": max(p.numel() for p in params),
    }


@pytest.mark.parametrize("name,arch,kwargs", CASES, ids=[c[0] for c in CASES])
def test_count_matches_the_built_model(name, arch, kwargs):
    counted = count_decoder(arch, kwargs)
    assert counted is not None
    want = _built(arch, kwargs)
    assert {k: getattr(counted, k) for k in want} == want


def test_presets_take_the_arithmetic_path_and_agree_with_the_meta_build():
    for name in PRESETS:
        spec = resolve_model(name)
        assert _counted(spec) is not None, name
        assert _shape(name, None, False) == _meta_shape(spec), name


def test_hf_folder_is_counted_from_its_config_json(tmp_path):
    config = AutoConfig.for_model("qwen2", **SMALL, num_key_value_heads=2, tie_word_embeddings=True)
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(tmp_path)
    spec = ModelSpec(name="folder", path=str(tmp_path), tokenizer_path=str(tmp_path))
    counted = _counted(spec)
    assert counted is not None
    meta = dataclasses.asdict(_meta_shape(spec))
    assert {"name": meta.pop("name"), **dataclasses.asdict(counted)} == {"name": "folder", **meta}


def test_other_families_and_remote_code_fall_back_to_the_meta_build(tmp_path):
    assert count_decoder("gpt2", {"n_embd": 32}) is None
    assert count_decoder("llama", {**SMALL, "architectures": ["LlamaForSequenceClassification"]}) is None
    assert set(FAMILIES) == {"llama", "qwen2", "qwen3"}
    spec = ModelSpec(name="remote", path=str(tmp_path), trust_remote_code=True)
    assert _counted(spec) is None


def test_presets_draw_on_the_device_only_when_small_against_it(monkeypatch):
    """``--init-on-device`` draws a preset on a GPU when its fp32 copy is a small part of that GPU,
    else on the host (both sides decide alike); never for a folder model or on the CPU."""
    import torch

    from tidal.model.load import ModelSpec, preset_init_device, resolve_model

    class Props:
        total_memory = 80 << 30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert preset_init_device(resolve_model("qwen2.5-0.5b-shape"), gpu, True) == gpu  # 2 GB of 80
    assert preset_init_device(resolve_model("qwen2.5-7b-shape"), gpu, True) == cpu  # 30 GB of 80
    assert preset_init_device(resolve_model("qwen2.5-0.5b-shape"), gpu, False) == cpu
    assert preset_init_device(resolve_model("tiny"), cpu, True) == cpu
    assert preset_init_device(ModelSpec(name="folder", path="/some/model"), gpu, True) == cpu
