"""Log-probs and entropy of tokens from ``[B, T, V]`` logits: one fused, chunked pass, compiled on CUDA.

``token_logprobs_and_entropy`` computes both from ``V``-wide logits in one fused pass per row chunk
(one max, one exp, one sum give the logsumexp, the target's log-prob and the entropy together) and
differentiates them with a hand-written backward, one pass per chunk, that adds the entropy term
only when the entropy carries a gradient (an entropy bonus; otherwise it is a detached metric).
``token_logprobs`` and ``entropy_from_logits`` are the same kernel with one output. A full fp32
``[B, T, V]`` softmax is never materialised (for a 150k vocabulary that tensor is larger than the
model's activations). Pass whole contiguous logits: a ``[:, :-1]`` slice of ``[B, T, V]`` cannot be
flattened without a copy of the logits.

Chunk size: rows are chosen so that one chunk's transient (two ``[rows, V]`` buffers in fp32, or
fp64 for fp64 logits) stays within a budget: 512 MiB on CUDA (441 rows at a 152k vocabulary, so a
micro-batch of 8192 tokens runs in 19 chunks whose kernels are far longer than their launches),
128 MiB on the host. ``chunk_rows`` overrides it. The scratch buffers are allocated once per call.
The compiled kernels hold no scratch (each chunk reads the logits and writes only per-row values, or
the gradient), so they take ``COMPILED_CHUNK_ELEMS`` logits a chunk (about 7k rows at a 152k
vocabulary): fewer launches and calls, and a grid of thousands of rows instead of 441 for the
device's 132 SMs. Should they fail mid-call, the eager kernels take over a long chunk in pieces of
their own budget. ``_chunk_forward_blocked`` (``BLOCKED_FORWARD``, off) works over blocks of the
vocabulary instead (each block's max and sums in one pass, then the row's from the partials); measured
slower than the row kernel on the H200, it is kept for comparison (``tidal bench trainer
--logprob-forward blocked``). The compiled backward is built as a row-wise kernel (``ROWWISE_BACKWARD``:
it also returns each row's sum, so each program takes a row), faster on the H200 than the element-wise
kernel over ``rows * V``.

On CUDA with triton, the per-chunk forward and backward run through ``torch.compile`` (dynamic
rows; the backward becomes one kernel that reads bf16 logits and writes the bf16 gradient); any
compile error logs one line and falls back to the eager kernels for good. ``compile=False`` (the
trainer's ``--no-compile-logprobs``) always uses the eager kernels. The host never compiles.

Not a pure tensor function: the compiled kernels and the "compile failed, stay eager" switch are
process state, which is why this lives apart from ``tidal.algos.losses``.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

_CHUNK_BYTES = {"cuda": 512 << 20}
_CHUNK_BYTES_DEFAULT = 128 << 20
# Elements of logits per chunk for the compiled kernels, which keep no [rows, V] scratch: about 7k rows at
# a 152k vocabulary (a 32k-token micro-batch in 5 chunks instead of 74), below 2**31 elements. 0: the
# eager budget's rows.
COMPILED_CHUNK_ELEMS = 1 << 30


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """fp32 for half-precision logits (softmax sums lose digits in bf16), else the input's own."""
    return torch.promote_types(logits.dtype, torch.float32)


