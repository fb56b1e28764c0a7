"""Asynchronous training on one GPU: trainer and engine resident side by side (no offload), generating while training.

Run on the GPU host: ``pytest -m gpu tests/gpu/test_async_gpu.py -v``. Colocated on the one device
(the ``async`` rule keeps them together there and turns offload off), tensor transport over CUDA
IPC while the engine has generate calls queued; after every sync the engine's weights equal the
trainer's bit for bit, and the samples trained are one version behind (one-step) or within the
staleness bound (full).
"""

from __future__ import annotations

import pytest
from engine_pause import PauseAfter

from tidal.config import parse, resolve
from tidal.weight_sync.verify import compare_checksums

pytestmark = pytest.mark.gpu


def _run(tmp_path, *flags):
    from tidal.driver import train

    argv = [
        "--model", "tiny-qwen2", "--device", "cuda", "--num-rollout", "4", "--rollout-batch-size", "8",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "16", "--output-dir", str(tmp_path / "run"),
        "--no-progress", *flags,
    ]  # fmt: skip
    cfg, prov = parse(argv)
    cfg = resolve(cfg, prov)
    assert cfg.cluster.colocate and not cfg.memory.offload_train and not cfg.memory.offload_rollout
    rows = []

    def check(s, rollout_id, row):
        want = s.trainer.call("weight_checksums")
        for got in s.engines.call("weight_checksums"):
            assert compare_checksums(want, got) == [], f"engine differs after sync {rollout_id}"
        if rollout_id >= 0:
            rows.append(row)

    train(cfg, on_step=check)
    return rows


def test_one_step_resident_on_one_gpu(ray_cluster, tmp_path):
    rows = _run(tmp_path, "--async", "one-step")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert all(r["train_samples"] == 32 for r in rows)
    print({k: rows[-1][k] for k in ("samples_per_s", "trainer_busy_frac", "engine_busy_frac", "sync/seconds")})


def test_full_resident_on_one_gpu(ray_cluster, tmp_path):
    rows = _run(tmp_path, "--async", "full", "--max-staleness", "1")
    assert all(r["async/staleness_max"] <= 1 and r["train_samples"] == 32 for r in rows)
    print({k: rows[-1][k] for k in ("samples_per_s", "async/dropped_total", "engine_busy_frac")})


def test_full_partial_rollout_resident_on_one_gpu(ray_cluster, tmp_path):
    """--partial-rollout with CUDA graphs: calls in flight at a sync are paused between graph replays and continued."""
    rows = _run(tmp_path, "--async", "full", "--partial-rollout", "--max-staleness", "2", "--async-buffer-size", "32")
    assert all(r["async/staleness_max"] <= 2 and r["train_samples"] == 32 for r in rows)
    print({k: sum(r[k] for r in rows) for k in ("async/paused_groups", "async/partial_samples")})


def test_a_paused_cuda_call_returns_partial_rows_that_continue_on_new_weights():
    """A pause at the fast decoder's second host sync (between CUDA graph replays): every row still running comes
    back aborted with exactly the tokens of the replays before it, and a later call continues those rows on the
    new weights. The call is one chunk of one wave whatever else holds the GPU (a fast-decode chunk is a wave of
    the decoder's cache; sized by the free device memory, as it once was, beside other processes it split these
    16 rows into chunks, so the pause found rows of later chunks not started, with no tokens)."""
    import threading

    from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig
    from tidal.rollout.embedded import EmbeddedEngine
    from tidal.rollout.types import Sample, SamplingParams

    eng = EmbeddedEngine(ModelConfig(model="tiny-qwen2"), RolloutConfig(), MemoryConfig(), device="cuda", chunk_bytes=1)
    eng.set_weight_version(3)
    prompts = [eng.tokenizer.encode(t) for t in ("12+34=", "7*8=", "5", "abc")] * 4
    samples = [Sample(index=i, group=i, prompt="", prompt_ids=p) for i, p in enumerate(prompts)]
    sp = SamplingParams(max_new_tokens=40, seed=2)
    eng.paused = PauseAfter(4)  # the engine's chunk check, the wave's start, then host syncs 1 and 2: the pause
    out = eng.generate(samples, sp)
    stats = eng._fast_decoder.last_stats
    seen = ([(s.status, len(s.response_ids)) for s in out], eng.paused.calls, stats)
    k = eng._fast_decoder.check_every + 1  # tokens sampled by the second host sync (the prefill's and 8 replays')
    assert stats["cuda_graphs"] and stats["interrupted"] and stats["waves"] == 1, seen
    aborted = [s for s in out if s.status == "aborted"]
    assert aborted and all(len(s.response_ids) == k for s in aborted), seen
    assert all(s.status == "completed" and len(s.response_ids) <= k for s in out if s.status != "aborted"), seen
    before = {s.index: list(s.response_ids) for s in out}
    eng.paused = threading.Event()
    eng.set_weight_version(4)
    out = eng.generate(out, sp)
    assert {s.status for s in out} <= {"completed", "truncated"}, [(s.status, len(s.response_ids)) for s in out]
    for s in aborted:
        ids = before[s.index]
        assert s.response_ids[: len(ids)] == ids and len(s.response_logprobs) == len(s.response_ids)
        assert s.token_versions == [3] * len(ids) + [4] * (len(s.response_ids) - len(ids))
