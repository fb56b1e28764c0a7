"""The fast decode path on CPU: same tokens as transformers, policy log-probs, compaction, limits, memory."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from tidal.errors import UserError
from tidal.memory.base import StateClass, engine_policy
from tidal.memory.portable import PortableBackend
from tidal.model import build_model, resolve_model
from tidal.model.load import ModelSpec
from tidal.rollout.fast import FastDecoder, batch_buckets, sample, sampling_mode
from tidal.rollout.fast.sampling import blocked_core, drawn_core, plain_core, vocab_block
from tidal.rollout.fast.static_cache import kv_shape, prefill_workspace_bytes, workspace_bytes_per_row
from tidal.rollout.generate import left_pad, teacher_forced_logprobs

NAMES = ("tiny", "tiny-qwen2")


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny matmuls: a second intra-op thread only adds contention on a shared 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# A Qwen3-style model (q/k norms, explicit head_dim) at the tiny presets' size.
QWEN3 = ModelSpec(
    name="tiny-qwen3",
    arch="qwen3",
    config_kwargs=dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
)


@pytest.fixture(scope="module")
def models():
    out = {name: build_model(resolve_model(name), seed=0).eval() for name in NAMES}
    out["tiny-qwen3"] = build_model(QWEN3, seed=0).eval()
    return out


def _prompts(n: int, seed: int, lo: int = 2, hi: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return [torch.randint(3, 64, (k,), generator=gen).tolist() for k in lens]


def _hf_greedy(model, prompts, new: int) -> list[list[int]]:
    ids, mask = left_pad(prompts, 0)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=0, eos_token_id=None
        )
    return out[:, ids.shape[1] :].tolist()


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max((abs(x - y) for r, s in zip(a, b) for x, y in zip(r, s)), default=0.0)


@pytest.mark.parametrize("name", [*NAMES, "tiny-qwen3"])
def test_greedy_equals_transformers_generate(models, name):
    model = models[name]
    prompts = _prompts(11, seed=1)
    dec = FastDecoder(model, max_batch=16, max_seq_len=64, check_every=2)
    res = dec.generate(prompts, max_new_tokens=12, temperature=0)
    assert res.tokens == _hf_greedy(model, prompts, 12)
    assert res.stopped == [False] * len(prompts)
    # Greedy log-probs are still the raw policy's.
    assert _max_diff(res.logprobs, teacher_forced_logprobs(model, prompts, res.tokens)) < 1e-5


def test_prefill_leaves_out_cudnn_attention_and_decode_does_not(models):
    # cuDNN's SDPA builds a graph per new shape (tens of ms); a prefill's width changes with every batch's
    # longest prompt, so the prefill's attention runs without it. The flags are global, so a CPU run sees them.
    model = models["tiny"]
    seen: list[tuple[int, bool, bool]] = []

    def hook(module, args, kwargs, out):
        seen.append(
            (
                kwargs["hidden_states"].shape[1],
                torch.backends.cuda.cudnn_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(),
            )
        )

    handle = model.model.layers[0].self_attn.register_forward_hook(hook, with_kwargs=True)
    try:
        prompts = _prompts(6, seed=3, lo=5, hi=9)
        FastDecoder(model, max_batch=8, max_seq_len=32, check_every=2).generate(
            prompts, max_new_tokens=3, temperature=0
        )
    finally:
        handle.remove()
    width = max(len(p) for p in prompts)
    assert [s for s in seen if s[0] == width] == [(width, False, True)]  # the prefill
    assert [s[1:] for s in seen if s[0] == 1] == [(True, True)] * 2  # both decode steps: cuDNN allowed
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after


@pytest.mark.parametrize("name", NAMES)
def test_sampled_logprobs_match_teacher_forced(models, name):
    model = models[name]
    prompts = _prompts(9, seed=2)
    dec = FastDecoder(model, max_batch=16, max_seq_len=64)
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 8, 0.95), (1.0, 5, 1.0)):
        res = dec.generate(prompts, max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p, seed=3)
        forced = teacher_forced_logprobs(model, prompts, res.tokens)
        assert _max_diff(res.logprobs, forced) < 1e-5, (temperature, top_k, top_p)
        assert all(len(t) == 10 for t in res.tokens)
    # Sampling really samples: not the greedy continuation.
    assert res.tokens != dec.generate(prompts, max_new_tokens=10, temperature=0).tokens


def test_top_k_samples_stay_in_the_top_k(models):
    model = models["tiny"]
    prompts = _prompts(6, seed=4)
    res = FastDecoder(model, max_batch=8, max_seq_len=64).generate(prompts, max_new_tokens=8, top_k=3, seed=5)
    for p, toks in zip(prompts, res.tokens):
        ids = torch.tensor([p + toks])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]
        top = logits.topk(3, dim=-1).indices
        assert all(t in top[i].tolist() for i, t in enumerate(toks))


def test_compaction_and_waves_do_not_change_outputs(models):
    model = models["tiny-qwen2"]
    prompts = _prompts(13, seed=6)
    limits = [1, 2, 3, 5, 8, 13, 20, 2, 4, 6, 1, 17, 9]
    plain = FastDecoder(model, max_batch=16, max_seq_len=64, compaction=False).generate(
        prompts, max_new_tokens=limits, temperature=0
    )
    compact = FastDecoder(model, max_batch=16, max_seq_len=64, check_every=1)
    early: dict[int, tuple] = {}

    def ended(rows, results):  # rows handed on at the host syncs, before the call returns
        assert not set(rows) & set(early)
        early.update(zip(rows, results))

    res = compact.generate(prompts, max_new_tokens=limits, temperature=0, on_rows_done=ended)
    assert res.stats["compactions"] >= 2
    # Every row that ended before the last sync was handed on once, as the result holds it (compaction included).
    assert set(early) == {i for i, lim in enumerate(limits) if lim < max(limits)}
    for i, (tok, lp, stopped) in early.items():
        assert (tok, lp, stopped) == (res.tokens[i], res.logprobs[i], res.stopped[i])
    assert [b for b, _, _ in res.stats["buckets"]][-1] < 16
    assert res.tokens == plain.tokens
    assert _max_diff(res.logprobs, plain.logprobs) < 1e-5
    assert [len(t) for t in res.tokens] == limits
    early.clear()
    waves = FastDecoder(model, max_batch=4, max_seq_len=64, check_every=3).generate(
        prompts, max_new_tokens=limits, temperature=0, on_rows_done=ended
    )
    assert waves.stats["waves"] == 4
    assert waves.tokens == plain.tokens
    assert early and all(early[i][0] == waves.tokens[i] for i in early)  # indices of the call, across waves


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2"])
def test_equal_prompts_are_prefilled_once_with_the_same_results(models, name):
    """Rows with equal prompts (a GRPO group, and repeats that are not next to each other) share one prefill
    row: the forward covers the distinct prompts of each chunk, and the tokens and log-probs are those of a
    decoder that prefills every row, greedy and sampled with a seed; chunks that split a group, stored
    prefixes and the helpers' own contract included."""
    from tidal.rollout.fast.prefix import prefill_chunks, shared_prompts

    model = models[name]
    base = _prompts(5, seed=11)
    prompts = [p for p in base for _ in range(3)] + [base[1], base[4], base[1]]  # 18 rows, 5 distinct
    assert shared_prompts([[1], [2], [1], [3], [2]]) == ([0, 1, 3], [0, 1, 0, 2, 1])
    # A forward's budget counts distinct prompts when sharing, rows otherwise.
    assert prefill_chunks([[1], [1], [2], [2], [3], [1]], 1, 2, share=True) == [(0, 4), (4, 6)]
    assert prefill_chunks([[1], [1], [2], [2], [3], [1]], 1, 2, share=False) == [(0, 2), (2, 4), (4, 6)]
    assert prefill_chunks([[1, 2, 3]], 3, 1, share=True) == [(0, 1)]  # a prompt over the budget: alone
    width = max(len(p) for p in prompts)
    for kw in (dict(), dict(prefill_tokens=2 * width), dict(prefix_cache_bytes=1 << 20)):
        for sampling in (dict(temperature=0), dict(temperature=1.0, seed=5)):
            shared = FastDecoder(model, max_batch=32, max_seq_len=64, **kw)
            every = FastDecoder(model, max_batch=32, max_seq_len=64, share_prompts=False, **kw)
            a = shared.generate(prompts, max_new_tokens=9, **sampling)
            b = every.generate(prompts, max_new_tokens=9, **sampling)
            assert a.tokens == b.tokens, (kw, sampling)
            assert _max_diff(a.logprobs, b.logprobs) < 1e-5, (kw, sampling)
            assert b.stats["prefill_rows"] == len(prompts)
            # One chunk: 5 distinct prompts; two prompts a chunk: rows 0-5, 6-11 and 12-17 (base 4 and 1 again).
            assert a.stats["prefill_rows"] == (6 if "prefill_tokens" in kw else 5), (kw, a.stats["prefill_rows"])
        if "prefix_cache_bytes" in kw:  # the next turn's prompts start with these: their stored KV is reused
            longer = [p + [7, 8] for p in prompts]
            again = shared.generate(longer, max_new_tokens=4, temperature=0)
            ref = FastDecoder(model, max_batch=32, max_seq_len=64).generate(longer, max_new_tokens=4, temperature=0)
            assert again.tokens == ref.tokens and shared.prefixes.hits > 0


