"""On-device sampling with policy log-probs, in a form a CUDA graph can capture.

One call turns a batch of last-position logits ``[rows, vocab]`` into the sampled token of each row
and that token's log-probability under the *raw* policy (``log_softmax`` of the unprocessed logits,
temperature 1): the value the trainer recomputes, whatever temperature/top-k/top-p sampled it.

How it avoids a second full softmax over the vocabulary: one fused ``log_softmax`` gives the fp32
log-probs, and sampling works on them directly (they differ from the logits by a per-row constant).
Sampling is Gumbel-max in its exponential form, ``argmax(z - log E)`` with ``E ~ Exp(1)`` and ``z``
the temperature-scaled, filtered log-probs, which draws exactly from ``softmax(z)`` without
normalising it (``torch.multinomial`` does the same internally for one sample, but checks its input
with a host synchronisation, which a CUDA graph cannot hold). ``plain_core`` is the same for greedy
and unfiltered sampling written for ``torch.compile``. Top-k and top-k+top-p work on the ``k`` largest logits
only (``torch.topk``), so the noise and the cumulative sum cover ``k`` entries, not the vocabulary;
only top-p without top-k sorts the whole row.

``blocked_core`` (``--rollout-sampler-noise blocks``) samples unfiltered rows in two exact stages, each a
Gumbel-max: a block of ``B`` consecutive words by the block's probability mass (the log-sum-exp of its
scaled logits), then a word of the chosen block by its own probability within it. ``P(block) * P(word |
block) = softmax(z)[word]``, so the distribution is the same as one Gumbel-max over the vocabulary, but the
noise is ``rows x (V/B + B)`` draws instead of ``rows x V`` (for Qwen's 151,936 words and ``B = 128``:
1,315 draws a row instead of 151,936), and the logits are read once for the block sums and once more
only for the chosen block.

Graph safety: no host synchronisation, no shapes that depend on values. The parameters that change
between calls (temperature, top-p) are device tensors read inside the graph; what changes the
computation itself (greedy or not, which filters, ``k``) is the static ``SamplingMode``, part of the
graph's key. Random numbers come from the device's default generator on CUDA (graph-safe: each
replay advances its offset) and from a private ``torch.Generator`` on CPU.

Semantics follow transformers' warpers: temperature first, then top-k, then top-p (keep the
smallest prefix of the sorted distribution whose mass reaches ``top_p``, at least one token).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingMode:
    """The shape of the sampling computation: what a captured graph is specialised for."""

    greedy: bool = False
    top_k: int = 0  # 0: no top-k filter
    top_p: bool = False  # whether a top-p filter applies (its value is a tensor)
    scaled: bool = False  # temperature != 1 (its value is a tensor); T == 1 skips a pass over the vocab

    @property
    def name(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"topk{self.top_k}"] if self.top_k else []
        if self.top_p:
            parts.append("topp")
        if self.scaled:
            parts.append("temp")
        return "+".join(parts) or "sample"


def sampling_mode(temperature: float, top_p: float, top_k: int, vocab: int) -> SamplingMode:
    """The mode for these parameters; a ``top_k`` of at least the vocabulary is no filter."""
    if temperature == 0:
        return SamplingMode(greedy=True)
    k = int(top_k) if 0 < top_k < vocab else 0
    return SamplingMode(greedy=False, top_k=k, top_p=float(top_p) < 1.0, scaled=float(temperature) != 1.0)


def vocab_block(vocab: int, largest: int = 256, smallest: int = 32) -> int:
    """The block size of ``blocked_core`` for a vocabulary: the largest power of two in ``[smallest, largest]``
    that divides it (so that the logits reshape into whole blocks without a copy); 0 where none does."""
    b = largest
    while b >= smallest:
        if vocab % b == 0:
            return b
        b //= 2
    return 0


def _static_width(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors``, their second dimension (the vocabulary, a block, a count of blocks) marked static for
    ``torch.compile``: a core compiled with ``dynamic=True`` then keeps only the rows symbolic, so the
    reductions over a block of 128 words are compiled for that size (one read of each block, constant
    indexing) instead of a loop over a symbolic length. Marking is an attribute on the tensor; eager calls
    ignore it, and where nothing was compiled (``torch._dynamo`` not imported: ``torch.compile`` imports it)
    nothing is marked, which spares an eager run dynamo's import (a second on a small CPU)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        for t in tensors:
            dynamo.mark_static(t, 1)
    return tensors


def _exp_noise(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    noise.exponential_(generator=generator)
    return noise


def _top_p_keep(sorted_z: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask of the sorted (descending) entries that survive top-p: exclusive prefix mass < top_p."""
    probs = torch.softmax(sorted_z, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    return before < top_p


def sample(
    logits: torch.Tensor,
    mode: SamplingMode,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
    fused: Callable | None = None,
    drawn: Callable | None = None,
    blocked: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [rows] int64, logprobs [rows] fp32)`` for logits ``[rows, vocab]``.

    ``temperature`` and ``top_p`` are 0-d or ``[1]`` fp32 device tensors (ignored when the mode does
    not use them). Log-probs are always those of the raw logits at temperature 1. ``fused`` (a
    compiled ``plain_core``) replaces the eager path for greedy and unfiltered sampling; ``drawn`` (a
    compiled ``drawn_core``) replaces it for unfiltered sampling, drawing its own noise; ``blocked`` (a
    ``blocked_core``, compiled or not) does for a vocabulary that ``vocab_block`` splits, with its two small
    noise tensors drawn here.
    """
    unfiltered = not mode.greedy and not mode.top_k and not mode.top_p
    rows, vocab = logits.shape
    b = vocab_block(vocab) if blocked is not None and unfiltered else 0
    if b:
        outer = _exp_noise((rows, vocab // b), logits.device, generator)
        inner = _exp_noise((rows, b), logits.device, generator)
        return blocked(*_static_width(logits, outer, inner), temperature, mode.scaled)
    if drawn is not None and unfiltered:
        return drawn(*_static_width(logits), temperature, mode.scaled)
    if fused is not None and not mode.top_k and not mode.top_p:
        noise = None if mode.greedy else _static_width(_exp_noise(tuple(logits.shape), logits.device, generator))[0]
        return fused(_static_width(logits)[0], noise, temperature, mode.greedy, mode.scaled)
    # One fused kernel for the fp32 log-probs; sampling reuses them (a per-row shift of the logits,
    # which changes neither the argmax, nor top-k, nor softmax), so there is no second softmax.
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    if mode.greedy:
        tokens = torch.argmax(logits, dim=-1)
    elif mode.top_k:
        vals, idx = torch.topk(logp, mode.top_k, dim=-1)  # sorted, descending
        if mode.scaled:
            vals = vals / temperature
        if mode.top_p:
            vals = vals.masked_fill(~_top_p_keep(vals, top_p), float("-inf"))
        noise = _exp_noise(tuple(vals.shape), vals.device, generator)
        choice = torch.argmax(vals - noise.log_(), dim=-1, keepdim=True)
        tokens = idx.gather(1, choice).squeeze(1)
    elif mode.top_p:
        vals, idx = torch.sort(logp / temperature if mode.scaled else logp, dim=-1, descending=True)
        vals = vals.masked_fill_(~_top_p_keep(vals, top_p), float("-inf"))
        noise = _exp_noise(tuple(vals.shape), vals.device, generator)
        choice = torch.argmax(vals.sub_(noise.log_()), dim=-1, keepdim=True)
        tokens = idx.gather(1, choice).squeeze(1)
    else:
        # argmax(logp / T - log E) == argmax(logp - T * log E) for T > 0, in the noise buffer: the
        # vocabulary-wide temporaries are the log-probs and the noise, nothing more.
        noise = _exp_noise(tuple(logp.shape), logp.device, generator).log_()
        if mode.scaled:
            noise.mul_(temperature)
        tokens = torch.argmax(torch.sub(logp, noise, out=noise), dim=-1)
    logprobs = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, logprobs


def plain_core(
    logits: torch.Tensor, noise: torch.Tensor | None, temperature: torch.Tensor, greedy: bool, scaled: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy or unfiltered sampling written for ``torch.compile``: one pass for log-sum-exp, one for argmax.

    Functional on purpose (no in-place ops on inputs), so that the compiler fuses the cast, the noise
    transform and both reductions instead of materialising fp32 copies of the logits.
    """
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    if greedy:
        tokens = torch.argmax(z, dim=-1)
    else:
        gumbel = -torch.log(noise)
        if scaled:
            gumbel = gumbel * temperature
        tokens = torch.argmax(z + gumbel, dim=-1)
    return tokens, (z.gather(1, tokens.unsqueeze(1)) - lse).squeeze(1)


def drawn_core(logits: torch.Tensor, temperature: torch.Tensor, scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``plain_core``'s unfiltered sampling with its noise drawn inside: ``E = -log U``, ``U ~ U[0, 1)``.

    Compiled, the uniform draws become part of the argmax kernel (the compiler's in-kernel
    generator), so no ``[rows, vocab]`` fp32 noise is written and read back each step. The draws come
    from the compiler's own seeds, not from a generator the caller passes, so the tokens differ from
    ``plain_core``'s for the same seed; the distribution is the same (``U = 0`` gives ``E = inf``, a
    Gumbel of ``-inf``: a word drawn with probability 2**-24 is never the maximum).
    """
    z = logits.float()
    noise = -torch.log(torch.rand_like(z))
    return plain_core(logits, noise, temperature, False, scaled)


def blocked_core(
    logits: torch.Tensor, outer: torch.Tensor, inner: torch.Tensor, temperature: torch.Tensor, scaled: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfiltered sampling of ``softmax(logits / T)`` in two Gumbel-max stages (module docstring), with the raw
    log-probs. ``outer``: ``Exp(1)`` noise ``[rows, V / B]``, one draw per block; ``inner``: ``[rows, B]``, one per
    word of the chosen block (``B = inner.shape[1]`` divides ``V``: ``vocab_block``).

    Stage one is a Gumbel-max over the blocks' log-masses ``logsumexp(z[block])``, which draws a block with
    probability equal to its share of the softmax; stage two one over the chosen block's ``z``, which draws a
    word with its probability given the block. The row's log-sum-exp for the log-prob comes from the raw
    blocks' log-sum-exps (equal to one over the row, to rounding). Written for ``torch.compile`` like
    ``plain_core`` (functional, no host synchronisation, shapes fixed by the inputs').
    """
    rows, vocab = logits.shape
    b = inner.shape[1]
    x = logits.float()
    xb = x.view(rows, vocab // b, b)
    raw_blocks = torch.logsumexp(xb, dim=-1)  # [rows, V / B]
    lse = torch.logsumexp(raw_blocks, dim=-1, keepdim=True)
    mass = torch.logsumexp(xb / temperature, dim=-1) if scaled else raw_blocks
    block = torch.argmax(mass - torch.log(outer), dim=-1)  # [rows]
    words = xb.gather(1, block.view(rows, 1, 1).expand(rows, 1, b)).squeeze(1)  # [rows, B]
    if scaled:
        words = words / temperature
    tokens = block * b + torch.argmax(words - torch.log(inner), dim=-1)
    return tokens, (x.gather(1, tokens.unsqueeze(1)) - lse).squeeze(1)
