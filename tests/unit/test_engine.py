"""The embedded rollout engine on CPU: generation, policy log-probs, residency, weight loading, its Ray actor."""

from __future__ import annotations

import dataclasses
import textwrap
import threading

import pytest
import torch
from engine_pause import PauseAfter

from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig, WeightSyncConfig
from tidal.errors import ResidencyError, UserError, WeightSyncError
from tidal.model import build_model, resolve_model
from tidal.rollout.embedded import EmbeddedEngine
from tidal.rollout.generate import decode_ids, finish_response, left_pad, shared_prefill, teacher_forced_logprobs
from tidal.rollout.types import DecodeStats, Sample, SamplingParams
from tidal.weight_sync.bucket import BucketHeader, pack, plan_buckets
from tidal.weight_sync.checksum import tensor_checksum
from tidal.weight_sync.stream import Bucket

PROMPTS = ["12+34=", "7*8=", "what is 9-4? ", "5", "3+3+3=", "abc"]


def make_engine(model: str = "tiny", **rollout) -> EmbeddedEngine:
    return EmbeddedEngine(ModelConfig(model=model), RolloutConfig(**rollout), MemoryConfig())


def make_samples(engine: EmbeddedEngine, repeat: int = 4) -> list[Sample]:
    texts = PROMPTS * repeat
    return [
        Sample(index=i, group=i % len(PROMPTS), prompt=t, prompt_ids=engine.tokenizer.encode(t))
        for i, t in enumerate(texts)
    ]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and spinning threads on shared CI cores cost a lot."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine() -> EmbeddedEngine:
    """An AWAKE engine used read-only by the generation tests."""
    return make_engine()


def test_generate_fills_responses_and_cuts_at_end_tokens(engine):
    tok = engine.tokenizer
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    samples = make_samples(engine)
    sp = SamplingParams(max_new_tokens=8, stop_token_ids=digits, seed=7)
    out = engine.generate(samples, sp)
    assert [s.index for s in out] == list(range(len(samples)))
    end = set(digits) | {tok.eos_token_id}
    statuses = set()
    for s in out:
        assert 1 <= len(s.response_ids) <= 8
        assert len(s.response_logprobs) == len(s.response_ids)
        assert all(lp <= 0.0 for lp in s.response_logprobs)
        assert not end & set(s.response_ids[:-1]), "an end token before the last position was not cut"
        if s.status == "completed":
            assert s.response_ids[-1] in end
        else:
            assert s.status == "truncated" and len(s.response_ids) == 8
        assert s.response_text == tok.decode(s.response_ids, skip_special_tokens=True)
        assert s.weight_version == -1
        statuses.add(s.status)
    assert statuses == {"completed", "truncated"}


def test_decode_stats_hold_the_engines_whole_generate_calls_beside_the_decoders():
    """``engine_s``: the built-in generate calls' seconds since the last take, the decoder's calls and the
    samples' handling around them (so at least ``call_s``), zero again once taken."""
    eng = make_engine(rollout_fast_decode=True)
    eng.take_decode_stats()  # nothing generated yet
    eng.generate(make_samples(eng, repeat=1), SamplingParams(max_new_tokens=6, seed=3))
    eng.generate(make_samples(eng, repeat=1), SamplingParams(max_new_tokens=4, seed=4))
    got = eng.take_decode_stats()
    assert got.calls == 2 and got.engine_s >= got.call_s > 0
    assert eng.take_decode_stats().engine_s == 0.0
    assert DecodeStats.metrics([got])["decode/engine_s"] == got.engine_s


@pytest.mark.parametrize("kind", ["char", "bpe", "bpe-clean-up"])
def test_decode_ids_is_the_tokenizers_decode(engine, kind):
    """``decode_ids`` skips transformers' argument check only: the same text as ``decode(ids,
    skip_special_tokens=True)`` for lists with special tokens, unknown ids and none, whatever the clean-up."""
    import random

    if kind == "char":
        tok = engine.tokenizer
    else:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        bpe = Tokenizer(models.BPE(unk_token="<unk>"))
        bpe.pre_tokenizer = pre_tokenizers.Whitespace()
        texts = ["12 + 34 = 46 .", "what is 9 - 4 ? it is 5 , isn't it ?", "abc def ghi"] * 20
        bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"]))
        tok = PreTrainedTokenizerFast(
            tokenizer_object=bpe,
            unk_token="<unk>",
            bos_token="<s>",
            eos_token="</s>",
            clean_up_tokenization_spaces=kind == "bpe-clean-up",
        )
    rng = random.Random(5)
    vocab = len(tok)
    for n in (0, 1, 7, 40):
        ids = [rng.randrange(vocab) for _ in range(n)] + [tok.eos_token_id]
        assert decode_ids(tok, ids) == tok.decode(ids, skip_special_tokens=True), ids