def test_row_limits_and_stop_ids(models):
    model = models["tiny"]
    prompts = _prompts(8, seed=7)
    limits = [3, 12, 7, 12, 1, 12, 5, 10]
    dec = FastDecoder(model, max_batch=8, max_seq_len=64, check_every=2)
    free = dec.generate(prompts, max_new_tokens=12, temperature=0).tokens
    stop = free[1][4]
    res = dec.generate(prompts, max_new_tokens=limits, temperature=0, stop_ids=[stop, 63])
    for row, lim, got, ended in zip(free, limits, res.tokens, res.stopped):
        row = row[:lim]
        cut = row.index(stop) + 1 if stop in row else (row.index(63) + 1 if 63 in row else lim)
        if 63 in row and stop in row:
            cut = min(row.index(stop), row.index(63)) + 1
        assert got == row[:cut]
        assert ended == (cut < lim or row[cut - 1] in (stop, 63))
    assert res.stopped[1] and len(res.tokens[1]) <= 5
    assert all(len(t) == len(lp) for t, lp in zip(res.tokens, res.logprobs))


def test_seed_makes_sampling_reproducible(models):
    dec = FastDecoder(models["tiny"], max_batch=8, max_seq_len=48)
    prompts = _prompts(5, seed=8)
    a = dec.generate(prompts, max_new_tokens=9, seed=11)
    b = dec.generate(prompts, max_new_tokens=9, seed=11)
    c = dec.generate(prompts, max_new_tokens=9, seed=12)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert a.tokens != c.tokens
    torch.manual_seed(5)
    d = dec.generate(prompts, max_new_tokens=9)
    torch.manual_seed(5)
    assert dec.generate(prompts, max_new_tokens=9).tokens == d.tokens


