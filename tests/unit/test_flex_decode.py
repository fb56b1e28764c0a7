"""FlexAttention decode (``--rollout-decode-attention flex``) against the SDPA path, on CPU.

On CPU FlexAttention runs its eager reference implementation: it applies the step's ``mask_mod`` to
every column and ignores the block lists, so ``decode_blocks`` (what the CUDA kernel visits) is
checked on its own here; ``tests/gpu/test_flex_decode_gpu.py`` runs the compiled kernel. The tests
call the reference math without the dynamo wrapper eager FlexAttention puts around it (see the
fixture), which leaves the math and every line of tidal's code the same.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from flex_call import decode_attention_call, gqa7

from tidal.errors import UserError
from tidal.model import build_model
from tidal.rollout.fast import FastDecoder
from tidal.rollout.fast.flex_decode import FlexDecode, decode_blocks
from tidal.rollout.fast.static_cache import KVShape, StaticKVCache

GQA7 = gqa7(head_dim=8)


@pytest.fixture(autouse=True)
def eager_flex(monkeypatch):
    # FlexAttention's eager path wraps its reference math in a dynamo trace (backend "eager") at every new
    # shape: two thirds of these tests' CPU. torch's switch for that wrapper calls the same math directly.
    monkeypatch.setattr(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


@pytest.mark.parametrize("heads", [14, 4])  # GQA groups of 7 and 2
def test_flex_decode_attention_equals_the_sdpa_path(heads):
    gen = torch.Generator().manual_seed(heads)
    rows, kv_heads, dim, max_len, cpos = 6, 2, 16, 160, 100
    shape = KVShape(layers=2, kv_heads=kv_heads, head_dim=dim, dtype=torch.float32)
    caches = [StaticKVCache(shape, rows, max_len, "cpu") for _ in range(2)]
    init = torch.randn(caches[0].buf.shape, generator=gen)
    # Left padding: rows start at different columns, one row's only real column is the new one.
    start = torch.tensor([0, 5, 63, 64, 99, 100])
    query = torch.randn(rows, heads, 1, dim, generator=gen)
    key, value = torch.randn(2, rows, kv_heads, 1, dim, generator=gen)
    outs = []
    for cache, flex in zip(caches, (None, FlexDecode(compiled=False))):
        cache.buf.copy_(init)
        kv_len = 128 if flex is None else max_len  # SDPA: the bucket; flex: the whole cache
        outs.append(decode_attention_call(flex, cache, query, key, value, start, torch.tensor([cpos]), kv_len))
    assert outs[0].shape == (rows, 1, heads, dim)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0].buf, caches[1].buf)  # the new key/value written at column cpos, once
    assert torch.equal(caches[1].keys(1)[:, :, cpos], key[:, :, 0])


def test_decode_blocks_list_exactly_the_blocks_of_each_rows_columns():
    gen = torch.Generator().manual_seed(3)
    for block, max_len in ((64, 320), (16, 100), (128, 128)):
        n_blocks = -(-max_len // block)
        cpos = int(torch.randint(0, max_len, (1,), generator=gen))
        start = torch.randint(0, cpos + 1, (9,), generator=gen)
        start[0], start[1] = 0, cpos  # a full row and a row whose only column is the new one
        done = torch.rand(9, generator=gen) < 0.3
        done[0] = False
        num, idx = decode_blocks(start, torch.tensor([cpos]), block, n_blocks, done)
        assert num.shape == (9, 1, 1) and idx.shape == (9, 1, 1, n_blocks)
        assert num.dtype == idx.dtype == torch.int32
        for b in range(9):
            listed = idx[b, 0, 0, : int(num[b])].tolist()
            # A row that ended reads only the block of the new column (its output is never used).
            need = sorted({c // block for c in range(cpos if done[b] else int(start[b]), cpos + 1)})
            assert listed == need, (block, cpos, int(start[b]), bool(done[b]))
            assert int(idx[b].max()) < n_blocks


def test_flex_decoder_generates_what_the_sdpa_decoder_does():
    model = build_model(GQA7, seed=0).eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (int(k),), generator=gen).tolist() for k in torch.randint(2, 12, (6,))]
    limits = [1, 16, 3, 16, 2, 16]  # rows ending early: one compaction, from a bucket of 8 to 4
    kw = dict(max_batch=8, max_seq_len=32, check_every=4, kv_block=16)
    sdpa = FastDecoder(model, **kw)
    flex = FastDecoder(model, decode_attention="flex", **kw)
    # Sampled on one seed: equal logits draw equal tokens, so the tokens compare the whole rows.
    ref = sdpa.generate(prompts, max_new_tokens=limits, temperature=1.0, seed=7)
    res = flex.generate(prompts, max_new_tokens=limits, temperature=1.0, seed=7)
    assert res.tokens == ref.tokens
    assert max(abs(a - b) for r, s in zip(res.logprobs, ref.logprobs) for a, b in zip(r, s)) < 1e-5
    assert res.stats["decode_attention"] == "flex" and res.stats["compactions"] >= 1
    # One KV length (the whole cache) for every step: the batch bucket alone keys a graph.
    assert {k for _, k, _ in res.stats["buckets"]} == {32}
    assert len({k for _, k, _ in ref.stats["buckets"]}) >= 2
    with pytest.raises(UserError, match="sdpa or flex"):
        FastDecoder(model, decode_attention="flash", **kw)


def test_the_engine_builds_its_decoder_with_the_configured_kernel():
    from tidal.config.schema import RolloutConfig
    from tidal.memory.base import engine_policy
    from tidal.memory.portable import PortableBackend
    from tidal.rollout.fast.plug import build_decoder

    model = build_model(GQA7, seed=0).eval()
    backend = PortableBackend(engine_policy(), device="cpu", label="engine")
    for kernel in ("sdpa", "flex"):
        cfg = RolloutConfig(rollout_decode_attention=kernel)
        dec = build_decoder(model, cfg, device_type="cpu", pad_id=0, backend=backend, name="engine")
        assert dec.decode_attention == kernel and (dec._flex is not None) == (kernel == "flex")
    # The fused step and its cache-writing variant, as configured.
    for kv_write in (False, True):
        cfg = RolloutConfig(rollout_fused_decode=True, rollout_fused_kv_write=kv_write)
        dec = build_decoder(model, cfg, device_type="cpu", pad_id=0, backend=backend, name="engine")
        assert dec._fused is not None and dec._fused.write_kv == kv_write
