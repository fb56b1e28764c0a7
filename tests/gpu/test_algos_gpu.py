"""Loss functions on a GPU: chunked log-probs and entropy at a real vocabulary size, in bf16.

pytest -m gpu tests/gpu/test_algos_gpu.py -s

Prints the time and peak extra memory of ``token_logprobs`` (forward + backward) next to the plain
``log_softmax(logits.float()).gather`` it replaces, at Qwen's 151,936-token vocabulary.
"""

from __future__ import annotations

import time

import pytest
import torch

from tidal.algos import RLInputs, entropy_from_logits, rl_loss, token_logprobs
from tidal.config.schema import AlgorithmConfig

pytestmark = pytest.mark.gpu

VOCAB = 151936


def _logits(rows_b: int, rows_t: int, vocab: int, device: str, dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows_b, rows_t, vocab, generator=g, device=device) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows_b, rows_t), generator=g, device=device)
    return logits, targets


def _reference(logits, targets):
    return torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _measure(fn, logits, targets, device: str) -> tuple[float, float]:
    """(seconds, peak extra GiB) of forward + backward of fn's log-probs summed."""
    logits.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    fn(logits, targets).sum().backward()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0, (torch.cuda.max_memory_allocated(device) - base) / 2**30


def test_token_logprobs_bf16_real_vocab_matches_and_saves_memory():
    device = "cuda"
    logits, targets = _logits(4, 1024, VOCAB, device)
    out = token_logprobs(logits, targets)
    ref = _reference(logits, targets)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() < 1e-4  # both in fp32 from the same bf16 logits
    w = torch.randn_like(out)
    (g_out,) = torch.autograd.grad((out * w).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
    assert g_out.dtype == torch.bfloat16
    # both round an fp32 gradient to bf16; they may differ by one bf16 step (2^-8 relative)
    torch.testing.assert_close(g_out.float(), g_ref.float(), rtol=1e-2, atol=1e-3)
    del out, ref, g_out, g_ref

    for fn in (token_logprobs, _reference):  # warm-up (kernels, allocator)
        _measure(fn, logits, targets, device)
    t_chunk, m_chunk = _measure(token_logprobs, logits, targets, device)
    t_ref, m_ref = _measure(_reference, logits, targets, device)
    logits_gib = logits.numel() * logits.element_size() / 2**30
    print(
        f"\ntoken_logprobs [4, 1024, {VOCAB}] bf16 ({logits_gib:.2f} GiB logits), forward + backward: "
        f"chunked {t_chunk * 1e3:.1f} ms, peak +{m_chunk:.2f} GiB | log_softmax.gather {t_ref * 1e3:.1f} ms, "
        f"peak +{m_ref:.2f} GiB (limit: chunked peak below half of the plain one)"
    )
    # The gradient itself (logits-sized, bf16) is unavoidable; the plain path adds fp32 copies.
    assert m_chunk < m_ref / 2


def test_entropy_and_loss_on_gpu_match_cpu():
    logits, targets = _logits(2, 64, 4096, "cuda", dtype=torch.float32)
    ent = entropy_from_logits(logits)
    ref = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert (ent - ref).abs().max().item() < 1e-4

    logp = token_logprobs(logits, targets)
    mask = torch.ones_like(targets)
    mask[:, :8] = 0
    adv = torch.tensor([1.0, -0.5], device="cuda")
    cfg = AlgorithmConfig(entropy_coef=0.01)
    old = logp.detach() + 0.05
    loss_gpu, m_gpu = rl_loss(RLInputs(logp, old, adv, mask, entropy=ent), cfg)
    loss_cpu, m_cpu = rl_loss(RLInputs(logp.cpu(), old.cpu(), adv.cpu(), mask.cpu(), entropy=ent.cpu()), cfg)
    assert abs(loss_gpu.item() - loss_cpu.item()) < 1e-5
    assert abs(m_gpu["clipfrac"].item() - m_cpu["clipfrac"].item()) < 1e-6
    loss_gpu.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[:, :8].abs().sum().item() == 0.0  # masked rows