def _warped_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What transformers samples from: temperature, then top-k, then top-p, then softmax."""
    scores = logits[None].clone()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0]


@pytest.mark.parametrize(
    "temperature,top_k,top_p,fused",
    [
        (1.0, 0, 1.0, None),
        (0.6, 0, 1.0, None),
        (1.0, 4, 1.0, None),
        (1.0, 0, 0.7, None),
        (1.5, 6, 0.8, None),
        (1.0, 0, 1.0, plain_core),
        (0.6, 0, 1.0, plain_core),
    ],
)
def test_sampling_distribution_follows_transformers_warpers(temperature, top_k, top_p, fused):
    vocab, rows = 12, 60000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 1.5
    mode = sampling_mode(temperature, top_p, top_k, vocab)
    gen = torch.Generator().manual_seed(1)
    tokens, logprobs = sample(
        logits.expand(rows, vocab), mode, torch.tensor([temperature]), torch.tensor([top_p]), gen, fused=fused
    )
    freq = torch.bincount(tokens, minlength=vocab).double() / rows
    expected = _warped_probs(logits, temperature, top_k, top_p).double()
    assert (freq - expected).abs().max() < 0.01, (freq, expected)
    assert freq[expected == 0].sum() == 0  # filtered tokens are never drawn
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(logprobs, raw[tokens], atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_noise_drawn_inside_the_core_samples_the_same_distribution(temperature):
    """drawn_core (its noise drawn inside, for a compiled kernel to fuse) samples softmax(logits / T), with
    the raw log-probs; run eagerly here through ``sample``, on torch's default generator. Greedy rows
    and filters keep their own paths."""
    vocab, rows = 12, 60000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 1.5
    torch.manual_seed(2)
    t = torch.tensor([temperature])
    mode = sampling_mode(temperature, 1.0, 0, vocab)
    tokens, logprobs = sample(logits.expand(rows, vocab), mode, t, t, fused=plain_core, drawn=drawn_core)
    freq = torch.bincount(tokens, minlength=vocab).double() / rows
    expected = _warped_probs(logits, temperature, 0, 1.0).double()
    assert (freq - expected).abs().max() < 0.01, (freq, expected)
    assert torch.allclose(logprobs, torch.log_softmax(logits, dim=-1)[tokens], atol=1e-6)
    never = lambda *a: pytest.fail("drawn_core used outside unfiltered sampling")  # noqa: E731
    greedy, _ = sample(logits.expand(3, vocab), sampling_mode(0.0, 1.0, 0, vocab), t, t, fused=plain_core, drawn=never)
    assert greedy.tolist() == [int(logits.argmax())] * 3
    top2, _ = sample(logits.expand(50, vocab), sampling_mode(1.0, 1.0, 2, vocab), t, t, torch.Generator(), drawn=never)
    assert set(top2.tolist()) <= set(logits.topk(2).indices.tolist())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_blocked_sampling_draws_softmax_in_two_stages(temperature):
    """blocked_core (--rollout-sampler-noise blocks): a block of words by its mass, then a word of it, samples
    softmax(logits / T) exactly, whatever the block a word sits in (three blocks of 32 here, one holding most
    of the mass), with the raw log-probs. Greedy rows and filters keep their own paths."""
    vocab, rows = 96, 120000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 1.5
    logits[40:44] += 3.0  # most of the mass in the second block
    t = torch.tensor([temperature])
    mode = sampling_mode(temperature, 1.0, 0, vocab)
    gen = torch.Generator().manual_seed(4)
    tokens, logprobs = sample(logits.expand(rows, vocab), mode, t, t, gen, blocked=blocked_core)
    freq = torch.bincount(tokens, minlength=vocab).double() / rows
    expected = _warped_probs(logits, temperature, 0, 1.0).double()
    assert (freq - expected).abs().max() < 0.006, (freq - expected).abs().max()
    blocks = freq.view(3, 32).sum(1), expected.view(3, 32).sum(1)
    assert (blocks[0] - blocks[1]).abs().max() < 0.006, blocks
    assert torch.allclose(logprobs, torch.log_softmax(logits, dim=-1)[tokens], atol=1e-5)
    never = lambda *a: pytest.fail("blocked_core used outside unfiltered sampling")  # noqa: E731
    greedy, _ = sample(logits.expand(3, vocab), sampling_mode(0.0, 1.0, 0, vocab), t, t, blocked=never)
    assert greedy.tolist() == [int(logits.argmax())] * 3
    top2, _ = sample(
        logits.expand(50, vocab), sampling_mode(1.0, 1.0, 2, vocab), t, t, torch.Generator(), blocked=never
    )
    assert set(top2.tolist()) <= set(logits.topk(2).indices.tolist())


def test_vocab_blocks():
    assert [vocab_block(v) for v in (151936, 128256, 152064, 96, 64, 50257, 40)] == [128, 256, 256, 32, 64, 0, 0]


def test_decoder_samples_with_blocks_or_says_why_not(models):
    """A decoder with sampler_noise="blocks" (uncompiled on the CPU) samples through blocked_core: the
    log-probs are the model's, a seed repeats its tokens, another seed and greedy differ; a vocabulary
    no block divides keeps the buffer and names the reason."""
    model = models["tiny-qwen2"]
    prompts = _prompts(9, seed=2)
    dec = FastDecoder(model, max_batch=16, max_seq_len=64, sampler_noise="blocks")
    a = dec.generate(prompts, max_new_tokens=10, temperature=0.8, seed=3)
    assert a.stats["sampler_noise"] == "blocks" and a.stats["sampler_fallback_reason"] is None
    assert _max_diff(a.logprobs, teacher_forced_logprobs(model, prompts, a.tokens)) < 1e-5
    assert a.tokens == dec.generate(prompts, max_new_tokens=10, temperature=0.8, seed=3).tokens
    assert a.tokens != dec.generate(prompts, max_new_tokens=10, temperature=0.8, seed=4).tokens
    assert a.tokens != dec.generate(prompts, max_new_tokens=10, temperature=0).tokens
    odd = build_model(ModelSpec(name="tiny-40", arch="qwen3", config_kwargs={**QWEN3.config_kwargs, "vocab_size": 40}))
    res = FastDecoder(odd.eval(), max_batch=4, max_seq_len=32, sampler_noise="blocks").generate(
        [[1, 2, 3]], max_new_tokens=4, temperature=1.0, seed=0
    )
    assert res.stats["sampler_noise"] == "buffer" and "(40)" in res.stats["sampler_fallback_reason"]
    with pytest.raises(UserError, match="choose buffer, drawn or blocks"):
        FastDecoder(model, max_batch=4, max_seq_len=32, sampler_noise="gumbel")


def test_sampling_modes():
    assert sampling_mode(0.0, 0.5, 3, 100).greedy
    assert sampling_mode(1.0, 1.0, 100, 100).top_k == 0  # k >= vocab is no filter
    assert sampling_mode(1.0, 1.0, 0, 100).name == "sample"
    assert sampling_mode(0.5, 0.9, 4, 100).name == "topk4+topp+temp"
    assert batch_buckets(1) == [1]
    assert batch_buckets(100) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 100]


def test_memory_budget_sets_rows_and_rejects_too_small(models):
    model = models["tiny"]
    prompts = _prompts(7, seed=9)
    big = FastDecoder(model, max_batch=16, max_seq_len=32).generate(prompts, max_new_tokens=6, temperature=0)
    cfg = model.config
    per_row = kv_shape(cfg, torch.float32).bytes_per_token * 32 + workspace_bytes_per_row(cfg, torch.float32, 32)
    fixed = prefill_workspace_bytes(cfg, torch.float32, 64)
    budget = fixed + 3 * per_row + per_row // 2
    small = FastDecoder(model, max_batch=16, max_seq_len=32, prefill_tokens=64, mem_bytes=budget)
    assert small.plan()["rows"] == 3
    res = small.generate(prompts, max_new_tokens=6, temperature=0)
    assert res.stats["rows"] == 3 and res.stats["waves"] == 3
    assert res.tokens == big.tokens
    with pytest.raises(UserError, match="rollout-mem-fraction"):
        FastDecoder(model, max_seq_len=32, mem_bytes=1000).generate(prompts, max_new_tokens=4)
    with pytest.raises(UserError, match="max_new_tokens"):
        FastDecoder(model).generate(prompts, max_new_tokens=[1, 2])


def test_memory_backend_pause_resume_and_release(models):
    model = models["tiny-qwen2"]
    prompts = _prompts(6, seed=10)
    backend = PortableBackend(engine_policy(), device="cpu", label="engine")
    dec = FastDecoder(model, max_batch=8, max_seq_len=48, region=lambda: backend.region(StateClass.KV_CACHE))
    backend.register(StateClass.KV_CACHE, dec.kv_tensors)
    first = dec.generate(prompts, max_new_tokens=7, temperature=0)
    cache_bytes = dec.cache.nbytes
    report = backend.pause([StateClass.KV_CACHE])
    assert report.classes[0].bytes >= cache_bytes
    assert dec.cache.buf.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="released"):
        dec.generate(prompts, max_new_tokens=7, temperature=0)
    backend.resume([StateClass.KV_CACHE])
    # Resumed memory is uninitialised: garbage must not leak into the next call.
    dec.cache.buf.fill_(math.nan)
    dec.s_cols.fill_(-7)
    dec.s_out_lp.fill_(math.nan)
    again = dec.generate(prompts, max_new_tokens=7, temperature=0)
    assert again.tokens == first.tokens
    assert _max_diff(again.logprobs, first.logprobs) < 1e-6
    dec.release()
    assert dec.kv_tensors() == [] and dec.cache is None
    assert dec.generate(prompts, max_new_tokens=7, temperature=0).tokens == first.tokens


def test_longer_requests_grow_the_cache(models):
    dec = FastDecoder(models["tiny"], max_batch=4, max_seq_len=16)
    prompts = _prompts(3, seed=11)
    res = dec.generate(prompts, max_new_tokens=20, temperature=0)
    assert dec.max_seq_len >= max(len(p) for p in prompts) + 20
    assert res.tokens == _hf_greedy(models["tiny"], prompts, 20)


def test_unsupported_model_is_a_user_error():
    spec = ModelSpec(
        name="sliding",
        arch="qwen2",
        config_kwargs=dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=0,
        ),
    )
    model = build_model(spec, seed=0)
    with pytest.raises(UserError, match="fast-decode"):
        FastDecoder(model)


def test_embedded_engine_generates_through_the_fast_path():
    from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig
    from tidal.rollout.embedded import EmbeddedEngine
    from tidal.rollout.types import Sample, SamplingParams

    engine = EmbeddedEngine(ModelConfig(model="tiny"), RolloutConfig(), MemoryConfig(), device="cpu")
    samples = [Sample(index=i, group=i // 2, prompt=None, prompt_ids=[5, 6, 7 + i]) for i in range(6)]
    out = engine.generate(samples, SamplingParams(max_new_tokens=10, stop_token_ids=[9]))
    dec = engine._fast_decoder
    assert isinstance(dec, FastDecoder) and dec.last_stats["new_tokens"] > 0
    forced = teacher_forced_logprobs(engine.model, [s.prompt_ids for s in out], [s.response_ids for s in out])
    assert _max_diff([s.response_logprobs for s in out], forced) < 1e-5
    for s in out:
        ended = bool(s.response_ids) and s.response_ids[-1] in (9, engine.tokenizer.eos_token_id)
        assert s.status == ("completed" if ended else "truncated")
        assert 1 <= len(s.response_ids) <= 10
    # The cache is the engine's kv_cache class: releasing the engine frees it.
    cache_bytes = dec.cache.nbytes
    report = engine.release_memory()
    assert report["memory/engine_release/kv_cache/bytes"] >= cache_bytes
    assert dec.cache.buf.untyped_storage().nbytes() == 0

    off = RolloutConfig()
    off.rollout_fast_decode = False  # the field the config section will carry
    plain = EmbeddedEngine(ModelConfig(model="tiny"), off, MemoryConfig(), device="cpu")
    plain.generate([Sample(index=0, group=0, prompt=None, prompt_ids=[5, 6])], SamplingParams(max_new_tokens=3))
    assert plain._fast_decoder == "off"


def test_graph_warmup_restore_leaves_no_trace(models):
    """Capture warms each step up twice and restores the state: outputs must not notice (CPU rehearsal)."""
    model = models["tiny-qwen2"]
    prompts = _prompts(10, seed=12)
    limits = [3, 9, 14, 2, 11, 14, 6, 1, 8, 14]
    for kw in (dict(temperature=0), dict(temperature=0.9, top_k=6, seed=4), dict(temperature=1.0, seed=5)):
        plain = FastDecoder(model, max_batch=16, max_seq_len=48, check_every=2, kv_block=16)
        rehearsed = FastDecoder(model, max_batch=16, max_seq_len=48, check_every=2, kv_block=16, rehearse_graphs=True)
        a = plain.generate(prompts, max_new_tokens=limits, stop_ids=[7], **kw)
        b = rehearsed.generate(prompts, max_new_tokens=limits, stop_ids=[7], **kw)
        assert len(rehearsed.graphs.rehearsed) >= 3  # several (bucket, KV length) keys were rehearsed
        assert a.tokens == b.tokens and a.logprobs == b.logprobs and a.stopped == b.stopped


def test_greedy_fused_core_matches_eager_sampling():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))
    one = torch.ones(1)
    a = sample(logits, sampling_mode(0, 1, 0, 50), one, one)
    b = sample(logits, sampling_mode(0, 1, 0, 50), one, one, fused=plain_core)
    assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1], atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3"])
def test_fused_projections_match_the_model_and_follow_weight_changes(models, name):
    """``fused=True`` (stacked q/k/v and gate/up weights): the same greedy tokens and log-probs as the
    model's own forward, for Qwen2 (q/k/v biases) and Qwen3 (q/k norms; Llama's layers are Qwen2's
    without the biases), and the stacked copies follow
    the model when its weights change in place between calls (a weight sync) or come back as garbage
    after a memory backend's release (they are kv_cache memory)."""
    import copy

    model = copy.deepcopy(models[name])
    prompts = _prompts(7, seed=21)
    backend = PortableBackend(engine_policy(), device="cpu", label="engine")
    fused = FastDecoder(
        model, max_batch=8, max_seq_len=48, fused=True, region=lambda: backend.region(StateClass.KV_CACHE)
    )
    backend.register(StateClass.KV_CACHE, fused.kv_tensors)
    plain = FastDecoder(model, max_batch=8, max_seq_len=48)
    for _ in range(2):
        res = fused.generate(prompts, max_new_tokens=9, temperature=0)
        ref = plain.generate(prompts, max_new_tokens=9, temperature=0)
        assert res.stats["fused"] and res.stats["fused_fallback_reason"] is None
        assert res.tokens == ref.tokens
        assert _max_diff(res.logprobs, ref.logprobs) < 1e-5
        assert _max_diff(res.logprobs, teacher_forced_logprobs(model, prompts, res.tokens)) < 1e-5
        with torch.no_grad():  # a "sync": every parameter rewritten in place
            for p in model.parameters():
                p.mul_(1.5).add_(0.01)
    backend.pause([StateClass.KV_CACHE])
    backend.resume([StateClass.KV_CACHE])
    for t in fused.kv_tensors():
        if t.is_floating_point():
            t.fill_(math.nan)
    assert (
        fused.generate(prompts, max_new_tokens=9, temperature=0).tokens
        == plain.generate(prompts, max_new_tokens=9, temperature=0).tokens
    )


