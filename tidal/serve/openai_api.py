"""OpenAI-compatible endpoints of ``tidal serve``: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Requests and replies follow OpenAI's API reference, so a stock ``openai`` client (or an agent
harness, an eval tool) can sample the policy being trained. They run through the same engine
worker as ``/generate``, so they batch with it. Log-probs: ``/v1/completions`` with
``logprobs=0`` fills ``token_logprobs``; ``/v1/chat/completions`` with ``logprobs=true`` fills
``logprobs.content``; both are the raw policy's log-probs of the sampled tokens. Top alternatives
(``logprobs > 0``, ``top_logprobs > 0``) are refused: the engine records only the sampled token.

Chat prompts are rendered with the tokenizer's chat template; a tokenizer without one (the tiny
presets) gets a plain ``role: content`` line per message followed by ``assistant:``.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from tidal.errors import UserError
from tidal.rollout.types import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class CompletionRequest(_Body):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    logprobs: int | None = None
    seed: int | None = None
    stream: bool = False


class ChatMessage(_Body):
    role: str
    content: str | None = None


class ChatCompletionRequest(_Body):
    model: str
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    seed: int | None = None
    stream: bool = False


def render_chat(messages: list[ChatMessage], tokenizer) -> list[int]:
    msgs = [{"role": m.role, "content": m.content or ""} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that rejects these messages
            raise UserError(f"messages: the tokenizer's chat template failed ({type(e).__name__}: {e})") from None
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _finish(reason: dict) -> str:
    return "length" if reason["type"] == "length" else "stop"


def model_card(state) -> dict:
    return {
        "id": state.served_model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "tidal",
        "root": state.served_model_name,
        "max_model_len": getattr(state.engine.model.config.get_text_config(), "max_position_embeddings", None),
    }


def _check_model(state, model: str) -> None:
    if model != state.served_model_name:
        raise UserError(f"model {model!r}: this server serves {state.served_model_name!r}")


def _sampling(temperature, top_p, max_tokens, stop, seed) -> SamplingParams:
    return SamplingParams(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        max_new_tokens=16 if max_tokens is None else max_tokens,
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        seed=seed,
    )


async def _run(state, prompts: list[list[int]], n: int, sp: SamplingParams) -> list:
    """Every sample of every prompt (``n`` per prompt, prompt by prompt), through the engine worker."""
    import asyncio

    vocab = state.vocab_size
    if any(min(p) < 0 or max(p) >= vocab for p in prompts if p):
        raise UserError(f"prompt holds token ids outside the vocabulary of {vocab}")
    res = await asyncio.gather(*(state.worker.generate([p] * n, sp) for p in prompts))
    return [s for r in res for s in r.samples]


def _usage(prompts, outs) -> dict:
    p = sum(len(x) for x in prompts)
    c = sum(len(s.response_ids) for s in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _reply(state, kind: str, prefix: str, choices: list, prompts, outs) -> dict:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": state.served_model_name,
        "choices": choices,
        "usage": _usage(prompts, outs),
    }


def _completion_prompts(prompt, tok) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [tok(prompt)["input_ids"]]
    elif prompt and isinstance(prompt[0], str):
        prompts = [tok(x)["input_ids"] for x in prompt]
    elif prompt and isinstance(prompt[0], list):
        prompts = [list(x) for x in prompt]
    else:
        prompts = [list(prompt)]
    if not prompts or any(not x for x in prompts):
        raise UserError("prompt is empty; send at least one token")
    return prompts


def _completion_logprobs(s, tok) -> dict:
    toks = [tok.decode([t]) for t in s.response_ids]
    offsets, at = [], 0
    for t in toks:
        offsets.append(at)
        at += len(t)
    return {"tokens": toks, "token_logprobs": list(s.response_logprobs), "top_logprobs": None, "text_offset": offsets}


def _chat_logprobs(s, tok) -> dict:
    content = []
    for t, x in zip(s.response_ids, s.response_logprobs):
        piece = tok.decode([t])
        content.append({"token": piece, "logprob": x, "bytes": list(piece.encode()), "top_logprobs": []})
    return {"content": content}


async def completions(state, req: CompletionRequest) -> dict:
    from tidal.serve.generate import finish_reason, trim_stop

    _check_model(state, req.model)
    if req.stream:
        raise UserError("stream=true is not supported by tidal serve")
    if req.logprobs is not None and req.logprobs > 0:
        raise UserError("logprobs > 0 (top alternatives) is not supported; use logprobs=0 for the sampled tokens'")
    tok = state.engine.tokenizer
    prompts = _completion_prompts(req.prompt, tok)
    sp = _sampling(req.temperature, req.top_p, req.max_tokens, req.stop, req.seed)
    outs = await _run(state, prompts, req.n, sp)
    choices = [
        {
            "index": k,
            "text": trim_stop(s.response_text, sp.stop),
            "logprobs": _completion_logprobs(s, tok) if req.logprobs is not None else None,
            "finish_reason": _finish(finish_reason(s, sp, state.end_ids)),
        }
        for k, s in enumerate(outs)
    ]
    return _reply(state, "text_completion", "cmpl", choices, prompts, outs)


async def chat_completions(state, req: ChatCompletionRequest) -> dict:
    from tidal.serve.generate import finish_reason, trim_stop

    _check_model(state, req.model)
    if req.stream:
        raise UserError("stream=true is not supported by tidal serve")
    if req.top_logprobs:
        raise UserError("top_logprobs > 0 is not supported; use logprobs=true for the sampled tokens'")
    if not req.messages:
        raise UserError("messages is empty; send at least one message")
    tok = state.engine.tokenizer
    prompts = [render_chat(req.messages, tok)]
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:  # OpenAI: up to the context; here at most 128 new tokens unless asked
        limit = model_card(state)["max_model_len"] or 2048
        max_tokens = max(1, min(128, limit - len(prompts[0])))
    sp = _sampling(req.temperature, req.top_p, max_tokens, req.stop, req.seed)
    outs = await _run(state, prompts, req.n, sp)
    choices = [
        {
            "index": k,
            "message": {"role": "assistant", "content": trim_stop(s.response_text, sp.stop)},
            "logprobs": _chat_logprobs(s, tok) if req.logprobs else None,
            "finish_reason": _finish(finish_reason(s, sp, state.end_ids)),
        }
        for k, s in enumerate(outs)
    ]
    return _reply(state, "chat.completion", "chatcmpl", choices, prompts, outs)


def add_openai_routes(app: FastAPI, state) -> None:
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(state)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        _check_model(state, model)
        return model_card(state)

    @app.post("/v1/completions")
    async def v1_completions(req: CompletionRequest):
        return await completions(state, req)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(req: ChatCompletionRequest):
        return await chat_completions(state, req)
