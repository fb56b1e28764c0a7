"""The fused log-prob + entropy kernel (``token_logprobs_and_entropy``) against hand values and log_softmax.

Every check runs on the CPU (eager chunk kernels); the compiled CUDA path is checked against these
eager kernels in ``tests/gpu/test_logprobs_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algos import entropy_from_logits, token_logprobs, token_logprobs_and_entropy
from tidal.algos import logprobs as losses


def _reference(logits, targets, temperature=1.0):
    """Plain log_softmax over the whole vocabulary: (log-prob of targets, entropy)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_hand_values_with_and_without_temperature():
    # logits [0, ln 3]: p = [1/4, 3/4]; logp(1) = ln .75 = -0.287682,
    # H = -(.25 ln .25 + .75 ln .75) = 0.346574 + 0.215762 = 0.562335.
    # temperature 2: logits / 2 = [0, ln 3 / 2], p = [1, sqrt 3] / (1 + sqrt 3) = [0.366025, 0.633975];
    # logp(0) = ln 0.366025 = -1.005053, H = 0.366025 * 1.005053 + 0.633975 * 0.455746 = 0.656806.
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    targets = torch.tensor([[1, 0]])
    lp, ent = token_logprobs_and_entropy(logits, targets)
    assert torch.allclose(lp, torch.tensor([[-0.287682, -1.386294]]), atol=1e-6)
    assert torch.allclose(ent, torch.tensor([[0.562335, 0.562335]]), atol=1e-6)
    lp2, ent2 = token_logprobs_and_entropy(logits, targets, temperature=2.0)
    assert torch.allclose(lp2, torch.tensor([[-0.455746, -1.005053]]), atol=1e-6)
    assert torch.allclose(ent2, torch.tensor([[0.656806, 0.656806]]), atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [None, 1, 4, 100])
def test_forward_and_backward_match_log_softmax(temperature, chunk_rows):
    torch.manual_seed(2)
    logits = (torch.randn(3, 7, 50) * 4).requires_grad_()
    targets = torch.randint(0, 50, (3, 7))
    ref_lp, ref_ent = _reference(logits, targets, temperature)
    lp, ent = token_logprobs_and_entropy(
        logits, targets, temperature=temperature, chunk_rows=chunk_rows, with_entropy_grad=True
    )
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=2e-6)
    w, u = torch.randn(3, 7), torch.randn(3, 7)
    for weights in ((w, None), (None, u), (w, u)):  # log-prob only, entropy only, both

        def objective(a, b, weights=weights):
            return sum((x * c).sum() for x, c in zip((a, b), weights, strict=True) if c is not None)

        (g_ref,) = torch.autograd.grad(objective(ref_lp, ref_ent), logits, retain_graph=True)
        (g,) = torch.autograd.grad(objective(lp, ent), logits, retain_graph=True)
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_gradcheck_float64(temperature):
    torch.manual_seed(3)
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 6, (2, 5))
    # chunk_rows=3 leaves a short last chunk (10 rows = 3 + 3 + 3 + 1)
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs_and_entropy(x, t, temperature=temperature, chunk_rows=3, with_entropy_grad=True),
        (x,),
    )
    assert torch.autograd.gradcheck(lambda x: token_logprobs_and_entropy(x, t, temperature, 3)[0], (x,))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, t, temperature=temperature, chunk_rows=4), (x,))


def test_entropy_is_a_detached_metric_unless_asked():
    torch.manual_seed(4)
    logits = torch.randn(2, 3, 9, requires_grad=True)
    targets = torch.randint(0, 9, (2, 3))
    lp, ent = token_logprobs_and_entropy(logits, targets)
    assert lp.requires_grad and not ent.requires_grad
    # Same log-probs and the same gradient as the log-prob-only function.
    lp_only = token_logprobs(logits, targets)
    assert torch.equal(lp, lp_only)
    (g1,) = torch.autograd.grad(lp.sum(), logits)
    (g2,) = torch.autograd.grad(lp_only.sum(), logits)
    assert torch.equal(g1, g2)
    assert torch.equal(ent, entropy_from_logits(logits))
    _, ent_g = token_logprobs_and_entropy(logits, targets, with_entropy_grad=True)
    assert ent_g.requires_grad


