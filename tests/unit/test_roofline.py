"""The hardware limits benchmarks print beside their figures (``tidal.roofline``), and the trainer bench's."""

from __future__ import annotations

import json

import pytest
import torch

from tidal import roofline
from tidal.model import build_model, resolve_model


@pytest.mark.parametrize("name, tied", [("tiny", False), ("tiny-qwen2", True)])
def test_a_shape_counts_the_matmul_weights_and_the_cache(name, tied):
    model = build_model(resolve_model(name), seed=0)
    shape = roofline.Shape.of(model)
    cfg = model.config
    head = cfg.vocab_size * cfg.hidden_size
    layers = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert shape.head_params == head and shape.body_params == sum(m.weight.numel() for m in layers)
    # Tied embeddings are one tensor: stored (and read) once. Norms and biases hold no matmul weights.
    stored = sum(p.numel() for p in model.parameters())
    rest = sum(p.numel() for n, p in model.named_parameters() if "norm" in n or n.endswith(".bias"))
    assert stored == shape.body_params + head * (1 if tied else 2) + rest
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert shape.kv_bytes_per_token == kv and shape.weight_bytes == 4 * stored


def test_the_floors_add_up_bytes_and_flops_step_by_step():
    """One distinct prompt of 2 tokens, two rows of 3 and 1 response tokens: the prefill, then one decode step
    (only the first row still runs); each phase the larger of its bytes and FLOPs time."""
    s = roofline.Shape(
        body_params=100, head_params=10, weight_bytes=1000, layers=2, attn_dim=4, kv_bytes_per_token=8,
        vocab=5, logit_bytes=2,
    )  # fmt: skip
    tflops, gbps = 1e-9, 1e-6  # 1000 FLOP/s, 1000 B/s
    got = roofline.decode_floor(s, 2, [3, 1], 1, tflops, gbps)
    prefill = max((2 * 100 * 2 + 2 * 10 + 2 * 2 * 4 * 4) / 1000, (1000 + 2 * 8) / 1000)  # FLOPs 456, bytes 1016
    step1 = max((2 * 110 * 1 + 4 * 2 * 4 * 3) / 1000, (1000 + 3 * 8 + 5 * 2) / 1000)  # context 3: 316 FLOPs, 1034 B
    step2 = max((2 * 110 + 4 * 2 * 4 * 4) / 1000, (1000 + 4 * 8 + 10) / 1000)
    assert got["floor_s"] == pytest.approx(prefill + step1 + step2)
    assert got["floor_tokens_per_s"] == pytest.approx(4 / got["floor_s"]) and got["bound"] == "memory"
    fast = roofline.decode_floor(s, 2, [3, 1], 1, tflops, 1.0)  # bandwidth to spare: FLOPs bound every step
    assert fast["bound"] == "compute"
    flops = roofline.train_flops(s, [(2, 3)])
    assert flops == 3 * (2 * 100 * 5 + 2 * 10 * 3 + 2 * 2 * 4 * 25)


def test_the_measured_limits_are_positive_on_this_machine():
    cpu = torch.device("cpu")
    assert roofline.matmul_tflops(cpu, torch.float32, n=128, iters=2) > 0
    assert roofline.copy_gbps(cpu, 1 << 20) > 0


def test_the_trainer_bench_prints_its_share_of_the_peak(capsys):
    from tidal.bench import trainer as bench

    assert bench.main(["--samples", "4", "--prompt-len", "4", "--response-len", "8"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["matmul_tflops"] > 0 and row["train_floor_s"] > 0
    assert 0 < row["train_peak_fraction"] <= 1  # floor / train_s: the train call cannot beat the measured peak


def test_the_trainer_bench_draws_new_response_lengths_and_sets_the_attention_order(capsys, monkeypatch):
    from tidal.bench import trainer as bench
    from tidal.trainer import step

    monkeypatch.setattr(step, "TRAIN_SDPA", step.TRAIN_SDPA)  # the bench's cudnn-first order is undone after
    argv = ["--samples", "6", "--prompt-len", "4", "--response-len", "12", "--response-len-min", "3"]
    assert bench.main([*argv, "--attention-order", "cudnn-first"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lo, hi = row["response_lens"]
    assert 3 <= lo < hi <= 12 and row["attention_order"] == "cudnn-first"
    assert step.TRAIN_SDPA[0] == torch.nn.attention.SDPBackend.CUDNN_ATTENTION and len(set(step.TRAIN_SDPA)) == 4
    assert bench.main([*argv[:-1], "13"]) == 2  # a minimum above the maximum
    assert "--response-len-min 13" in capsys.readouterr().err


def test_the_trainer_bench_reports_a_limit_that_does_not_fit_and_still_prints_its_floor(capsys, monkeypatch):
    from tidal.bench import trainer as bench

    def out_of_memory(actor, samples):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.21 GiB.\nmore detail")

    monkeypatch.setattr(bench, "_limit_tokens_per_s", out_of_memory)
    assert bench.main(["--samples", "4", "--prompt-len", "4", "--response-len", "8"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    early = lines[0]["train"]  # the figures beside their limit before anything that may fail
    assert early["train_floor_s"] > 0 and 0 < early["train_peak_fraction"] <= 1
    row = lines[-1]
    assert row["limit_tokens_per_s"] is None and row["train_vs_limit"] is None
    assert row["limit_error"].endswith("Tried to allocate 9.21 GiB.")  # its first line only
    assert row["train_floor_s"] == early["train_floor_s"]
