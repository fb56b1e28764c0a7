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

Graph safety: no host synchronisation, no shapes that depend on values. The parameters that change
between calls (temperature, top-p) are device tensors read inside the graph; what changes the
computation itself (greedy or not, which filters, ``k``) is the static ``SamplingMode``, part of the
graph's key. Random numbers come from the device's default generator on CUDA (graph-safe: each
replay advances its offset) and from a private ``torch.Generator`` on CPU.

Semantics follow transformers' warpers: temperature first, then top-k, then top-p (keep the
smallest prefix of the sorted distribution whose mass reaches ``top_p``, at least one token).
"""

from __future__ import annotations

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [rows] int64, logprobs [rows] fp32)`` for logits ``[rows, vocab]``.

    ``temperature`` and ``top_p`` are 0-d or ``[1]`` fp32 device tensors (ignored when the mode does
    not use them). Log-probs are always those of the raw logits at temperature 1. ``fused`` (a
    compiled ``plain_core``) replaces the eager path for greedy and unfiltered sampling; ``drawn`` (a
    compiled ``drawn_core``) replaces it for unfiltered sampling, drawing its own noise.
    """
    if drawn is not None and not mode.greedy and not mode.top_k and not mode.top_p:
        return drawn(logits, temperature, mode.scaled)
    if fused is not None and not mode.top_k and not mode.top_p:
        noise = None if mode.greedy else _exp_noise(tuple(logits.shape), logits.device, generator)
        return fused(logits, noise, temperature, mode.greedy, mode.scaled)
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