def test_finish_response_cuts_after_eos_and_stop_strings(engine):
    tok = engine.tokenizer
    eos = tok.eos_token_id
    ids = tok.encode("12") + [eos] + tok.encode("34")
    done = finish_response(ids, [-0.1] * len(ids), end_ids=[eos], stop=[], tokenizer=tok)
    assert done.ids == ids[:3] and done.logprobs == [-0.1] * 3 and done.status == "completed" and done.text == "12"

    ids = tok.encode("ab=12=3")
    lps = [-float(i) for i in range(len(ids))]
    done = finish_response(ids, lps, end_ids=[eos], stop=["=1", "zz"], tokenizer=tok)
    assert done.text == "ab=1" and done.ids == ids[:4] and done.logprobs == lps[:4] and done.status == "completed"

    done = finish_response(ids, lps, end_ids=[eos], stop=["zz"], tokenizer=tok)
    assert done.ids == ids and done.status == "truncated"


def test_first_of_finds_the_first_wanted_id_as_a_scan_would():
    """``first_of`` (list scans in C; a Python loop past 8 wanted ids) agrees with a scan of every id, for
    rows holding none, one or several wanted ids, wanted sets of 1-20 ids, empty rows; and the decoder's
    cut (``cut_at_stops``) keeps what a per-token cut keeps."""
    import random

    from tidal.rollout.fast.request import cut_at_stops
    from tidal.rollout.generate import first_of

    rng = random.Random(0)
    rows = []
    for _ in range(400):
        wanted = set(rng.sample(range(50), rng.randint(1, 20)))
        ids = [rng.randrange(50 if rng.random() < 0.5 else 200) for _ in range(rng.randint(0, 40))]
        expect = next((k for k, t in enumerate(ids) if t in wanted), None)
        assert first_of(ids, wanted) == expect
        rows.append((ids, wanted, expect))
    stops = {3, 7}
    toks = [ids for ids, _, _ in rows]
    lps = [[-0.5 * k for k in range(len(ids))] for ids in toks]
    limits = [rng.randint(0, 40) for _ in toks]
    for (tok, lp, hit), ids, lim in zip(cut_at_stops(toks, lps, limits, stops), toks, limits):
        k = next((k for k, t in enumerate(ids[:lim]) if t in stops), None)
        end = lim if k is None else k + 1
        assert tok == ids[:end] and lp == [-0.5 * j for j in range(len(ids[:end]))] and hit == (k is not None)


def test_stop_strings_end_generation(engine):
    stop = ["1", "2", "3", "a"]
    out = engine.generate(make_samples(engine), SamplingParams(max_new_tokens=16, stop=stop, seed=3))
    completed = [s for s in out if s.status == "completed" and s.response_ids[-1] != engine.tokenizer.eos_token_id]
    assert completed, "no row hit a stop string"
    for s in completed:
        assert any(s.response_text.endswith(x) for x in stop)
        before = engine.tokenizer.decode(s.response_ids[:-1], skip_special_tokens=True)
        assert not any(x in before for x in stop), "generation ran past a stop string"


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen2"])
def test_logprobs_are_the_policy_and_match_teacher_forcing(model):
    eng = make_engine(model)
    # Temperature, top-k and top-p change the sampling distribution but not the policy log-probs.
    sp = SamplingParams(temperature=0.7, top_k=8, top_p=0.9, max_new_tokens=12, seed=11)
    out = eng.generate(make_samples(eng, repeat=3), sp)
    forced = teacher_forced_logprobs(eng.model, [s.prompt_ids for s in out], [s.response_ids for s in out])
    got = torch.tensor([x for s in out for x in s.response_logprobs])
    want = torch.tensor([x for f in forced for x in f])
    assert got.shape == want.shape and got.numel() > 50
    assert (got - want).abs().max().item() < 1e-5
    # The processed (temperature-scaled, truncated) distribution is measurably different.
    assert (got - want / 0.7).abs().max().item() > 1e-2