def test_bf16_logits_fp32_results_bf16_gradient():
    torch.manual_seed(5)
    xb = (torch.randn(2, 4, 33) * 3).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 33, (2, 4))
    lp, ent = token_logprobs_and_entropy(xb, t, with_entropy_grad=True)
    ref_lp, ref_ent = _reference(xb.detach().float().requires_grad_(), t)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=1e-6)
    (lp.sum() + ent.sum()).backward()
    assert xb.grad.dtype == torch.bfloat16 and torch.isfinite(xb.grad.float()).all()


def test_sliced_logits_and_empty_input():
    torch.manual_seed(6)
    full = torch.randn(3, 5, 11)
    targets = torch.randint(0, 11, (3, 4))
    lp, ent = token_logprobs_and_entropy(full[:, :-1], targets)  # non-contiguous: copied, still right
    ref_lp, ref_ent = _reference(full[:, :-1], targets)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    lp0, ent0 = token_logprobs_and_entropy(
        torch.zeros(0, 3, 11, requires_grad=True), torch.zeros(0, 3, dtype=torch.long)
    )
    assert lp0.shape == ent0.shape == (0, 3)
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs_and_entropy(full, targets)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(full[:, :-1], targets, temperature=0.0)


def test_chunk_size_from_a_memory_budget_and_no_compile_on_cpu():
    # Two fp32 buffers per chunk: 512 MiB on CUDA, 128 MiB on the host (2**24 elements per buffer).
    assert losses._rows_per_chunk(151936, None, "cuda") == (512 << 20) // (8 * 151936) == 441
    assert losses._rows_per_chunk(151936, None, "cpu") == (1 << 24) // 151936 == 110
    assert losses._rows_per_chunk(151936, None, "cpu", itemsize=8) == 55
    assert losses._rows_per_chunk(10, None, "cpu") == (1 << 24) // 10
    assert losses._rows_per_chunk(10, 7, "cuda") == 7
    assert not losses._compile_available(torch.device("cpu"))
    x = torch.randn(4, 8, requires_grad=True)
    token_logprobs_and_entropy(x, torch.zeros(4, dtype=torch.long))[0].sum().backward()
    assert losses._compiled == {}  # the CPU never builds a compiled kernel


@pytest.mark.parametrize("inv_t", [1.0, 1 / 0.7])
def test_out_of_place_kernels_for_compile_match_the_eager_ones(inv_t):
    # The CUDA path compiles _chunk_*_fused; run uncompiled here, they must equal the in-place kernels.
    torch.manual_seed(7)
    x = (torch.randn(5, 40) * 3).to(torch.bfloat16)
    tgt = torch.randint(0, 40, (5,))
    work = [torch.empty(8, 40), torch.empty(8, 40)]
    for want in (False, True):
        eager = losses._chunk_forward(x, tgt, inv_t, want, work)
        fused = losses._chunk_forward_fused(x, tgt, inv_t, want)
        for a, b in zip(eager, fused, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-6, atol=1e-6))
    _, shift, ent = losses._chunk_forward(x, tgt, inv_t, True, work)
    g_lp, g_ent = torch.randn(5), torch.randn(5)
    for gl, ge in ((g_lp, None), (None, g_ent), (g_lp, g_ent)):
        out_e, out_f = torch.empty_like(x), torch.empty_like(x)
        losses._chunk_backward(x, tgt, shift, ent, gl, ge, inv_t, out_e, work)
        losses._chunk_backward_fused(x, tgt, shift, ent, gl, ge, inv_t, out_f)
        # both round the same fp32 gradient to bf16: at most one bf16 step apart
        torch.testing.assert_close(out_e.float(), out_f.float(), rtol=8e-3, atol=1e-6)


