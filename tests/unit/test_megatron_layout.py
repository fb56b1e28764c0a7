"""The HF <-> Megatron-core layout: pure mapping round trips, the vocab-parallel log-softmax, and the
real ``GPTModel`` built on CPU (one rank, and TP = 2 over gloo) — see ``tests/megatron_cpu_rank.py``."""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from tidal.errors import UserError
from tidal.trainer.megatron import mapping
from tidal.trainer.megatron.model import megatron_available
from tidal.trainer.megatron.vocab import finish, shard_max, shard_sums

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_megatron = pytest.mark.skipif(
    not megatron_available(), reason="megatron-core is not installed (pip install 'tidal[megatron]')"
)


@functools.cache
def _tiny_cached(model_type: str, items: tuple):
    return _build_tiny(model_type, **dict(items))


def _tiny(model_type: str, **kw):
    return _tiny_cached(model_type, tuple(sorted(kw.items(), key=str)))


def _build_tiny(model_type: str, **kw):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[model_type]
    base = dict(
        vocab_size=37,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    base.update(kw)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cls(**base), dtype=torch.float32)


ARCHS = [
    ("llama", {"tie_word_embeddings": False}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {"tie_word_embeddings": False, "head_dim": 16}),
]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("model_type,kw", ARCHS)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2), (1, 4)])
def test_mapping_round_trip_is_bit_exact(model_type, kw, tp, pp):
    hf = _tiny(model_type, **kw)
    arch = mapping.arch_from_hf(hf.config)
    assert arch.qkv_bias == (model_type == "qwen2") and arch.qk_norm == (model_type == "qwen3")
    full = {n: p.detach() for n, p in hf.named_parameters()}
    back = {}
    for stage in range(pp):
        for e in mapping.entries(arch, pp_rank=stage, pp_size=pp):
            shards = [mapping.to_megatron(e, full.__getitem__, arch, r, tp) for r in range(tp)]
            if e.kind == "vocab":
                assert shards[0].shape[0] == arch.padded_vocab(tp) // tp
            for name, t in mapping.to_hf(e, shards, arch):
                assert name not in back
                back[name] = t
    assert sorted(back) == sorted(full)
    assert all(_bits(back[n]) == _bits(full[n]) for n in full)