@pytest.mark.parametrize("fast", [True, False])
def test_a_paused_call_returns_partial_rows_that_a_later_call_continues_on_new_weights(fast):
    eng = make_engine(rollout_fast_decode=fast)
    eng.set_weight_version(3)
    sp = SamplingParams(max_new_tokens=24, seed=2)
    eng.paused = PauseAfter(4)  # fast decode: at its second host sync (9 tokens); generate: after its second step
    out = eng.generate(make_samples(eng, repeat=2), sp)
    aborted = [s for s in out if s.status == "aborted"]
    assert aborted and {s.status for s in out} <= {"aborted", "completed"}
    assert all(0 < len(s.response_ids) < 24 and eng.tokenizer.eos_token_id not in s.response_ids for s in aborted)
    before = {s.index: (list(s.response_ids), list(s.response_logprobs), s.status) for s in out}
    eng.paused = threading.Event()  # continue_generation; the weights are now version 4 (same values)
    eng.set_weight_version(4)
    out = eng.generate(out, sp)
    assert {s.status for s in out} <= {"completed", "truncated"}
    for s in out:
        ids, lps, status = before[s.index]
        assert s.response_ids[: len(ids)] == ids and s.response_logprobs[: len(ids)] == lps
        assert len(s.response_ids) == len(s.response_logprobs) == len(s.token_versions) <= 24
        if status == "completed":  # finished before the pause: left as it was
            assert s.response_ids == ids and s.response_versions == [] and s.weight_version == 3
        else:
            assert s.weight_version == 3 and s.token_versions == [3] * len(ids) + [4] * (len(s.response_ids) - len(ids))
    # Each continued token was sampled from prompt + response so far: its log-prob is the policy's there.
    forced = teacher_forced_logprobs(eng.model, [s.prompt_ids for s in out], [s.response_ids for s in out])
    got = torch.tensor([x for s in out for x in s.response_logprobs])
    assert (got - torch.tensor([x for f in forced for x in f])).abs().max().item() < 1e-4


def test_a_stop_string_spanning_a_pause_ends_the_continued_response_where_it_would_have(engine):
    """A pause at the fast decoder's first host sync (the prefill's token) between the two characters of a stop
    string: the continued response ends at the stop string exactly as the same greedy call without a pause does."""
    tok, greedy = engine.tokenizer, SamplingParams(temperature=0.0, max_new_tokens=16)
    fresh = lambda: make_samples(engine, repeat=1)  # noqa: E731
    ref = engine.generate(fresh(), greedy)
    k = 1  # tokens sampled by the first host sync (PauseAfter(3) below: the chunk's check, the wave's, that one)
    stops = [tok.decode(s.response_ids[k - 1 : k + 1]) for s in ref]
    rows = [
        i
        for i, (s, stop) in enumerate(zip(ref, stops))
        if len(s.response_ids) > k and len(stop) == 2 and stop not in tok.decode(s.response_ids[:k])
    ]
    assert rows, [s.response_text for s in ref]
    i = rows[0]
    with_stop = dataclasses.replace(greedy, stop=[stops[i]])
    whole = engine.generate(fresh(), with_stop)[i]  # no pause: cut at the stop string by the engine itself
    assert whole.response_ids == ref[i].response_ids[: k + 1] and whole.status == "completed"
    cut = fresh()
    before = engine.paused
    try:
        engine.paused = PauseAfter(3)
        engine.generate(cut, with_stop)
        assert cut[i].status == "aborted" and cut[i].response_ids == ref[i].response_ids[:k]
        engine.paused = threading.Event()
        (out,) = engine.generate([cut[i]], with_stop)
    finally:
        engine.paused = before
    assert (out.response_ids, out.response_text, out.status) == (whole.response_ids, whole.response_text, "completed")
    assert out.response_logprobs == pytest.approx(whole.response_logprobs, abs=1e-5)