def test_a_long_compiled_chunk_runs_in_eager_pieces_when_the_compiler_is_off():
    """The compiled kernels take long chunks; if they fail, the eager kernels run such a chunk in pieces
    of their own budget (3 rows here, chunks of 8, 21 rows): same values and gradients as log_softmax."""
    torch.manual_seed(5)
    logits = (torch.randn(21, 40) * 3).requires_grad_()
    targets = torch.randint(0, 40, (21,))
    ref_lp, ref_ent = _reference(logits, targets, 0.7)
    lp, ent = losses._LogprobsEntropy.apply(logits, targets, 1 / 0.7, 3, 8, True, True, False)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=2e-6)
    w, u = torch.randn(21), torch.randn(21)
    (g_ref,) = torch.autograd.grad((ref_lp * w).sum() + (ref_ent * u).sum(), logits)
    (g,) = torch.autograd.grad((lp * w).sum() + (ent * u).sum(), logits)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab", [256, 152, 37])  # 128 blocks of 2; 8 blocks of 19; odd: one block
@pytest.mark.parametrize("inv_t", [1.0, 1 / 0.7])
def test_blocked_forward_equals_the_row_forward(vocab, inv_t):
    """The compiled forward over vocabulary blocks gives the row kernel's log-prob, shift and entropy."""
    torch.manual_seed(6)
    x = (torch.randn(9, vocab) * 4).to(torch.bfloat16)
    tgt = torch.randint(0, vocab, (9,))
    work = [torch.empty(9, vocab) for _ in range(2)]
    ref = losses._chunk_forward(x, tgt, inv_t, True, work)
    got = losses._chunk_forward_blocked(x, tgt, inv_t, True)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=2e-6)
    assert losses._chunk_forward_blocked(x, tgt, inv_t, False)[2] is None
    assert losses._vocab_blocks(151936) == 128 and losses._vocab_blocks(152) == 8 and losses._vocab_blocks(37) == 1


def test_rowwise_backward_writes_the_same_gradient():
    torch.manual_seed(8)
    x = (torch.randn(6, 50) * 3).to(torch.bfloat16)
    tgt = torch.randint(0, 50, (6,))
    _, shift, ent = losses._chunk_forward(x, tgt, 1.0, True, [torch.empty(6, 50) for _ in range(2)])
    g_lp, g_ent = torch.randn(6), torch.randn(6)
    a, b = torch.empty(6, 50), torch.empty(6, 50)
    losses._chunk_backward_fused(x, tgt, shift, ent, g_lp, g_ent, 1.0, a)
    sums = losses._chunk_backward_rowwise(x, tgt, shift, ent, g_lp, g_ent, 1.0, b)
    assert torch.equal(a, b) and torch.allclose(sums, a.sum(-1))


def test_compiled_chunks_one_graph_whether_a_chunk_spans_the_logits_or_not(monkeypatch):
    """The compiled kernels' path, run on the host through Dynamo with a backend that counts graphs and runs them
    as traced: a call in one chunk (the chunk spans the logits) and one in several meet the same graph each way."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    monkeypatch.setattr(losses, "_compile_available", lambda device, wanted=True: wanted)
    monkeypatch.setattr(losses, "COMPILED_CHUNK_ELEMS", 50 * 8)  # 8 rows of a 50-word vocabulary a chunk
    monkeypatch.setattr(losses, "_rows_per_chunk", lambda *a: 4)  # the eager chunk, below the compiled one
    monkeypatch.setattr(losses, "_compiled", {})
    monkeypatch.setattr(losses.torch, "compile", lambda fn, **kw: torch._dynamo.optimize(counting, dynamic=True)(fn))
    for rows in (6, 30, 5):  # one chunk, four (the last shorter), one
        torch.manual_seed(rows)
        logits = (torch.randn(rows, 50) * 3).requires_grad_()
        targets = torch.randint(0, 50, (rows,))
        lp, ent = token_logprobs_and_entropy(logits, targets, with_entropy_grad=True)
        ref_lp, ref_ent = _reference(logits, targets, 1.0)
        torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
        (g,) = torch.autograd.grad((lp + ent).sum(), logits)
        (g_ref,) = torch.autograd.grad((ref_lp + ref_ent).sum(), logits)
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()  # no graph of the counting backend stays for another test
    assert len(graphs) == 2  # the forward's and the backward's