def test_qkv_layout_follows_megatrons_grouped_rows():
    """Megatron's rule, written out here: per query group, its h/g query heads, then one key, then one value head."""
    hf = _tiny("qwen2", tie_word_embeddings=False)
    arch = mapping.arch_from_hf(hf.config)
    attn = hf.model.layers[0].self_attn
    e = next(e for e in mapping.entries(arch) if e.megatron.endswith("linear_qkv.bias"))
    get = {n: p.detach() for n, p in hf.named_parameters()}.__getitem__
    d, per = arch.head_dim, arch.num_heads // arch.num_kv_heads
    for tp in (1, 2):
        for r in range(tp):
            shard = mapping.to_megatron(e, get, arch, r, tp)
            rows = []
            for g in range(r * arch.num_kv_heads // tp, (r + 1) * arch.num_kv_heads // tp):
                rows += [attn.q_proj.bias[(g * per + h) * d : (g * per + h + 1) * d] for h in range(per)]
                rows += [attn.k_proj.bias[g * d : (g + 1) * d], attn.v_proj.bias[g * d : (g + 1) * d]]
            assert torch.equal(shard, torch.cat(rows).detach())


def test_fc1_shards_hold_gate_then_up():
    hf = _tiny("llama")
    arch = mapping.arch_from_hf(hf.config)
    mlp = hf.model.layers[1].mlp
    e = next(e for e in mapping.entries(arch) if e.megatron == "decoder.layers.1.mlp.linear_fc1.weight")
    get = {n: p.detach() for n, p in hf.named_parameters()}.__getitem__
    half = arch.ffn_hidden_size // 2
    shard = mapping.to_megatron(e, get, arch, 1, 2)
    assert torch.equal(shard[:half], mlp.gate_proj.weight[half:].detach())
    assert torch.equal(shard[half:], mlp.up_proj.weight[half:].detach())


@pytest.mark.parametrize(
    "change,tp,pp,match",
    [
        ({"model_type": "gpt2"}, 1, 1, "not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 1, 1, "rope scaling"),
        ({}, 4, 1, "--tensor-model-parallel-size 4"),
        ({}, 1, 3, "--pipeline-model-parallel-size 3"),
    ],
)
def test_unsupported_models_and_splits_are_refused(change, tp, pp, match):
    config = copy.deepcopy(_tiny("llama").config)
    for k, v in change.items():
        setattr(config, k, v)
    with pytest.raises(UserError, match=match):
        mapping.check_parallel(mapping.arch_from_hf(config), tp, pp)


@pytest.mark.parametrize("tp,vocab", [(1, 50), (2, 50), (4, 50), (4, 49)])
def test_vocab_parallel_logprobs_entropy_match_full_softmax(tp, vocab):
    """Shards of a simulated TP group, each reduced on its own, summed like the all-reduce: equal to the
    full log-softmax and entropy, and so are the gradients (through every shard)."""
    torch.manual_seed(0)
    padded = -(-vocab // tp) * tp
    leaf = torch.randn(3, 5, padded, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (3, 5))
    per = padded // tp
    shards = [leaf[..., r * per : (r + 1) * per] for r in range(tp)]
    m = torch.stack([shard_max(s, r * per, vocab) for r, s in enumerate(shards)]).amax(0)
    sums = torch.stack([shard_sums(s, targets, m, r * per, vocab) for r, s in enumerate(shards)]).sum(0)
    lp, ent = finish(sums, m)
    (lp.sum() + 0.3 * ent.sum()).backward()
    got_grad = leaf.grad.clone()
    leaf.grad = None
    logp = torch.log_softmax(leaf[..., :vocab], -1)
    ref_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_lp.sum() + 0.3 * ref_ent.sum()).backward()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    torch.testing.assert_close(got_grad, leaf.grad)
    assert torch.all(got_grad[..., vocab:] == 0)


def _free_port() -> int:
    # Where the driver picks rank 0's rendezvous port: outside the kernel's ephemeral range, which Ray's
    # processes draw from while the ranks start (a port-0 pick collided with one: EADDRINUSE at init).
    from tidal.cluster.groups import _free_port as rendezvous_port

    return rendezvous_port()


def _run_ranks(tmp_path, world: int, tp: int, pp: int, archs: str) -> dict:
    out, port = tmp_path / "result.json", str(_free_port())
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(ROOT, "tests", "megatron_cpu_rank.py"),
                str(r),
                str(world),
                str(tp),
                str(pp),
                port,
                str(out),
                archs,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text())


@pytest.mark.parametrize("model_type,kw", ARCHS)
def test_one_rank_weight_source_is_views_of_the_parameters(model_type, kw):
    """With one rank nothing is gathered: HF tensors are views of the Megatron parameters (QKV parts copied),
    cast only when asked."""
    from tidal.trainer.megatron.weights import Topology, iter_hf_weights

    hf = _tiny(model_type, **kw)
    arch = mapping.arch_from_hf(hf.config)
    full = {n: p.detach() for n, p in hf.named_parameters()}
    local = {e.megatron: mapping.to_megatron(e, full.__getitem__, arch) for e in mapping.entries(arch)}
    topo = Topology(rank=0, tp=1, cp=1, dp=1, pp=1)
    kept = dict(
        iter_hf_weights(
            local, arch, topo, shapes={}, dtype=None, read=lambda t: t, host=lambda t, d: t, on_device=False
        )
    )
    assert sorted(kept) == sorted(full) and all(_bits(kept[n]) == _bits(full[n]) for n in full)
    # Un-fusing QKV of several groups must copy; every other layout is a view of the parameter.
    for e in mapping.entries(arch):
        if e.kind != "qkv":
            base = local[e.megatron].untyped_storage().data_ptr()
            assert all(kept[n].untyped_storage().data_ptr() == base for n in e.hf), e
    bf16 = dict(
        iter_hf_weights(
            local,
            arch,
            topo,
            shapes={},
            dtype=torch.bfloat16,
            read=lambda t: t,
            host=lambda t, d: t.to(d),
            on_device=False,
        )
    )
    assert all(torch.equal(bf16[n], full[n].to(torch.bfloat16)) for n in full)


@needs_megatron
def test_megatron_gpt_model_on_cpu_matches_hf(tmp_path):
    """Megatron's own GPTModel (local spec, CPU init, TP = 2 over gloo): HF -> Megatron -> HF bit for bit
    through the weight source, logits equal to the HF model's, vocab-parallel log-probs/entropy and their
    gradients equal to the full-vocabulary ones, for all three architectures; Megatron's groups destroyed and
    rebuilt as around a pause with nothing left pointing at an old one; then PP = 2 (round trip); then
    MegatronTrainer.train over the two ranks as DP = 2, TP = 2, PP = 2 and DP = 2 with the distributed optimizer,
    all alike, the last one's checkpoint (saved while paused) loading back bit for bit."""
    archs = "llama,qwen2,qwen3"
    results = _run_ranks(tmp_path, world=2, tp=2, pp=1, archs=archs)
    assert sorted(results) == ["llama", "llama/pp2", "qwen2", "qwen2/pp2", "qwen3", "train"]
    # The training path over two ranks: TP = 2 and two pipeline stages train like two data-parallel ranks (the
    # same tokens and steps, losses, entropy, gradient norm over every shard), through a pause/resume each.
    train = results.pop("train")
    assert sorted(train) == ["dp2", "dp2-zero1", "dp2-zero1/load_bit_exact", "pp2", "tp2"]
    assert train.pop("dp2-zero1/load_bit_exact") is True
    for layout in ("tp2", "pp2", "dp2-zero1"):
        for got, ref in zip(train[layout], train["dp2"], strict=True):
            assert got["tokens"] == ref["tokens"] and got["optimizer_steps"] == ref["optimizer_steps"], layout
            for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
                assert abs(got[k] - ref[k]) <= 1e-5 * max(1.0, abs(ref[k])), (layout, k, got[k], ref[k])
    assert train["dp2"][1]["kl"] > 0 and train["dp2"][1]["optimizer_steps"] == 2
    for name in ("llama/pp2", "qwen2/pp2"):  # two pipeline stages: the round trip only
        r = results.pop(name)
        assert r["names_equal"] and r["bitwise"], name
    rebuilt = results["llama"]  # process groups of two ranks destroyed and rebuilt, as around a pause
    assert rebuilt["released"] > 10 and rebuilt["repointed"] > 0 and rebuilt["stale"] == [], rebuilt
    assert rebuilt["tp_group_new"] and rebuilt["rebuilt_logits_equal"], rebuilt
    for name, r in results.items():
        assert r["names_equal"] and r["bitwise"], name
        assert r["logits_max_abs_diff"] < 1e-5, (name, r)
        assert r["logprob_max_abs_diff"] < 1e-5 and r["entropy_max_abs_diff"] < 1e-5, (name, r)
        assert r["grad_max_abs_diff"] < 1e-6, (name, r)