def test_sampling_is_deterministic_given_a_seed(engine):
    sp = SamplingParams(max_new_tokens=10, seed=5)
    a = engine.generate(make_samples(engine), sp)
    b = engine.generate(make_samples(engine), sp)
    c = engine.generate(make_samples(engine), SamplingParams(max_new_tokens=10, seed=6))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.response_logprobs for s in a] == [s.response_logprobs for s in b]
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_a_warm_up_leaves_no_trace_in_later_calls():
    """``--warm-up``: one decode step at the first call's rows, before it. The calls after it sample what an
    engine that never warmed samples (the call count that seeds them is unchanged), and its pad prompts are
    not kept as prefixes; with the fast path off there is nothing to warm."""
    warmed, cold = make_engine(rollout_prefix_cache_mb=1), make_engine(rollout_prefix_cache_mb=1)
    sp = SamplingParams(max_new_tokens=6)
    report = warmed.warm_up(20, sp)
    assert report.warmed == ["decode step"] and report.rows == 20 and report.seconds > 0
    assert len(warmed._decoder().prefixes) == 0
    for _ in range(2):
        a, b = warmed.generate(make_samples(warmed), sp), cold.generate(make_samples(cold), sp)
        assert [s.response_ids for s in a] == [s.response_ids for s in b]
        assert [s.response_logprobs for s in a] == [s.response_logprobs for s in b]
    assert make_engine(rollout_fast_decode=False).warm_up(20, sp).warmed == []


def test_a_warm_up_compiles_the_prefill_a_rollout_runs():
    """With the fused step compiled, the warm-up's prefill (two distinct prompts) compiles the graphs that a
    rollout's prefill of other distinct prompts and lengths runs: the rollout after it compiles nothing (a
    warm-up of one distinct prompt would leave a graph specialised to one row). ``aot_eager`` traces what
    inductor would compile, without a C++ compiler."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    engine = make_engine(rollout_fused_decode=True)
    engine._decoder()._fused.set_compiled(True, backend="aot_eager")
    sp = SamplingParams(max_new_tokens=6)
    engine.warm_up(20, sp)
    assert counters["stats"]["unique_graphs"] == 3  # three pieces, shared by the prefill and the decode steps
    out = engine.generate(make_samples(engine), sp)
    assert counters["stats"]["unique_graphs"] == 3 and all(s.response_ids for s in out)
    assert engine._decoder().compile_fallback_reason is None
    torch._dynamo.reset()


def test_a_fast_decode_chunk_is_one_wave_of_its_cache_whatever_the_free_memory():
    """With the fast decoder a chunk is one wave of the rows its KV cache holds: a chunk budget (on a GPU the free
    device memory, less whenever the trainer holds more) too small for one row of transformers ``generate``
    still decodes these 24 rows in one call of one wave, the tokens an unbounded engine samples. ``generate``
    chunks by that budget."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    tight = EmbeddedEngine(ModelConfig(model="tiny"), RolloutConfig(), MemoryConfig(), chunk_bytes=1)
    out = tight.generate(make_samples(tight), sp)
    got = tight._fast_decoder.take_totals()
    assert (got.calls, got.waves) == (1, 1) and tight._fast_decoder.rows >= 24
    ref = make_engine()
    assert [s.response_ids for s in out] == [s.response_ids for s in ref.generate(make_samples(ref), sp)]
    plain = EmbeddedEngine(
        ModelConfig(model="tiny"), RolloutConfig(rollout_fast_decode=False), MemoryConfig(), chunk_bytes=1
    )
    assert plain._rows_per_chunk(8, 8, []) == 1
    assert tight._rows_per_chunk(8, 8, list(range(tight._fast_decoder.max_stop_ids + 1))) == 1  # too many stops


def test_chunked_generation_equals_one_batch():
    eng = make_engine()
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    whole = eng.generate(make_samples(eng), sp)
    eng.max_rows = 5  # 24 rows in 5 chunks, each padded to its own width
    parts = eng.generate(make_samples(eng), sp)
    assert [s.response_ids for s in whole] == [s.response_ids for s in parts]
    diff = max(abs(a - b) for x, y in zip(whole, parts) for a, b in zip(x.response_logprobs, y.response_logprobs))
    assert diff < 1e-5


