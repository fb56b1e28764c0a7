"""The wire side of the HTTP engine: SGLang's requests and replies, and one client of one server.

``SglangClient`` sends JSON over HTTP (httpx) and turns every failure into one line naming the
address, the endpoint and the reply: a server that cannot be reached is ``EngineDiedError`` (the
driver restarts or reconnects it), a reply that is not what a server speaking SGLang's protocol
sends is ``EngineReplyError`` (a ``UserError``). The helpers map tidal's types onto SGLang's fields
(``sampling_body``, ``fill_sample``: ``output_token_logprobs`` and ``finish_reason`` back into a
``Sample``) and build ``update_weights_from_tensor``'s payload (``serialize_named_tensors``:
SGLang's ``MultiprocessingSerializer`` form). ``tidal.rollout.http_engine`` is the engine built on them.
"""

from __future__ import annotations

import base64
from typing import Any

from tidal.errors import EngineDiedError, UserError
from tidal.rollout.types import Sample, SamplingParams

# SGLang's finish reasons -> Sample.status; "abort" means the request was dropped and is re-run (or, with
# --partial-rollout, kept as far as it got and continued later: ``append_output``).
_STATUS = {"stop": "completed", "length": "truncated"}


class EngineReplyError(UserError):
    """A server answered, but not as a server speaking SGLang's protocol would (non-200, bad shape)."""


class SglangClient:
    """JSON over HTTP to one server; every failure is one line naming address, endpoint and reply."""

    def __init__(self, address: str, *, api_key: str | None = None, timeout: float = 600.0):
        import httpx

        self.address = address
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(
            base_url=f"http://{address}", headers=headers, timeout=httpx.Timeout(timeout, connect=10.0)
        )

    def call(self, method: str, endpoint: str, body: dict | None = None, *, timeout: float | None = None) -> Any:
        import httpx

        kw: dict[str, Any] = {}
        if timeout is not None:
            kw["timeout"] = timeout
        try:
            resp = self.http.request(method, endpoint, json=body, **kw)
        except httpx.HTTPError as e:
            raise EngineDiedError(
                f"engine {self.address}: {method} {endpoint} failed: {type(e).__name__}: {e}".strip()
            ) from None
        if resp.status_code != 200:
            raise EngineReplyError(
                f"engine {self.address}: {method} {endpoint} answered {resp.status_code}: {short(resp.text)}"
            )
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            if endpoint in ("/health", "/flush_cache"):  # SGLang answers these with an empty or plain body
                return None
            raise EngineReplyError(
                f"engine {self.address}: {method} {endpoint} answered 200 with non-JSON: {short(resp.text)}"
            ) from None

    def get(self, endpoint: str, **kw: Any) -> Any:
        return self.call("GET", endpoint, **kw)

    def post(self, endpoint: str, body: dict | None = None, **kw: Any) -> Any:
        return self.call("POST", endpoint, body or {}, **kw)

    def close(self) -> None:
        self.http.close()


def short(text: str, limit: int = 200) -> str:
    one = " ".join(str(text).split())
    return one if len(one) <= limit else one[:limit] + "..."


def parse_version(value: Any) -> int:
    """SGLang's ``weight_version`` is a string ("default" before any update); tidal's are integers."""
    try:
        return int(str(value))
    except ValueError:
        return -1


def sampling_body(sampling: SamplingParams) -> dict:
    """SGLang's ``sampling_params`` for tidal's sampling settings (top_k 0 -> -1: disabled)."""
    return {
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k) if sampling.top_k > 0 else -1,
        "max_new_tokens": int(sampling.max_new_tokens),
        "stop": list(sampling.stop),
        "stop_token_ids": list(sampling.stop_token_ids),
        "no_stop_trim": True,  # the stop string stays in the response, as the embedded engine keeps it
        "skip_special_tokens": True,
    }


def fill_sample(sample: Sample, out: dict, where: str, fallback_version: int) -> bool:
    """Copy one ``/generate`` result into ``sample``; False when the server aborted the request."""
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
        raise EngineReplyError(
            f"{where}: a result without meta_info.output_token_logprobs ({short(str(out))}); the server must answer return_logprob"
        )
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind == "abort":
        return False
    if kind not in _STATUS:
        raise EngineReplyError(f"{where}: finish_reason {reason!r} is not stop, length or abort")
    pairs = meta["output_token_logprobs"]
    ids = out.get("output_ids")
    ids = [int(p[1]) for p in pairs] if ids is None else [int(t) for t in ids]
    if len(pairs) != len(ids) or any(int(p[1]) != t for p, t in zip(pairs, ids)):
        raise EngineReplyError(
            f"{where}: {len(ids)} output_ids but {len(pairs)} output_token_logprobs that do not name the same tokens"
        )
    sample.response_ids = ids
    sample.response_logprobs = [float(p[0]) for p in pairs]
    sample.response_text = str(out.get("text", ""))
    sample.status = _STATUS[kind]
    version = meta.get("weight_version")
    sample.weight_version = parse_version(version) if version is not None else fallback_version
    return True


