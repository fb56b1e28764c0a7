"""The torch.compile'd log-prob / entropy chunk kernels on CUDA against the eager ones, at Qwen's vocabulary.

pytest -m gpu tests/gpu/test_logprobs_gpu.py -s

Input: [4096, 151936] bf16 logits, i.e. nine chunks of 441 rows and a short last one of 127, so the
compiled kernels see dynamic rows. Checks, with and without temperature: the chunk forward
(log-prob, shift, entropy) and backward (log-prob gradient, entropy gradient, both; written into an
fp32 buffer so bf16 rounding does not hide differences) agree within 1e-5; the same through the
public function and autograd (whose CUDA backward runs on the autograd engine's own thread), with
``compile=False`` as the eager reference, in one long compiled chunk (the default) and in 1000-row
chunks. Prints eager and compiled forward + backward times (compiled in 441-row chunks, as before
the long chunks, and in one).
"""

from __future__ import annotations

import time

import pytest
import torch

from tidal.algos import logprobs as losses
from tidal.algos import token_logprobs_and_entropy

pytestmark = pytest.mark.gpu

ROWS, VOCAB = 4096, 151936
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def data():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(ROWS, VOCAB, generator=g, device="cuda") * 3).to(torch.bfloat16)
    tgt = torch.randint(0, VOCAB, (ROWS,), generator=g, device="cuda")
    return x, tgt


@pytest.fixture(autouse=True)
def compile_on(monkeypatch):
    monkeypatch.setattr(losses, "_compile_off", None)
    assert losses._compile_available(torch.device("cuda")), "needs triton"


@pytest.mark.parametrize("inv_t", [1.0, 1 / 0.7])
def test_compiled_chunks_match_eager(data, inv_t):
    x, tgt = data
    rows = losses._rows_per_chunk(VOCAB, None, "cuda")
    assert rows == 441 and ROWS % rows
    work = [torch.empty(rows, VOCAB, device="cuda") for _ in range(2)]
    fwd, bwd = losses._compiled_fn("forward"), losses._compiled_fn("backward")
    g = torch.Generator(device="cuda").manual_seed(1)
    for s in (0, rows, ROWS - ROWS % rows):  # two full chunks, then the short last one
        xs, ts = x[s : s + rows], tgt[s : s + rows]
        r = xs.shape[0]
        for want in (False, True):
            eager = losses._chunk_forward(xs, ts, inv_t, want, work)
            compiled = fwd(xs, ts, inv_t, want)
            for e, c in zip(eager, compiled, strict=True):
                assert (e is None) == (c is None)
                if e is not None:
                    torch.testing.assert_close(c, e, **TOL)
        _, shift, ent = losses._chunk_forward(xs, ts, inv_t, True, work)
        g_lp = torch.randn(r, device="cuda", generator=g)
        g_ent = torch.randn(r, device="cuda", generator=g)
        for gl, ge in ((g_lp, None), (None, g_ent), (g_lp, g_ent)):
            out_e = torch.empty(r, VOCAB, device="cuda")
            out_c = torch.empty(r, VOCAB, device="cuda")
            losses._chunk_backward(xs, ts, shift, ent, gl, ge, inv_t, out_e, work)
            bwd(xs, ts, shift, ent, gl, ge, inv_t, out_c)
            torch.testing.assert_close(out_c, out_e, **TOL)
    assert losses._compile_off is None


def _fwd_bwd(x, tgt, temperature, entropy_grad, compile=True):
    leaf = x.detach().requires_grad_()
    lp, ent = token_logprobs_and_entropy(
        leaf, tgt, temperature=temperature, with_entropy_grad=entropy_grad, compile=compile
    )
    w = torch.linspace(-1, 1, lp.numel(), device="cuda")
    loss = (lp * w).sum() + (ent * w.flip(0)).sum() if entropy_grad else (lp * w).sum()
    loss.backward()
    return lp.detach(), ent.detach(), leaf.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk_rows", [None, 1000])  # None: the default long chunk; 1000: 4 + a short last
def test_public_function_compiled_equals_eager(data, monkeypatch, temperature, entropy_grad, chunk_rows):
    x, tgt = data
    if chunk_rows is not None:
        monkeypatch.setattr(losses, "COMPILED_CHUNK_ELEMS", chunk_rows * VOCAB)
    compiled = _fwd_bwd(x, tgt, temperature, entropy_grad)
    forward = "forward-blocked" if losses.BLOCKED_FORWARD else "forward"
    backward = "backward-rowwise" if losses.ROWWISE_BACKWARD else "backward"
    assert losses._compile_off is None and {forward, backward} <= set(losses._compiled)
    eager = _fwd_bwd(x, tgt, temperature, entropy_grad, compile=False)
    torch.testing.assert_close(compiled[0], eager[0], **TOL)
    torch.testing.assert_close(compiled[1], eager[1], **TOL)
    assert compiled[2].dtype == torch.bfloat16
    # each side rounds an fp32 gradient to bf16: where those differ by a hair, one bf16 step apart
    torch.testing.assert_close(compiled[2].float(), eager[2].float(), rtol=8e-3, atol=1e-5)


def test_compiled_speed(data, monkeypatch):
    x, tgt = data

    def timed(compile: bool = True) -> float:
        _fwd_bwd(x, tgt, 1.0, False, compile)  # warm-up (compile, allocator)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            _fwd_bwd(x, tgt, 1.0, False, compile)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 5

    monkeypatch.setattr(losses, "BLOCKED_FORWARD", False)
    monkeypatch.setattr(losses, "ROWWISE_BACKWARD", False)
    t_rows = timed()
    monkeypatch.setattr(losses, "BLOCKED_FORWARD", True)  # the forward over vocabulary blocks
    t_compiled = timed()
    monkeypatch.setattr(losses, "BLOCKED_FORWARD", False)
    monkeypatch.setattr(losses, "ROWWISE_BACKWARD", True)  # the backward as a row-wise kernel
    t_rowwise = timed()
    monkeypatch.setattr(losses, "BOUNDED_ROWS", True)  # and with the rows bounded (32-bit indexing)
    t_bounded = timed()
    monkeypatch.setattr(losses, "ROWWISE_BACKWARD", False)
    t_bounded_flat = timed()
    monkeypatch.setattr(losses, "BOUNDED_ROWS", False)
    monkeypatch.setattr(losses, "COMPILED_CHUNK_ELEMS", 0)  # the row forward in the eager budget's 441-row chunks
    t_short = timed()
    t_eager = timed(compile=False)
    moved = 3 * x.numel() * x.element_size()  # at least: forward reads the logits, backward reads and writes
    print(
        f"\ntoken_logprobs_and_entropy [{ROWS}, {VOCAB}] bf16, forward + backward: "
        f"eager {t_eager * 1e3:.1f} ms, compiled row forward in 441-row chunks {t_short * 1e3:.1f} ms, "
        f"row forward in one chunk {t_rows * 1e3:.1f} ms, blocked forward in one chunk {t_compiled * 1e3:.1f} ms, "
        f"row forward and row-wise backward in one chunk {t_rowwise * 1e3:.1f} ms "
        f"({t_bounded * 1e3:.1f} ms with bounded rows; the plain backward with bounded rows {t_bounded_flat * 1e3:.1f} ms); "
        f"{moved / 1e9:.2f} GB moved at least, "
        f"{moved / t_rows / 1e12:.2f} TB/s for the row forward in one chunk"
    )
    assert losses._compile_off is None