def test_repeated_prompts_are_prefilled_once_with_plain_generate_results(monkeypatch):
    """The transformers path prefills each distinct prompt once and copies its cache to the rows of
    its group; tokens and log-probs are those of generate over the whole batch without sharing."""
    import tidal.rollout.embedded as embedded

    eng = make_engine(rollout_fast_decode=False)
    ids, mask = left_pad([s.prompt_ids for s in make_samples(eng)], eng._pad_id)
    cache = shared_prefill(eng.model, ids, mask)
    assert cache is not None and cache.get_seq_length() == ids.shape[1] - 1
    assert cache.layers[0].keys.shape[0] == len(ids)  # 24 rows from 6 distinct prompts
    assert shared_prefill(eng.model, ids[: len(PROMPTS)], mask[: len(PROMPTS)]) is None  # none repeats
    for sp in (SamplingParams(temperature=0.0, max_new_tokens=8), SamplingParams(max_new_tokens=8, seed=3)):
        shared = eng.generate(make_samples(eng), sp)
        with monkeypatch.context() as m:
            m.setattr(embedded, "shared_prefill", lambda *a: None)
            plain = eng.generate(make_samples(eng), sp)
        assert [s.response_ids for s in shared] == [s.response_ids for s in plain]
        diff = max(abs(a - b) for x, y in zip(shared, plain) for a, b in zip(x.response_logprobs, y.response_logprobs))
        assert diff < 1e-5


def bucket_payloads(named: dict[str, torch.Tensor], version: int, limit: int) -> list[BucketHeader]:
    """The colocated transport's messages for a full sync, buckets of at most ``limit`` bytes."""
    import ray

    groups = list(plan_buckets(named.items(), limit))
    payloads = []
    for i, group in enumerate(groups):
        data, entries = pack(group)
        b = Bucket(i, "full", entries, data, [n for n, _ in group], last=i == len(groups) - 1, all_names=list(named))
        payloads.append(dataclasses.replace(b.header(version, None, False, {}), data=("object", ray.put(data.numpy()))))
    return payloads


def test_residency_errors_come_before_memory_is_touched(ray_cluster):
    eng = make_engine()
    named = eng.named_weights()
    payloads = bucket_payloads(named, 1, limit=1 << 30)
    with pytest.raises(ResidencyError, match="kv_cache"):
        eng.release_memory(["weights"])  # would leave the KV cache resident
    eng.release_memory()
    storage_bytes = [p.untyped_storage().nbytes() for p in eng.model.parameters()]
    assert sum(storage_bytes) == 0
    with pytest.raises(ResidencyError, match="ASLEEP"):
        eng.generate(make_samples(eng, 1), SamplingParams(max_new_tokens=2))
    with pytest.raises(ResidencyError, match="ASLEEP"):
        eng.update_weights_from_tensor(payloads[0], 1)
    with pytest.raises(ResidencyError, match="ASLEEP"):
        eng.load_weights(named.items())
    with pytest.raises(ResidencyError):
        eng.release_memory()  # double release
    with pytest.raises(ResidencyError):
        eng.resume_memory(["kv_cache"])  # KV before weights
    assert eng.get_weight_version() == -1
    assert [p.untyped_storage().nbytes() for p in eng.model.parameters()] == storage_bytes
    eng.resume_memory(["weights"])
    with pytest.raises(ResidencyError, match="WEIGHTS_ONLY"):
        eng.generate(make_samples(eng, 1), SamplingParams(max_new_tokens=2))
    eng.resume_memory(["kv_cache"])
    with pytest.raises(ResidencyError, match="never synced"):
        eng.generate(make_samples(eng, 1), SamplingParams(max_new_tokens=2))


def test_release_frees_weights_and_a_sync_restores_generation(ray_cluster):
    eng = make_engine()
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = eng.generate(make_samples(eng), sp)
    named = eng.named_weights()
    param_bytes = eng.param_bytes()

    report = eng.release_memory(["kv_cache", "weights"])
    assert report["residency"] == "ASLEEP"
    assert report["memory/engine_release/weights/bytes"] == param_bytes
    assert sum(p.untyped_storage().nbytes() for p in eng.model.parameters()) == 0

    eng.resume_memory(["weights"])
    assert sum(p.untyped_storage().nbytes() for p in eng.model.parameters()) == param_bytes
    payloads = bucket_payloads(named, 1, limit=64 * 1024)
    assert len(payloads) > 2
    for p in payloads[:-1]:
        stats = eng.update_weights_from_tensor(p, 1)
        assert not stats["complete"] and eng.get_weight_version() == -1  # not adopted until the last bucket
    assert eng.update_weights_from_tensor(payloads[-1], 1)["complete"]
    assert eng.get_weight_version() == 1
    assert eng.resume_memory(["kv_cache"])["residency"] == "AWAKE"

    after = eng.generate(make_samples(eng), sp)
    assert [s.response_ids for s in after] == [s.response_ids for s in before]
    assert [s.response_logprobs for s in after] == [s.response_logprobs for s in before]
    assert all(s.weight_version == 1 for s in after)


