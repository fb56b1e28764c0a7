"""The decode step's model forward with fused projections: one QKV matmul and one gate-up matmul per layer.

A decode step multiplies only ``rows`` tokens (512 at most) by each weight: every matmul is small and
the step is hundreds of short kernels. The q, k and v projections read the same input, and so do the
MLP's gate and up projections, so each pair or triple can be one matmul over the weights stacked
along the output dimension: 7 matmuls a layer become 4, each fused one as long as its parts together
and fewer of them waiting on each other.

``FusedDecodeForward(model)`` runs the same computation as the transformers decoder layers of a
Llama, Qwen2 or Qwen3 causal LM (RMSNorm, rotary embedding, grouped-query attention through
``tidal.rollout.fast.attention.fast_attention``, SiLU-gated MLP, residuals; Qwen3's per-head q/k
norms; optional biases) as pure functions of the layers' weights, reusing the model's embedding,
rotary module and output projection. Only the stacked weights are its own: ``buffers`` lists them
(allocated by the decoder in its memory region, class kv_cache) and ``refresh()`` copies the model's
current q/k/v and gate/up weights into them in place (addresses unchanged, so captured CUDA graphs stay
valid). The decoder refreshes at the start of every ``generate``: a weight sync, a memory backend's
release and resume, anything that rewrote the parameters in between is picked up (a device-to-device
copy of ~0.5 GB for a 0.5B model, well under a millisecond on a GPU).

Compiled (``compile=True``, the decoder's ``--rollout-compile``), the arithmetic between the attention
calls runs as three ``torch.compile`` pieces: ``_enter`` (layer 0's q/k/v), ``_between`` (a layer's
o_proj, residual, MLP and residual, then the next layer's RMSNorm, q/k/v and rotary embedding) and
``_leave`` (the last layer's MLP block, the final norm, the logits, on each row's last position only). The
attention call stays eager (it writes the KV cache in place) between them. Each piece takes the layer's
weights as arguments, so one graph serves every layer, and none of them breaks: Dynamo traces three small
functions once, where compiling the model's forward restarts its trace at each wrapper frame above the
attention call and leaves the layer loop eager. The pieces see the tokens as one flat dimension
(``[rows * seq, ...]``), the only symbolic size of a dynamic graph: the decode steps of every batch bucket and
the prefill's chunks (rows and prompt width) run the same three graphs. Only the attention call sees rows and
positions apart. Compiled with every size symbolic and rows and width apart, the prefill took three graphs of
its own, and tracing them again took most of a warm first call (the 0.5B preset's engine warm-up compiled in
10.8 s warm; 2.5 s so, on one H100).

``write_kv=True`` moves the cache writes into the pieces: each piece writes the keys and values it computed into
the layer's cache (one in-place indexed store at each token's row and column, which the compiler can fuse with
the rotary embedding before it), and the attention call, told so (``AttnContext.kv_written``), only reads,
instead of its two eager writes a layer; in the prefill as in the decode steps. ``--rollout-fused-kv-write``
turns it on (off by default, on in the 0.5B preset).

``unsupported_reason(model)`` says why a model cannot take this path (other families, sliding
windows, layers whose modules are not where these families keep them); the decoder then runs the
model's own forward.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (fused decode computes SiLU)"
    if getattr(cfg, "rms_norm_eps", None) is None:
        return "no rms_norm_eps in the config"
    return None


def _stack_shapes(parts: list[torch.nn.Linear]) -> tuple[tuple[int, int], bool]:
    rows = sum(p.weight.shape[0] for p in parts)
    has_bias = parts[0].bias is not None
    if any((p.bias is not None) != has_bias for p in parts):
        raise ValueError("fused decode: projections with and without bias cannot be stacked")
    return (rows, parts[0].weight.shape[1]), has_bias


class FusedDecodeForward:
    """Last-position logits of one decode step, with stacked q/k/v and gate/up weights (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        compile: bool = False,
        dynamic: bool = True,
        write_kv: bool = False,
        options: dict | None = None,
    ) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fused decode cannot run this model: {reason}")
        self.model = model
        self.base = model.model
        cfg = _text_config(model)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self._eps = float(cfg.rms_norm_eps)
        self._dims = dict(heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim, eps=self._eps)
        self.buffers: list[torch.Tensor] = []
        self._qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._gate_up: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.compiled = False
        self.dynamic = dynamic
        self.write_kv = write_kv
        self.options = options  # inductor's (torch.compile ``options``), for every piece
        self.set_compiled(compile)

    def set_compiled(self, on: bool, backend: str = "inductor") -> None:
        """Run the three pieces through ``torch.compile`` or eagerly. Dynamic (the default): one graph each
        serves every batch bucket, every prefill chunk and every layer, whose weights are arguments; only the
        token count (and the cache's rows and length) is symbolic (``_mark_dynamic``), every other size static.
        Else one graph per batch bucket (still every layer), specialised to its size."""
        self.compiled = bool(on)
        opts = self.options if backend == "inductor" else None
        dynamic = None if self.dynamic else False  # dynamic: the sizes ``_mark_dynamic`` marks, no others
        wrap = (lambda f: torch.compile(f, dynamic=dynamic, backend=backend, options=opts)) if on else (lambda f: f)
        self._enter, self._between, self._leave = wrap(_enter), wrap(_between), wrap(_leave)

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
        """Last-position logits ``[rows, vocab]`` of ``ids`` (``ids``, ``pos``: ``[rows, seq]``; ``mask``: additive):
        one token per row in a decode step, a chunk of prompts in a prefill.

        The layers' arithmetic runs in three pieces around the attention calls (see the module docstring):
        ``enter`` before layer 0's, ``between`` from each layer's attention output to the next layer's
        query/key/value, ``leave`` from the last attention output to the logits. The pieces see the tokens as one
        flat dimension (``rows * seq``); only the attention calls see rows and positions apart."""
        base = self.base
        rows, seq = ids.shape
        hidden = base.embed_tokens(ids.reshape(-1))
        cos, sin = base.rotary_emb(hidden[None], pos.reshape(1, -1))  # [1, tokens, dim], reshaped in the pieces
        layers = list(zip(base.layers, self._qkv, self._gate_up))
        ctx = attention.current() if self.write_kv else None
        where = _where(ctx, rows, seq) if ctx is not None else None
        if ctx is not None:
            ctx.kv_written = True  # each piece writes the next layer's keys and values (``_kv_args``)
        hidden, cos, sin = self._mark_dynamic(hidden, 0), self._mark_dynamic(cos, 1), self._mark_dynamic(sin, 1)
        q, k, v = self._enter(hidden, *self._pre(layers[0]), cos, sin, *self._kv_args(ctx, 0, where), **self._dims)
        for i, (layer, _, _) in enumerate(layers):
            heads = (t.view(rows, seq, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            out, _ = attention.fast_attention(layer.self_attn, *heads, mask, scaling=layer.self_attn.scaling)
            out = self._mark_dynamic(_unviewed(out, (rows * seq, out.shape[-2] * out.shape[-1])), 0)
            if i + 1 < len(layers):
                hidden, q, k, v = self._between(
                    hidden, out, *self._post(layers[i]), *self._pre(layers[i + 1]), cos, sin,
                    *self._kv_args(ctx, i + 1, where), **self._dims,
                )  # fmt: skip
        head = self.model.lm_head
        hidden = self._mark_dynamic(_last_position(hidden, rows, seq), 0)
        out = self._mark_dynamic(_last_position(out, rows, seq), 0)
        return self._leave(hidden, out, *self._post(layers[-1]), base.norm.weight, head.weight, head.bias, self._eps)

    def _mark_dynamic(self, t: torch.Tensor, *dims: int) -> torch.Tensor:
        """``t`` with its ``dims`` symbolic where the pieces are compiled dynamic: the token count of each piece's
        inputs (a layer's cache: its rows and length). Every other size stays static, so a piece's shapes carry one
        symbol instead of one for each size of each argument (the weights'), and Dynamo cannot take one size for
        another by coincidence (a head dimension equal to a warm-up's token count)."""
        if self.compiled and self.dynamic:
            torch._dynamo.maybe_mark_dynamic(t, list(dims))
        return t

    def _kv_args(self, ctx, layer: int, where: tuple | None) -> tuple:
        """The cache arguments of a piece that writes layer ``layer``'s keys and values: the layer's whole cache
        (keys and values stacked, ``[2, cache rows, kv_heads, len, dim]``) and where the tokens go (``_where``);
        Nones when the attention call writes them."""
        if ctx is None:
            return None, None, None
        kv = ctx.cache.buf[self.base.layers[layer].self_attn.layer_idx]
        return self._mark_dynamic(_unviewed(kv, kv.shape), 1, 3), *where

    def _pre(self, entry) -> tuple:
        """Layer arguments of ``_qkv``: input norm weight, stacked q/k/v weight and bias, q/k norm weights."""
        layer, (wq, bq), _ = entry
        attn = layer.self_attn
        q_norm = attn.q_norm.weight if hasattr(attn, "q_norm") else None
        k_norm = attn.k_norm.weight if hasattr(attn, "k_norm") else None
        return layer.input_layernorm.weight, wq, bq, q_norm, k_norm

    def _post(self, entry) -> tuple:
        """Layer arguments of ``_mlp_block``: o_proj, post-attention norm, stacked gate/up and down_proj weights."""
        layer, _, (wg, bg) = entry
        o, down = layer.self_attn.o_proj, layer.mlp.down_proj
        return o.weight, o.bias, layer.post_attention_layernorm.weight, wg, bg, down.weight, down.bias


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the Llama/Qwen families compute it: ``w * (x / sqrt(mean(x^2) + eps))``, in fp32, then cast."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _qkv(hidden, norm_w, wqkv, bqkv, q_norm, k_norm, cos, sin, *, heads, kv_heads, head_dim, eps):
    """A layer's attention inputs from the residual stream ``[tokens, hidden]``: input RMSNorm, one q/k/v matmul,
    Qwen3's per-head q/k norms, the rotary embedding (``x cos + rotate_half(x) sin``); q ``[tokens, heads, dim]``,
    k and v ``[tokens, kv_heads, dim]``."""
    tokens = hidden.shape[0]
    cos, sin = cos.view(tokens, 1, -1), sin.view(tokens, 1, -1)
    x = _rms_norm(hidden, norm_w, eps)
    q, k, v = F.linear(x, wqkv, bqkv).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    if q_norm is not None:
        q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
    v = v.reshape(tokens, kv_heads, head_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def _mlp_block(hidden, attn_out, wo, bo, post_w, wgu, bgu, wd, bd, eps):
    """The rest of a layer after its attention (both ``[tokens, ...]``): o_proj and residual, post-attention
    RMSNorm, one gate/up matmul, SiLU gate, down_proj and residual."""
    hidden = hidden + F.linear(attn_out, wo, bo)
    gate, up = F.linear(_rms_norm(hidden, post_w, eps), wgu, bgu).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, wd, bd)


def _where(ctx, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a forward's tokens go in the cache, as the pieces take it: ``(first column [1], [first row, tokens a
    row])``, both device tensors, so one graph serves a decode step (the decoder's ``s_cpos`` and ``origin``,
    static buffers a captured graph reads at replay) and a prefill chunk (made here: rows from ``ctx.row0``,
    columns from ``ctx.prefill_from``)."""
    if ctx.decode:
        if ctx.origin is None:
            raise RuntimeError("fast decode: a decode step that the fused pieces write needs AttnContext.origin")
        return ctx.cpos, ctx.origin
    dev = ctx.cache.buf.device
    return torch.tensor([ctx.prefill_from], device=dev), torch.tensor([ctx.row0, seq], device=dev)


def _write_kv(k, v, kv: torch.Tensor | None, col0: torch.Tensor | None, origin: torch.Tensor | None) -> None:
    """This forward's keys and values (``[tokens, kv_heads, dim]``, ``origin[1]`` tokens a row) into the layer's
    cache ``kv`` (``[2, rows, kv_heads, len, dim]``) in place: token ``i`` at row ``origin[0] + i // origin[1]``,
    column ``col0 + i % origin[1]``; nothing when ``kv`` is None (the attention call writes them). Compiled, the
    write can share a kernel with the rotary embedding before it, instead of two eager copies."""
    if kv is not None:
        i = torch.arange(k.shape[0], device=k.device)
        kv[:, origin[0] + i // origin[1], :, col0 + i % origin[1]] = torch.stack((k, v), dim=1)


def _enter(hidden, norm_w, wqkv, bqkv, q_norm, k_norm, cos, sin, kv=None, col0=None, origin=None, *, heads, kv_heads,
           head_dim, eps):  # fmt: skip
    """Piece one: layer 0's attention inputs (and, with ``kv``, its keys and values written)."""
    q, k, v = _qkv(hidden, norm_w, wqkv, bqkv, q_norm, k_norm, cos, sin, heads=heads, kv_heads=kv_heads,
                   head_dim=head_dim, eps=eps)  # fmt: skip
    _write_kv(k, v, kv, col0, origin)
    return q, k, v


def _between(hidden, attn_out, wo, bo, post_w, wgu, bgu, wd, bd, norm_w, wqkv, bqkv, q_norm, k_norm, cos, sin,
             kv=None, col0=None, origin=None, *, heads, kv_heads, head_dim, eps):  # fmt: skip
    """Piece two: layer i's MLP block, then layer i+1's attention inputs (new residual stream, q, k, v; with
    ``kv``, layer i+1's keys and values written)."""
    hidden = _mlp_block(hidden, attn_out, wo, bo, post_w, wgu, bgu, wd, bd, eps)
    q, k, v = _qkv(hidden, norm_w, wqkv, bqkv, q_norm, k_norm, cos, sin, heads=heads, kv_heads=kv_heads,
                   head_dim=head_dim, eps=eps)  # fmt: skip
    _write_kv(k, v, kv, col0, origin)
    return hidden, q, k, v


def _leave(hidden, attn_out, wo, bo, post_w, wgu, bgu, wd, bd, final_w, head_w, head_b, eps):
    """Piece three, on each row's last position only (``[rows, ...]``): the last layer's MLP block, the final RMSNorm
    and the output projection."""
    hidden = _mlp_block(hidden, attn_out, wo, bo, post_w, wgu, bgu, wd, bd, eps)
    return F.linear(_rms_norm(hidden, final_w, eps), head_w, head_b)


def _unviewed(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` seen as ``shape`` (its memory, made contiguous first), but not a view of ``t``. A compiled piece takes a
    view's base as its input too and guards on the base's sizes: the attention output's ``[rows, seq, ...]`` (a
    prefill's ``seq`` tokens against a decode step's one) would give the decode steps and the prefill a graph each,
    and a layer's cache would bring every layer's."""
    t = t.contiguous()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), shape)


def _last_position(t: torch.Tensor, rows: int, seq: int) -> torch.Tensor:
    """Each row's last position of a flat ``[rows * seq, ...]`` tensor, contiguous (a decode step's is the tensor)."""
    return t if seq == 1 else t.view(rows, seq, *t.shape[1:])[:, -1].contiguous()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