def _rows_per_chunk(vocab: int, chunk_rows: int | None, device_type: str = "cpu", itemsize: int = 4) -> int:
    if chunk_rows is not None:
        return max(1, chunk_rows)
    budget = _CHUNK_BYTES.get(device_type, _CHUNK_BYTES_DEFAULT)
    return max(1, budget // (2 * itemsize * max(1, vocab)))


def _shifted(x: Tensor, sub: Tensor, inv_t: float, work: Tensor) -> Tensor:
    """``(x - sub[:, None]) * inv_t`` in ``work``'s dtype, written into ``work``.

    On CUDA one kernel converts and subtracts; on the host a copy then same-dtype in-place ops, several
    times faster there than a mixed-dtype kernel.
    """
    if x.is_cuda:
        torch.sub(x, sub.unsqueeze(-1), out=work)
    else:
        work.copy_(x).sub_(sub.unsqueeze(-1))
    return work if inv_t == 1.0 else work.mul_(inv_t)


def _write(out: Tensor, g: Tensor, scale: Tensor | float) -> None:
    """``out = g * scale`` in out's dtype (g is scratch and may be overwritten)."""
    if out.is_cuda:
        torch.mul(g, scale, out=out)  # the multiply writes the bf16 gradient itself: no separate cast
    else:
        out.copy_(g.mul_(scale))


def _chunk_forward(
    x: Tensor, tgt: Tensor, inv_t: float, want_entropy: bool, work: list[Tensor]
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Rows x[r, V] (any float dtype) under softmax(x * inv_t): (log-prob of tgt, shift, entropy or None).

    All three are [r] in the compute dtype. ``shift`` is ``a`` with ``log_softmax(x * inv_t) = (x - a) * inv_t``
    (``a = temperature * logsumexp(x / temperature)``); the backward rebuilds the probabilities from it.
    ``work``: one (two with the entropy) scratch buffers of at least [r, V] in the compute dtype. Passes
    over the chunk: max, shift (the bf16 -> fp32 conversion rides on it), exp, sum, and for the
    entropy one product-sum: ``H = log s - sum(e * z) / s`` with ``z`` the shifted, scaled logits,
    ``e = exp(z)`` and ``s = sum(e)``.
    """
    r = x.shape[0]
    m = x.amax(-1).to(work[0].dtype)  # exact in any dtype
    z = _shifted(x, m, inv_t, work[0][:r])
    z_tgt = z.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    if want_entropy:
        e = torch.exp(z, out=work[1][:r])
        s = e.sum(-1)
        ez = e.mul_(z).sum(-1)
    else:
        s = z.exp_().sum(-1)
    log_s = s.log()
    ent = log_s - ez / s if want_entropy else None
    return z_tgt - log_s, m + log_s / inv_t, ent


def _chunk_backward(
    x: Tensor,
    tgt: Tensor,
    shift: Tensor,
    ent: Tensor,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    inv_t: float,
    out: Tensor,
    work: list[Tensor],
) -> None:
    """Writes d(sum g_lp * logp + g_ent * H)/dx for rows x[r, V] into ``out`` (x's dtype).

    With p = softmax(x * inv_t) and lp = log p: d logp[tgt]/dx = inv_t (onehot(tgt) - p) and
    dH/dx = -inv_t p (lp + H). Without an entropy gradient: shift, exp, one scatter and one multiply
    that writes ``out`` (3 passes). ``work``: scratch like ``_chunk_forward``'s (two with ``g_ent``).
    """
    r = x.shape[0]
    lp = _shifted(x, shift, inv_t, work[0][:r])
    idx = tgt.unsqueeze(-1)
    if g_ent is None:
        p = lp.exp_()
        p.scatter_add_(-1, idx, torch.full_like(p[:, :1], -1.0))  # p - onehot
        _write(out, p, (g_lp.to(p.dtype) * -inv_t).unsqueeze(-1))
        return
    p = torch.exp(lp, out=work[1][:r])
    c_h = g_ent.to(p.dtype) * inv_t
    c_lp = g_lp.to(p.dtype) * inv_t if g_lp is not None else torch.zeros_like(c_h)
    # grad = c_lp onehot - p (c_h lp + c_lp + c_h H); built negated in lp's buffer
    g = lp.mul_(c_h.unsqueeze(-1)).add_((c_lp + c_h * ent).unsqueeze(-1)).mul_(p)
    if g_lp is not None:
        g.scatter_add_(-1, idx, -c_lp.unsqueeze(-1))
    _write(out, g, -1.0)


def _chunk_forward_fused(
    x: Tensor, tgt: Tensor, inv_t: float, want_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``_chunk_forward`` written out of place without scratch, for torch.compile to fuse."""
    dt = _compute_dtype(x)
    m = x.amax(-1).to(dt)
    z = (x.to(dt) - m.unsqueeze(-1)) * inv_t
    e = z.exp()
    s = e.sum(-1)
    log_s = s.log()
    lp = z.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - log_s
    ent = log_s - (e * z).sum(-1) / s if want_entropy else None
    return lp, m + log_s / inv_t, ent


def _vocab_blocks(vocab: int, most: int = 128) -> int:
    """The largest power of two up to ``most`` that divides ``vocab`` (1 when it is odd)."""
    n = most
    while n > 1 and vocab % n:
        n //= 2
    return n


def _chunk_forward_blocked(
    x: Tensor, tgt: Tensor, inv_t: float, want_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``_chunk_forward_fused`` over blocks of the vocabulary: one read of the logits instead of two.

    Each row is cut into ``nb`` blocks (``_vocab_blocks``: 128 of 1,187 words for Qwen's 151,936);
    each block's max ``m_b``, sum ``s_b = sum exp(z_b)`` and ``sum exp(z_b) z_b`` (``z_b = (x - m_b) / T``)
    come from one pass over a block small enough to stay in registers, then the row's values from the
    ``[rows, nb]`` partials: with the row max ``M``, ``d_b = (m_b - M) / T`` and ``w_b = exp(d_b)``,
    ``s = sum w_b s_b`` and ``sum exp(z) z = sum w_b (sum exp(z_b) z_b + d_b s_b)`` for ``z = (x - M) / T``.
    Compiled, the blocks also give the grid ``nb`` times the programs of a per-row reduction.
    """
    dt = _compute_dtype(x)
    r, v = x.shape
    nb = _vocab_blocks(v)
    xb = x.view(r, nb, v // nb).to(dt)
    m_b = xb.amax(-1)
    z_b = (xb - m_b.unsqueeze(-1)) * inv_t
    e_b = z_b.exp()
    s_b = e_b.sum(-1)
    m = m_b.amax(-1)
    d_b = (m_b - m.unsqueeze(-1)) * inv_t
    w_b = d_b.exp()
    s = (w_b * s_b).sum(-1)
    log_s = s.log()
    lp = (x.gather(-1, tgt.unsqueeze(-1)).squeeze(-1).to(dt) - m) * inv_t - log_s
    ent = None
    if want_entropy:
        ez = (w_b * ((e_b * z_b).sum(-1) + d_b * s_b)).sum(-1)
        ent = log_s - ez / s
    return lp, m + log_s / inv_t, ent


def _chunk_backward_fused(
    x: Tensor,
    tgt: Tensor,
    shift: Tensor,
    ent: Tensor,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    inv_t: float,
    out: Tensor,
) -> None:
    """``_chunk_backward`` written out of place (one-hot by comparison), for torch.compile to fuse into one kernel."""
    dt = shift.dtype
    lp = (x.to(dt) - shift.unsqueeze(-1)) * inv_t
    p = lp.exp()
    onehot = (torch.arange(x.shape[-1], device=x.device) == tgt.unsqueeze(-1)).to(dt)
    if g_ent is None:
        g = (onehot - p) * (g_lp.to(dt) * inv_t).unsqueeze(-1)
    else:
        c_h = (g_ent.to(dt) * inv_t).unsqueeze(-1)
        g = -p * (c_h * lp + c_h * ent.unsqueeze(-1))
        if g_lp is not None:
            c_lp = (g_lp.to(dt) * inv_t).unsqueeze(-1)
            g = g + c_lp * (onehot - p)
    out.copy_(g)


def _chunk_backward_rowwise(
    x: Tensor,
    tgt: Tensor,
    shift: Tensor,
    ent: Tensor,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    inv_t: float,
    out: Tensor,
) -> Tensor:
    """``_chunk_backward_fused`` that also returns each row's gradient sum (unused by the caller).

    The sum makes the compiler build a row-wise kernel (one row a program, its scalars loaded once, no
    division of a flat element index by the vocabulary) that stores the gradient as it goes, where
    the plain version is an element-wise kernel over ``rows * V`` elements (on the H200 at ~1.15 TB/s).
    """
    _chunk_backward_fused(x, tgt, shift, ent, g_lp, g_ent, inv_t, out)
    return out.sum(-1, dtype=torch.float32)


# torch.compile'd chunk kernels (CUDA with triton only); built on first use, dropped for good after an error.
_compiled: dict[str, Any] = {}
_compile_off: str | None = None


def _compile_available(device: torch.device, wanted: bool = True) -> bool:
    """Whether chunks on ``device`` go through torch.compile: wanted, CUDA, triton importable, no failure yet."""
    if not wanted or device.type != "cuda" or _compile_off is not None:
        return False
    return importlib.util.find_spec("triton") is not None


def _disable_compile(exc: BaseException) -> None:
    global _compile_off
    _compile_off = f"{type(exc).__name__}: {exc}"
    log.warning("log-prob kernels: torch.compile failed, using the eager kernels from now on (%s)", _compile_off)


# The compiled forward: over vocabulary blocks (one read of the logits) or whole rows. Rows: on the H200 the
# blocked kernel took 0.092 s for the 0.5B bench's 131k rows against ~0.05 s for rows (inductor's row
# reduction re-reads each row from cache, so it is not two reads of memory).
BLOCKED_FORWARD = False
# The compiled backward as a row-wise kernel (``_chunk_backward_rowwise``): on the H200, [4096, 151936]
# forward + backward took 2.4 ms this way against 3.4 ms with the element-wise backward.
ROWWISE_BACKWARD = True
# Bound the chunk's rows for the compiler (``torch._dynamo.mark_dynamic`` with a maximum), so it can prove
# rows * V < 2**31 and index in 32 bits instead of 64; off: not measured yet.
BOUNDED_ROWS = False


def _compiled_fn(name: str):
    key = name
    if name == "forward" and BLOCKED_FORWARD:
        key = "forward-blocked"
    elif name == "backward" and ROWWISE_BACKWARD:
        key = "backward-rowwise"
    if BOUNDED_ROWS:
        key += "-bounded"
    if key not in _compiled:
        fn = {
            "forward": _chunk_forward_fused,
            "forward-blocked": _chunk_forward_blocked,
            "backward": _chunk_backward_fused,
            "backward-rowwise": _chunk_backward_rowwise,
        }[key.removesuffix("-bounded")]
        # A micro-batch's last chunk has fewer rows than the others: compile for dynamic rows at once.
        _compiled[key] = torch.compile(fn, dynamic=True)
    return _compiled[key]


def _bound_rows(*tensors: Tensor) -> None:
    """With ``BOUNDED_ROWS``: mark dim 0 of each as dynamic, at most the rows of a compiled chunk."""
    if not BOUNDED_ROWS:
        return
    most = max(2, COMPILED_CHUNK_ELEMS // max(1, tensors[0].shape[-1]))
    for t in tensors:
        if t.shape[0] >= 2:
            torch._dynamo.mark_dynamic(t, 0, min=2, max=most)


class _Chunks:
    """Runs the chunk kernels of one call: compiled where ``_compile_available``, else eager with
    scratch buffers allocated once and shared by all chunks (on the host a fresh buffer per chunk
    costs more in page faults than the arithmetic)."""

    def __init__(self, logits: Tensor, rows: int, buffers: int, compile: bool = True):
        self.compile, self.rows = compile, rows  # rows: the eager kernels' chunk (a compiled chunk may be longer)
        self.shape = (min(rows, logits.shape[0]), logits.shape[1])
        self.dtype, self.device, self.buffers = _compute_dtype(logits), logits.device, buffers
        self._work: list[Tensor] | None = None

    def _scratch(self) -> list[Tensor]:
        if self._work is None:
            self._work = [torch.empty(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.buffers)]
        return self._work

    def forward(self, x: Tensor, tgt: Tensor, inv_t: float, want_entropy: bool):
        if _compile_available(x.device, self.compile):
            try:
                x, tgt = _unviewed(x, tgt)
                _bound_rows(x, tgt)
                return _compiled_fn("forward")(x, tgt, inv_t, want_entropy)
            except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to eager
                _disable_compile(exc)
        r = self.rows
        parts = [
            _chunk_forward(x[s : s + r], tgt[s : s + r], inv_t, want_entropy, self._scratch())
            for s in range(0, x.shape[0], r)
        ]
        lp, shift = _cat([p[0] for p in parts]), _cat([p[1] for p in parts])
        return lp, shift, (_cat([p[2] for p in parts]) if want_entropy else None)

    def backward(self, x, tgt, shift, ent, g_lp, g_ent, inv_t: float, out: Tensor) -> None:
        if _compile_available(x.device, self.compile):
            try:
                x, tgt, shift, ent, g_lp, g_ent, out = _unviewed(x, tgt, shift, ent, g_lp, g_ent, out)
                _bound_rows(x, tgt, shift, out, *(t for t in (g_lp, g_ent) if t is not None))
                _compiled_fn("backward")(x, tgt, shift, ent, g_lp, g_ent, inv_t, out)
                return
            except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to eager
                _disable_compile(exc)
        r = self.rows
        for s in range(0, x.shape[0], r):
            sl = slice(s, s + r)
            e = ent[sl] if g_ent is not None else ent
            gl, ge = (None if g is None else g[sl] for g in (g_lp, g_ent))
            _chunk_backward(x[sl], tgt[sl], shift[sl], e, gl, ge, inv_t, out[sl], self._scratch())


def _unviewed(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """The chunks as tensors of their own for the compiled kernels: ``detach`` shares the storage (the backward's
    ``out`` is still written in place) but drops the view's base. Dynamo guards a view input on its base's
    size, so a chunk that spans the whole logits (``x._base.size(0) == x.size(0)``) and one of several compiled
    a graph each (two more compiles in the trainer's warm-up); without a base one graph serves both."""
    return tuple(None if t is None else t.detach() for t in tensors)


def _cat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _LogprobsEntropy(torch.autograd.Function):
    """(log-prob of targets, entropy) of softmax(logits * inv_t) per row, in row chunks, forward and backward.

    The entropy output is an empty tensor unless ``want_entropy``; it is differentiable only with
    ``entropy_grad``. Gradients of unused outputs arrive as None and cost nothing.
    """

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        targets: Tensor,
        inv_t: float,
        rows: int,
        step: int,
        want_entropy: bool,
        entropy_grad: bool,
        compile: bool,
    ):
        n, dt = logits.shape[0], _compute_dtype(logits)
        if n == 0:
            logp, shift, ent = (logits.new_empty(0, dtype=dt) for _ in range(3))
        else:
            run = _Chunks(logits, rows, 2 if want_entropy else 1, compile)
            parts = [
                run.forward(logits[s : s + step], targets[s : s + step], inv_t, want_entropy) for s in range(0, n, step)
            ]
            logp, shift = _cat([p[0] for p in parts]), _cat([p[1] for p in parts])
            ent = _cat([p[2] for p in parts]) if want_entropy else logits.new_empty(0, dtype=dt)
        ctx.save_for_backward(logits, targets, shift, ent)
        ctx.inv_t, ctx.rows, ctx.step, ctx.compile = inv_t, rows, step, compile
        ctx.set_materialize_grads(False)
        if not (want_entropy and entropy_grad):
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp: Tensor | None, g_ent: Tensor | None):
        logits, targets, shift, ent = ctx.saved_tensors
        if (g_lp is None and g_ent is None) or not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None, None
        step = ctx.step
        grad = torch.empty_like(logits)
        run = _Chunks(logits, ctx.rows, 1 if g_ent is None else 2, ctx.compile)
        for s in range(0, logits.shape[0], step):
            sl = slice(s, s + step)
            run.backward(
                logits[sl],
                targets[sl],
                shift[sl],
                ent[sl] if g_ent is not None else ent,
                g_lp[sl] if g_lp is not None else None,
                g_ent[sl] if g_ent is not None else None,
                ctx.inv_t,
                grad[sl],
            )
        return grad, None, None, None, None, None, None, None


def _fused(logits, targets, temperature: float, chunk_rows, want_entropy, entropy_grad, compile: bool = True):
    if targets is not None and logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on [B, T]")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)  # a view for contiguous logits (pass whole logits, not a [:, :-1] slice)
    if targets is None:
        flat_targets = torch.zeros(flat.shape[0], dtype=torch.long, device=logits.device)
    else:
        flat_targets = targets.reshape(-1).long()
    itemsize = torch.finfo(_compute_dtype(logits)).bits // 8
    rows = _rows_per_chunk(vocab, chunk_rows, logits.device.type, itemsize)
    step = rows
    if chunk_rows is None and COMPILED_CHUNK_ELEMS and _compile_available(logits.device, compile):
        step = max(rows, COMPILED_CHUNK_ELEMS // max(1, vocab))
    inv_t = 1.0 / float(temperature)
    lp, ent = _LogprobsEntropy.apply(flat, flat_targets, inv_t, rows, step, want_entropy, entropy_grad, compile)
    return lp.view(lead), (ent.view(lead) if want_entropy else None)


def token_logprobs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    with_entropy_grad: bool = False,
    compile: bool = True,
) -> tuple[Tensor, Tensor]:
    """(log-probs[B, T], entropy[B, T]) of softmax(logits[B, T, V] / temperature) in one pass per chunk.

    The log-probs equal ``token_logprobs`` (differentiable); the entropy, in nats, that of the same
    tempered distribution, from the same max/exp/sum as the log-probs (no second logsumexp). It
    carries a gradient only with ``with_entropy_grad`` (an entropy bonus); otherwise it is a detached
    metric and the backward is the log-prob one alone. ``compile=False``: eager kernels even on CUDA.
    """
    return _fused(logits, targets, temperature, chunk_rows, True, with_entropy_grad, compile)


def token_logprobs(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, chunk_rows: int | None = None, compile: bool = True
) -> Tensor:
    """Log-probs[B, T] (fp32, or fp64 for fp64 logits) of targets[B, T] under softmax(logits[B, T, V] / temperature).

    Equals ``log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None])[..., 0]``
    but only ever holds ``chunk_rows`` rows of fp32 softmax at once, forward and backward.
    """
    return _fused(logits, targets, temperature, chunk_rows, False, False, compile)[0]


def entropy_from_logits(logits: Tensor, chunk_rows: int | None = None) -> Tensor:
    """Entropy[B, T] (fp32 or fp64 like ``token_logprobs``, nats) of softmax(logits[B, T, V]), chunked like ``token_logprobs``."""
    return _fused(logits, None, 1.0, chunk_rows, True, True)[1]