def test_load_weights_checks_names_shapes_and_dtypes():
    eng = make_engine("tiny-qwen2")  # tied embeddings: lm_head.weight is the embedding
    emb = eng.model.get_input_embeddings().weight
    with pytest.raises(WeightSyncError, match="model.layers.9.mlp.up_proj.weight"):
        eng.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(3))])
    with pytest.raises(WeightSyncError, match="shape"):
        eng.load_weights([("model.norm.weight", torch.zeros(7))])
    with pytest.raises(WeightSyncError, match="bfloat16"):
        eng.load_weights([("model.norm.weight", torch.zeros(64, dtype=torch.bfloat16))])
    new = torch.randn(emb.shape)
    assert eng.load_weights([("lm_head.weight", new)]) == new.numel() * 4
    assert torch.equal(emb, new) and torch.equal(eng.model.get_output_embeddings().weight, new)
    sums = eng.weight_checksums()
    assert "lm_head.weight" not in sums and list(sums) == [n for n, _ in eng.model.named_parameters()]
    assert sums["model.embed_tokens.weight"] == tensor_checksum(new)


def test_randomize_weights_changes_every_parameter():
    eng = make_engine()
    ref = build_model(resolve_model("tiny"), seed=1234)
    want = {n: tensor_checksum(p) for n, p in ref.named_parameters()}
    assert eng.weight_checksums() == want  # same preset and seed as the trainer: same initial weights
    eng.randomize_weights(99)
    got = eng.weight_checksums()
    assert got.keys() == want.keys() and all(got[n] != want[n] for n in want)


def test_custom_generate_function_replaces_the_generate_step(tmp_path):
    plugin = tmp_path / "my_gen.py"
    plugin.write_text(
        textwrap.dedent(
            """
            def gen(engine, samples, sampling):
                for s in samples:
                    s.response_ids, s.response_logprobs = [5, 6], [-1.0, -2.0]
                    s.response_text, s.status = engine.tokenizer.decode([5, 6]), "completed"
                return samples

            def bad(engine, samples, sampling):
                return samples[:1]

            def inner(engine, samples, sampling):
                out = engine.generate_default(samples, sampling)
                for s in out:
                    s.status = "aborted" if s.status == "aborted" or s.index == 0 else s.status
                return out
            """
        )
    )
    eng = make_engine(custom_generate_function_path=f"{plugin}:gen")
    out = eng.generate(make_samples(eng, 1), SamplingParams(max_new_tokens=4))
    assert all(s.response_ids == [5, 6] and s.weight_version == -1 for s in out)
    eng = make_engine(custom_generate_function_path=f"{plugin}:bad")
    with pytest.raises(UserError, match="custom-generate-function-path"):
        eng.generate(make_samples(eng, 1), SamplingParams(max_new_tokens=4))
    # --partial-rollout: a pause cuts the generate_default a custom function calls; aborted rows are accepted
    # only while the engine is paused.
    eng = make_engine(custom_generate_function_path=f"{plugin}:inner")
    eng.pause_generation()
    out = eng.generate(make_samples(eng, 2), SamplingParams(max_new_tokens=4))
    assert all(s.status == "aborted" and not s.response_ids for s in out)
    eng.continue_generation()
    with pytest.raises(UserError, match="status 'aborted'"):
        eng.generate(make_samples(eng, 2), SamplingParams(max_new_tokens=4))


def test_bad_sampling_and_prompts_are_user_errors(engine):
    with pytest.raises(UserError, match="top_p"):
        engine.generate(make_samples(engine, 1), SamplingParams(top_p=0.0))
    with pytest.raises(UserError, match="positions"):
        engine.generate(make_samples(engine, 1), SamplingParams(max_new_tokens=1000))