def append_output(sample: Sample, out: dict, where: str, fallback_version: int, max_new_tokens: int) -> None:
    """``--partial-rollout``: append one ``/generate`` result to ``sample``'s response so far (the request
    continued it from prompt + response), recording each new token's weight version.

    An aborted request (SGLang's ``/abort_request`` or ``/pause_generation`` in ``abort`` mode) carries
    the tokens and log-probs it had (a request aborted while queued has none, possibly without
    ``output_token_logprobs``): the sample stays ``aborted``, to be continued by a later call. The server
    matches stop strings within the piece it generated only: ``cut_at_stop`` finds one spanning pieces."""
    meta = out.get("meta_info") if isinstance(out, dict) else None
    reason = (meta or {}).get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if not isinstance(meta, dict) or ("output_token_logprobs" not in meta and kind != "abort"):
        raise EngineReplyError(
            f"{where}: a result without meta_info.output_token_logprobs ({short(str(out))}); the server must answer return_logprob"
        )
    if kind not in (*_STATUS, "abort"):
        raise EngineReplyError(f"{where}: finish_reason {reason!r} is not stop, length or abort")
    pairs = meta.get("output_token_logprobs") or []
    ids = out.get("output_ids")
    ids = [int(p[1]) for p in pairs] if ids is None else [int(t) for t in ids]
    if len(pairs) != len(ids) or any(int(p[1]) != t for p, t in zip(pairs, ids)):
        raise EngineReplyError(
            f"{where}: {len(ids)} output_ids but {len(pairs)} output_token_logprobs that do not name the same tokens"
        )
    version = parse_version(meta["weight_version"]) if meta.get("weight_version") is not None else fallback_version
    if not sample.response_ids:
        sample.weight_version = version
    versions = sample.token_versions + [version] * len(ids)
    sample.response_ids = list(sample.response_ids) + ids
    sample.response_logprobs = list(sample.response_logprobs) + [float(p[0]) for p in pairs]
    sample.response_text += str(out.get("text", "") or "")
    sample.response_versions = versions if len(set(versions)) > 1 else []
    if kind == "abort":
        sample.status = "truncated" if len(sample.response_ids) >= max_new_tokens else "aborted"
    else:
        sample.status = _STATUS[kind]


def cut_at_stop(sample: Sample, stop: list[str], tokenizer) -> None:
    """``--partial-rollout``: cut a response made of two or more pieces after the first stop string in its whole
    text, as one uninterrupted request would have been cut.

    A server matches stop strings in the text of the request it is running, and a continuation's request
    starts where the pause cut the response: a stop string whose first part came before the pause is not
    found there, and the server generates on past it. Here the whole response is decoded (the model's
    tokenizer, as the server decodes) and cut after the token that completed the first stop string: the
    shortest prefix whose text holds one (``stop_prefix_len``, the embedded engine's rule too). The string
    stays in the response (SGLang's ``no_stop_trim``); the sample is then ``completed``, its log-probs and
    per-token versions cut with it. A response without a stop string is left as it is."""
    from tidal.rollout.generate import decode_ids, stop_prefix_len  # torch and transformers: the tokenizer needs them

    ids = list(sample.response_ids)
    k = stop_prefix_len(ids, stop, tokenizer)
    if k is None:
        return
    versions = sample.token_versions[:k]
    sample.response_ids, sample.response_logprobs = ids[:k], list(sample.response_logprobs[:k])
    sample.response_text = decode_ids(tokenizer, ids[:k])
    sample.status = "completed"
    sample.response_versions = versions if len(set(versions)) > 1 else []


def serialize_named_tensors(named: list) -> str:
    """SGLang's ``MultiprocessingSerializer`` wire form: torch ``ForkingPickler`` bytes, base64.

    CPU tensors travel as shared-memory file names (the ``file_system`` sharing strategy: a
    receiver in another, unrelated process can open them), CUDA tensors as IPC handles. The tensors
    must stay alive until the server answered.
    """
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    tmp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")