def test_compiled_fused_pieces_trace_without_graph_breaks(models):
    """The fused forward compiled in pieces between the attention calls: three graphs for any number of
    layers (the weights are arguments), shared by the decode steps and the prefill (the pieces see one flat token
    dimension: a later call with other prompts compiles nothing), no graph break, and the same greedy tokens as
    the eager model (``aot_eager`` traces what inductor would compile, without a C++ compiler)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = models["tiny-qwen2"]
    dec = FastDecoder(model, max_batch=8, max_seq_len=48, fused=True)
    dec._fused.set_compiled(True, backend="aot_eager")
    plain = FastDecoder(model, max_batch=8, max_seq_len=48)
    for n, seed in ((6, 5), (4, 6)):
        prompts = _prompts(n, seed=seed, lo=3 + seed, hi=8 + 2 * seed)
        res = dec.generate(prompts, max_new_tokens=7, temperature=0)
        ref = plain.generate(prompts, max_new_tokens=7, temperature=0)
        assert res.stats["compiled"] and dec.compile_fallback_reason is None
        assert res.tokens == ref.tokens
        assert _max_diff(res.logprobs, ref.logprobs) < 1e-5
        assert sum(counters["graph_break"].values()) == 0
        assert counters["stats"]["unique_graphs"] == 3
    torch._dynamo.reset()


def test_decoder_totals_add_up_its_calls_and_reset_when_taken(models):
    """``take_totals``: every generate call's steps, seconds and compactions since the last take, then zeros;
    ``DecodeStats.metrics`` sums counts over engines and takes the slowest engine's seconds."""
    from tidal.rollout.types import DecodeStats

    dec = FastDecoder(models["tiny"], max_batch=8, max_seq_len=48, check_every=1)
    prompts = _prompts(6, seed=8)
    a = dec.generate(prompts, max_new_tokens=[2, 9, 9, 4, 9, 9], temperature=0)
    b = dec.generate(prompts, max_new_tokens=5, temperature=0)
    got = dec.take_totals()
    assert (got.calls, got.waves, got.steps) == (2, 2, a.stats["steps"] + b.stats["steps"])
    assert got.compactions == a.stats["compactions"] + b.stats["compactions"] >= 1
    assert got.decode_s == pytest.approx(a.stats["decode_s"] + b.stats["decode_s"])
    assert got.call_s == pytest.approx(a.stats["seconds"] + b.stats["seconds"]) and got.call_s >= got.decode_s
    assert got.prefill_s > 0 and got.graph_captures == 0
    assert dec.take_totals() == DecodeStats()
    other = DecodeStats(calls=1, waves=2, steps=3, prefill_s=9.0, decode_s=0.5, compactions=2)
    m = DecodeStats.metrics([got, other])
    assert m["decode/waves"] == 4
    assert m["decode/steps"] == got.steps + 3 and m["decode/compactions"] == got.compactions + 2
    assert m["decode/prefill_s"] == 9.0 and m["decode/decode_s"] == max(got.decode_s, 0.5)
    assert DecodeStats.metrics([DecodeStats(), DecodeStats()]) == {}