def test_engine_actor_over_ray(ray_cluster):
    from tidal.rollout.actor import EngineActor
    from tidal.weight_sync.tensor import TensorStrategy

    ray = ray_cluster
    cfgs = dict(model=ModelConfig(), rollout=RolloutConfig(), memory=MemoryConfig(), weight_sync=WeightSyncConfig())
    actor = ray.remote(EngineActor).options(num_cpus=0.5).remote(0, device="cpu", **cfgs)
    info = ray.get(actor.init.remote())
    assert info["torch_threads"] == 1 and info["dtype"] == "float32" and info["param_bytes"] > 0

    trainer_model = build_model(resolve_model("tiny"), seed=1234)
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(0.01)  # a "trained" step
    want = {n: tensor_checksum(p) for n, p in trainer_model.named_parameters()}

    ray.get(actor.randomize_weights.remote(5))
    ray.get(actor.release_memory.remote(["kv_cache", "weights"]))
    ray.get(actor.resume_memory.remote(["weights"]))
    strategy = TensorStrategy(WeightSyncConfig(update_weight_buffer_size=128 * 1024), [actor], device="cpu")
    strategy.connect()
    report = strategy.sync([(n, p.detach()) for n, p in trainer_model.named_parameters()], 1)
    assert report.version == 1 and ray.get(actor.get_weight_version.remote()) == 1
    assert ray.get(actor.weight_checksums.remote()) == want
    ray.get(actor.resume_memory.remote(["kv_cache"]))

    tok = EmbeddedEngine(ModelConfig(), RolloutConfig(), MemoryConfig()).tokenizer
    samples = [Sample(index=i, group=0, prompt="1+2=", prompt_ids=tok.encode("1+2=")) for i in range(4)]
    out = ray.get(actor.generate.remote(samples, SamplingParams(max_new_tokens=6, seed=1)))
    assert len(out) == 4 and all(s.response_ids and s.weight_version == 1 for s in out)
    ray.kill(actor)


def test_rollout_benchmark_reports_both_paths_on_cpu(capsys):
    """``python -m tidal.bench.rollout`` on the CPU: one JSON line per path, log-probs agreeing with a
    teacher-forced pass, no compiled step (CUDA only)."""
    import json

    from tidal.bench import rollout as bench

    bench.main(
        ["--prompts", "2", "--samples", "2", "--new-tokens", "4", "--repeats", "1", "--device", "cpu", "--profile"]
    )
    out = capsys.readouterr()
    lines = [json.loads(line) for line in out.out.splitlines() if line.startswith("{")]
    rows = [r for r in lines if "profile" not in r]
    assert [r["path"] for r in rows] == ["fast", "generate"]
    # --profile: one summary line after each path's line, its table on stderr.
    profiles = [r for r in lines if "profile" in r]
    assert [p["profile"] for p in profiles] == ["rollout fast", "rollout generate"]
    for p in profiles:
        assert p["clock"] == "cpu" and 0 < p["total_s"] and p["launches"] > 0
        assert abs(sum(p["by_category"].values()) - p["total_s"]) < 1e-3 and p["by_category"]["matmul"] > 0
        assert any(name.startswith("aten::") for name, _, _ in p["top"])
    assert "torch.profiler: rollout fast" in out.err
    for r in rows:
        assert r["rows"] == 4 and r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["hf_generate_tokens_per_s"] > 0
        assert r["logprob_max_abs_diff"] < 1e-4, r
        assert r["compiled"] is False and r["peak_gpu_bytes"] == 0
        # The hardware's limit beside the figure, measured in the same run.
        assert r["matmul_tflops"] > 0 and r["copy_gbps"] > 0 and r["decode_floor_tokens_per_s"] > 0
        assert r["decode_floor_bound"] in ("memory", "compute") and r["floor_fraction"] > 0


def test_profile_categories_of_cuda_kernel_names():
    """The ``--profile`` summaries sort kernels by what their names say they are (names as the H200 shows them)."""
    from tidal.profiling import category

    assert category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert category("nvjet_tst_128x64_64x8_2x1_v_bz_TNN") == "matmul"
    assert category("pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<64>>") == "attention"
    assert category("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert category("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "triton"
    assert category("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>") == "softmax"
    assert category("void at::native::index_elementwise_kernel<128, 4>") == "copy_index"
    assert category("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert category("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>") == "elementwise"
    assert category("some_custom_kernel") == "other"
