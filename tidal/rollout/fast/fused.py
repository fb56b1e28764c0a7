"""The decode step's model forward with fused projections: one QKV matmul and one gate-up matmul per layer.

A decode step multiplies only ``rows`` tokens (512 at most) by each weight: every matmul is small and
the step is hundreds of short kernels. The q, k and v projections read the same input, and so do the
MLP's gate and up projections, so each pair or triple can be one matmul over the weights stacked
along the output dimension: 7 matmuls a layer become 4, each fused one as long as its parts together
and fewer of them waiting on each other.

``FusedDecodeForward(model)`` runs the same computation as the transformers decoder layers of a
Llama, Qwen2 or Qwen3 causal LM (RMSNorm, rotary embedding, grouped-query attention through
``tidal.rollout.fast.attention.fast_attention``, SiLU-gated MLP, residuals; Qwen3's per-head q/k
norms; optional biases), reusing the model's own norm, rotary, embedding, output-projection and
activation modules. Only the stacked weights are its own: ``buffers`` lists them (allocated by the
decoder in its memory region, class kv_cache) and ``refresh()`` copies the model's current q/k/v and
gate/up weights into them in place (addresses unchanged, so captured CUDA graphs stay valid). The
decoder refreshes at the start of every ``generate``: a weight sync, a memory backend's release and
resume, anything that rewrote the parameters in between is picked up (a device-to-device copy of
~0.5 GB for a 0.5B model, well under a millisecond on a GPU).

``unsupported_reason(model)`` says why a model cannot take this path (other families, sliding
windows, layers whose modules are not where these families keep them); the decoder then runs the
model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.rollout.fast import attention

FAMILIES = ("llama", "qwen2", "qwen3")


def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``FusedDecodeForward`` cannot run ``model``, or None when it can."""
    cfg = _text_config(model)
    if getattr(cfg, "model_type", None) not in FAMILIES:
        return f"model type {getattr(cfg, 'model_type', None)!r} (fused decode supports {', '.join(FAMILIES)})"
    base = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or any(not hasattr(base, n) for n in needed) or not hasattr(model, "lm_head"):
        return "modules are not where the Llama/Qwen families keep them"
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "a decoder layer without the usual attention projections"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "a decoder layer without a gated MLP"
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention"
    return None


def _stack_shapes(parts: list[torch.nn.Linear]) -> tuple[tuple[int, int], bool]:
    rows = sum(p.weight.shape[0] for p in parts)
    has_bias = parts[0].bias is not None
    if any((p.bias is not None) != has_bias for p in parts):
        raise ValueError("fused decode: projections with and without bias cannot be stacked")
    return (rows, parts[0].weight.shape[1]), has_bias


class FusedDecodeForward:
    """Last-position logits of one decode step, with stacked q/k/v and gate/up weights (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fused decode cannot run this model: {reason}")
        self.model = model
        self.base = model.model
        cfg = _text_config(model)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.buffers: list[torch.Tensor] = []
        self._qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._gate_up: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def _groups(self) -> list[tuple[list[torch.nn.Linear], list[torch.nn.Linear]]]:
        return [
            ([m.self_attn.q_proj, m.self_attn.k_proj, m.self_attn.v_proj], [m.mlp.gate_proj, m.mlp.up_proj])
            for m in self.base.layers
        ]

    def nbytes(self) -> int:
        """Bytes of the stacked weights (what ``allocate`` takes)."""
        total = 0
        for group in self._groups():
            for parts in group:
                (rows, cols), bias = _stack_shapes(parts)
                total += (rows * cols + (rows if bias else 0)) * parts[0].weight.element_size()
        return total

    def allocate(self, device: torch.device) -> None:
        """Allocate the stacked weights (call inside the decoder's memory region), then ``refresh``."""
        self._qkv, self._gate_up, self.buffers = [], [], []
        dtype = next(self.model.parameters()).dtype
        for qkv, gate_up in self._groups():
            for parts, out in ((qkv, self._qkv), (gate_up, self._gate_up)):
                (rows, cols), has_bias = _stack_shapes(parts)
                w = torch.empty((rows, cols), dtype=dtype, device=device)
                b = torch.empty((rows,), dtype=dtype, device=device) if has_bias else None
                out.append((w, b))
                self.buffers += [w] + ([b] if b is not None else [])
        self.refresh()

    def release(self) -> None:
        self._qkv, self._gate_up, self.buffers = [], [], []

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the model's current projection weights into the stacked buffers, in place."""
        for (qkv, gate_up), (wq, bq), (wg, bg) in zip(self._groups(), self._qkv, self._gate_up):
            for parts, w, b in ((qkv, wq, bq), (gate_up, wg, bg)):
                torch.cat([p.weight for p in parts], dim=0, out=w)
                if b is not None:
                    torch.cat([p.bias for p in parts], dim=0, out=b)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` for one token per row (``ids``, ``pos``: ``[rows, 1]``; ``mask``: additive)."""
        base = self.base
        hidden = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(hidden, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rows, seq = ids.shape
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for layer, (wq, bq), (wg, bg) in zip(base.layers, self._qkv, self._gate_up):
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm(hidden)
            q, k, v = F.linear(x, wq, bq).split([q_out, kv_out, kv_out], dim=-1)
            q = q.view(rows, seq, self.heads, self.head_dim)
            k = k.view(rows, seq, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotary embedding
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.view(rows, seq, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            out, _ = attention.fast_attention(attn, q, k, v, mask, scaling=attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(rows, seq, q_out))
            x = layer.post_attention_layernorm(hidden)
            gate, up = F.linear(x, wg, bg).chunk(2, dim=-1)
            hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
        hidden = base.norm(hidden)
        return self.model.lm_head(hidden[:, -1])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