def test_fused_projections_fall_back_for_other_families():
    from transformers import GPT2Config, GPT2LMHeadModel

    from tidal.rollout.fast.fused import unsupported_reason

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert "gpt2" in unsupported_reason(gpt2)


def test_sampling_bench_reports_each_core_against_its_floor(capsys):
    from tidal.bench import sampling as bench

    bench.main(["--device", "cpu", "--rows", "8", "--vocab", "64", "--iters", "1", "--copy-mib", "4"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["variant"] for r in rows] == ["eager", "plain", "blocks"]
    plain = rows[1]
    assert plain["tokens_equal"] is True and plain["logprob_max_abs_diff"] < 1e-5
    assert plain["ms"] > 0 and 0 < plain["floor_ms"] and plain["copy_gbps"] > 0


def test_fast_bench_runs_its_cpu_cases(capsys):
    """``python -m tidal.rollout.fast.bench`` on the CPU: the fixed-length case with its log-prob checks and the
    variable-length one, each beside the hardware's floor for its batch, and the prefill case, whose shared
    prefill covers one row per distinct prompt, next to its limit."""
    from tidal import roofline
    from tidal.rollout.fast import bench

    bench.main(["--device", "cpu", "--cases", "fast,fast-prefill,fast-varlen", "--prompts", "3", "--samples", "4",
                "--prompt-len", "8", "--new-tokens", "4", "--varlen-min", "2", "--varlen-max", "9",
                "--skip-hf", "--skip-hf-varlen", "--fp32-rows", "0"])  # fmt: skip
    rows = {r["case"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["fast"]["logprob_max_abs_diff"] < 1e-4 and rows["fast"]["tokens"] == 12 * 4
    tflops, gbps = roofline.limits("cpu", torch.float32)  # measured once a process: the bench's own figures
    for case in ("fast", "fast-varlen"):
        r = rows[case]
        assert (r["matmul_tflops"], r["copy_gbps"]) == (round(tflops, 2), round(gbps, 1)), case
        assert r["decode_floor_tokens_per_s"] > 0
        assert abs(r["floor_fraction"] - r["tokens_per_s"] / r["decode_floor_tokens_per_s"]) < 2e-3
    assert rows["fast-varlen"]["decode_floor_tokens_per_s"] != rows["fast"]["decode_floor_tokens_per_s"]
    pre = rows["fast-prefill"]
    assert (pre["rows"], pre["prefill_rows_shared"], pre["speedup_limit"]) == (12, 3, 4)
    assert pre["prefill_s_shared"] > 0 and pre["prefill_s_every_row"] > 0 and pre["speedup"] > 0


def test_compiled_pieces_specialised_per_batch_bucket_give_the_same_tokens(models):
    """compile_dynamic=False (the fast bench's --compile-static): each compiled piece gets a graph per batch bucket
    the wave visits (compaction takes it through several), past Dynamo's default recompile limit, with the same
    greedy tokens as the uncompiled decoder."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = models["tiny-qwen2"]
    prompts = _prompts(48, seed=9)
    limits = [2 + i for i in range(48)]  # rows end one after another: buckets 48, 32, 24, 16, 12, 8, 4, 2, 1
    dec = FastDecoder(model, max_batch=48, max_seq_len=64, fused=True, check_every=1, compile_dynamic=False)
    dec._fused.set_compiled(True, backend="aot_eager")
    res = dec.generate(prompts, max_new_tokens=limits, temperature=0)
    ref = FastDecoder(model, max_batch=48, max_seq_len=64, check_every=1).generate(
        prompts, max_new_tokens=limits, temperature=0
    )
    assert res.tokens == ref.tokens and _max_diff(res.logprobs, ref.logprobs) < 1e-5
    buckets = {b for b, _, _ in res.stats["buckets"]}
    assert len(buckets) > 8 and dec.compile_fallback_reason is None  # more than Dynamo's default limit
    assert counters["stats"]["unique_graphs"] == 3 * len(buckets)  # enter, between, leave: one per bucket each
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True])
def test_pieces_that_write_the_cache_give_the_same_tokens(models, compiled):
    """FusedDecodeForward(write_kv=True) (the fast bench's --fused-kv-write): each piece writes the keys and values
    it computed and the attention call only reads, in the prefill as in the decode steps; greedy tokens and
    log-probs as the uncompiled decoder's, compaction included. Compiled through ``aot_eager`` (what inductor would
    compile, no C++ compiler): three graphs, the prefill's and every batch bucket's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = models["tiny-qwen2"]
    prompts = _prompts(12, seed=11)
    limits = [3 + (i % 6) for i in range(12)]
    dec = FastDecoder(model, max_batch=12, max_seq_len=48, fused=True, check_every=2, fused_kv_write=True)
    if compiled:
        dec._fused.set_compiled(True, backend="aot_eager")
    res = dec.generate(prompts, max_new_tokens=limits, temperature=0)
    ref = FastDecoder(model, max_batch=12, max_seq_len=48, check_every=2).generate(
        prompts, max_new_tokens=limits, temperature=0
    )
    assert res.tokens == ref.tokens and _max_diff(res.logprobs, ref.logprobs) < 1e-5
    assert res.stats["compactions"] > 0
    assert counters["stats"]["unique_graphs"] == (3 if compiled else 0)
    torch._dynamo.reset()


def test_attention_told_the_cache_is_written_only_reads_it(models):
    from tidal.rollout.fast import attention
    from tidal.rollout.fast.static_cache import StaticKVCache

    model = models["tiny-qwen2"]
    dec = FastDecoder(model, max_batch=4, max_seq_len=16)
    cache = StaticKVCache(dec.shape, 4, 16, torch.device("cpu"))
    cache.buf.zero_()
    attn = model.model.layers[0].self_attn
    heads, kv, dim = model.config.num_attention_heads, model.config.num_key_value_heads, dec.shape.head_dim
    q, k, v = torch.randn(4, heads, 1, dim), torch.randn(4, kv, 1, dim), torch.randn(4, kv, 1, dim)
    mask = torch.zeros(4, 1, 1, 16)
    for written in (True, False):
        ctx = attention.AttnContext(cache=cache, decode=True, rows=4, cpos=torch.tensor([3]), kv_len=16)
        ctx.kv_written = written
        with attention.active(model, ctx):
            attention.fast_attention(attn, q, k, v, mask)
        stored = cache.keys(0)[:, :, 3:4]
        assert torch.equal(stored, torch.zeros_like(k) if written else k)


def test_inductor_options_reach_every_graph_the_decoder_compiles(models, monkeypatch):
    """``compile_options`` (the fast bench's --inductor-options) go to every ``torch.compile`` the decoder makes: the
    fused pieces and the sampling cores; an option inductor does not know fails at once, naming it."""
    calls = []
    real = torch.compile

    def spy(fn, **kw):
        calls.append((getattr(fn, "__name__", fn), kw.get("options")))
        return real(fn, **kw)

    monkeypatch.setattr(torch, "compile", spy)
    opts = {"coordinate_descent_tuning": True}
    model = models["tiny-qwen2"]
    dec = FastDecoder(model, max_batch=8, max_seq_len=48, fused=True, compile=True, sampler_noise="blocks",
                      compile_options=opts)  # fmt: skip
    names = {name for name, _ in calls}
    assert {"_enter", "_between", "_leave", "plain_core", "blocked_core"} <= names
    assert all(o == opts for _, o in calls) and dec.compile_options == opts
    monkeypatch.setattr(torch, "compile", real)
    with pytest.raises(RuntimeError, match="no_such_option"):
        FastDecoder(model, max_batch=8, max_seq_len=48, fused=True, compile=True, compile_options={"no_such_option": 1})


def test_fast_bench_option_sets_are_json_objects():
    """The fast bench's repeatable option flags: JSON objects or lists of them, ``{}`` for the defaults; anything
    else ends the run with the flag named."""
    from tidal.rollout.fast.bench import _option_sets

    assert _option_sets(None, "--inductor-options") == [None]
    assert _option_sets(["{}", '[{"a": 1}, {}]'], "--inductor-options") == [None, {"a": 1}, None]
    for bad in (["[1]"], ["{not json"]):
        with pytest.raises(SystemExit, match="--inductor-options"):
            _option_sets(bad, "--inductor-options")


def test_engine_decoder_takes_the_configs_compile_options():
    """``build_decoder``'s inductor options: the config's own, or for a config built in code and not resolved,
    the device's default (combo kernels with CUDA, none on CPU)."""
    from tidal.config.schema import RolloutConfig
    from tidal.rollout.fast.plug import _compile_options

    assert _compile_options(RolloutConfig(), "cuda") == {"combo_kernels": True}
    assert _compile_options(RolloutConfig(), "cpu") == {}
    assert _compile_options(RolloutConfig(rollout_compile_options={}), "cuda") == {}


def test_the_pieces_inputs_are_their_tensors_memory_not_views():
    """``_unviewed``: what a piece takes in place of a view (the attention output, a layer's cache) has the view's
    values and memory but no base for a compiled piece to guard on; a tensor laid out otherwise is made contiguous
    first. ``_last_position``: each row's last token of a flat ``[rows * seq, ...]`` tensor."""
    from tidal.rollout.fast.fused import _last_position, _unviewed

    t = torch.arange(24.0).view(2, 3, 4)
    flat = _unviewed(t, (6, 4))
    assert flat._base is None and torch.equal(flat, t.reshape(6, 4))
    flat[0, 0] = -1.0  # the same memory
    assert t[0, 0, 0] == -1.0
    odd = t.transpose(1, 2)  # not contiguous: its values, in their logical order
    assert torch.equal(_unviewed(odd, (2, 12)), odd.reshape(2, 12))
    assert torch.equal(_last_position(flat, 2, 3), t.reshape(6, 4).view(2, 3, 4)[:, -1])
    assert _last_position(flat, 6, 1) is flat
