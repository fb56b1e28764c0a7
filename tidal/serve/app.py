"""The FastAPI app of ``tidal serve``: SGLang's native endpoints over one embedded engine.

Every engine call goes through ``EngineWorker`` (one thread, a queue, concurrent generates batched
into shared engine steps). Replies keep SGLang's shapes: a failed request answers 400 with
``{"error": {"message": ...}}`` (a malformed body: SGLang's ``ErrorResponse``, ``{"object":
"error", "message", "type", "param", "code"}``), weight endpoints answer ``{"success", "message"}``.

``--api-key``: every endpoint, ``/health`` included, needs ``Authorization: Bearer <key>``; a missing
or wrong key answers 401 ``{"error": "Unauthorized"}`` as SGLang does (SGLang leaves ``/health``
open; here nothing is). Without a key the server is open, and it binds 127.0.0.1 unless
``--host`` says otherwise.

Size: a little over 500 lines, so that every SGLang route and its reply shape are in one place (the
generate path, the OpenAI routes and the weight appliers are their own modules).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import secrets
import time
from collections import deque
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from tidal.errors import ResidencyError, UserError, WeightSyncError
from tidal.rollout.engine import TAGS
from tidal.serve.batcher import EngineWorker
from tidal.serve.generate import GenerateHandler, RequestTiming
from tidal.serve.protocol import (
    AbortReqInput,
    DestroyWeightsUpdateGroupReqInput,
    GenerateReqInput,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    MemoryTagsReqInput,
    PauseGenerationReqInput,
    PullWeightsReqInput,
    RandomizeWeightsReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)
from tidal.serve.weights import WeightApplier

try:
    import orjson
except ImportError:  # optional (the serve extra): json renders the same bytes, slower
    orjson = None

log = logging.getLogger(__name__)


class ServerState:
    """The engine, its worker thread, the weight applier and the served weight version (a string, as in SGLang)."""

    def __init__(
        self, engine, *, model_path: str, served_model_name: str, api_key: str | None, batch_wait_s: float = 0.05
    ) -> None:
        self.engine = engine
        self.worker = EngineWorker(
            engine, max_rows=engine.max_rows * 4, fill_rows=engine.rollout.rollout_max_batch, wait_s=batch_wait_s
        )
        self.applier = WeightApplier(engine)
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.weight_version = str(engine.get_weight_version())
        self.end_ids = [engine.tokenizer.eos_token_id] if engine.tokenizer.eos_token_id is not None else []
        self.vocab_size: int = engine.model.config.get_text_config().vocab_size  # read once: a slow attribute
        self.started = time.time()
        self.timings: deque[RequestTiming] = deque(maxlen=8192)  # of the latest /generate requests

    def set_version(self, version: str | int | None) -> None:
        if version is None:
            return
        self.weight_version = str(version)
        try:
            self.engine.set_weight_version(int(self.weight_version))
        except ValueError:
            pass  # a label that is not a number: the engine keeps counting its own version


class _ApiKey:
    """ASGI middleware: ``Authorization: Bearer <key>`` on every request (constant-time compare)."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Errors a request can cause (bad input, an engine in the wrong memory state, a refused update): 400.
_REQUEST_ERRORS = (UserError, ResidencyError, WeightSyncError)


def _error(e: BaseException, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": str(e)}}, status_code=status)


def _invalid_body(path: str, errors) -> JSONResponse:
    """SGLang's ``ErrorResponse`` for a body that does not parse or validate; the message names the field."""
    parts = [f"{'.'.join(str(x) for x in e['loc'] if x != 'body') or 'body'}: {e['msg']}" for e in errors]
    message = f"{path}: bad request body: " + "; ".join(parts[:3])
    err = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return JSONResponse(err, status_code=400)


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes, as Starlette's ``JSONResponse`` renders them (no NaN or infinity). With
    ``orjson`` installed (the ``serve`` extra) it renders them, several times faster than ``json``."""
    if orjson is not None:
        return orjson.dumps(obj)  # NaN and infinity become null there; log-probs of sampled tokens are finite
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _ok(message: str, **extra: Any) -> dict:
    return {"success": True, "message": message, **extra}


def _fail(e: BaseException) -> JSONResponse:
    return JSONResponse({"success": False, "message": str(e)}, status_code=400)


class _GeneratePath:
    """ASGI: ``/generate`` straight to its handler, past Starlette's stack (its middleware layers, an exit
    stack per request, matching some forty routes); every other path goes on to the FastAPI app.

    It is the hot path, one call per sample when a rollout sends one request each: the body is parsed
    and validated in one pass by pydantic-core (FastAPI's own body handling decodes the JSON in Python
    first), and the reply, plain JSON values already, is rendered to bytes directly (no
    ``jsonable_encoder`` walk over every log-prob triple)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state
        self.handler = GenerateHandler(state)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/generate":
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("POST", "PUT"):
            await JSONResponse({"detail": "Method Not Allowed"}, status_code=405)(scope, receive, send)
            return
        timing = RequestTiming(rid="", arrived=time.monotonic())
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        status, body = await self._reply(b"".join(chunks), timing)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _reply(self, raw: bytes, timing: RequestTiming) -> tuple[int, bytes]:
        try:
            req = GenerateReqInput.model_validate_json(raw)
        except ValidationError as e:
            bad = _invalid_body("/generate", e.errors())
            return bad.status_code, bad.body
        try:
            out = await self.handler(req, timing)
        except _REQUEST_ERRORS as e:
            return 400, dumps({"error": {"message": str(e)}})
        except Exception as e:  # noqa: BLE001 - one line to the client, the traceback to the log
            log.exception("/generate failed")
            return 500, dumps({"error": {"message": f"/generate: internal error: {type(e).__name__}: {e}"}})
        body = dumps(out)
        timing.rendered = time.monotonic()
        self.state.timings.append(timing)
        return 200, body


def build_app(state: ServerState):
    """The ASGI app uvicorn serves: the key check, then ``/generate``'s own path, then FastAPI's routes."""
    app = _GeneratePath(_fastapi_app(state), state)
    return _ApiKey(app, key=state.api_key) if state.api_key else app


def _fastapi_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="tidal serve", openapi_url=None)
    app.state.tidal = state
    _error_handlers(app)
    _generate_routes(app, state)
    _memory_routes(app, state)
    _weight_update_routes(app, state)
    _weight_read_routes(app, state)
    _group_routes(app, state)
    from tidal.serve.openai_api import add_openai_routes

    add_openai_routes(app, state)
    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _invalid_body(request.url.path, exc.errors())

    async def _request_error(request: Request, exc: Exception):
        return _error(exc)

    for kind in _REQUEST_ERRORS:
        app.add_exception_handler(kind, _request_error)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("%s failed", request.url.path)
        return _error(RuntimeError(f"{request.url.path}: internal error: {type(exc).__name__}: {exc}"), 500)


def _generate_routes(app: FastAPI, state: ServerState) -> None:
    """Everything of the generate side but ``/generate`` itself (``_GeneratePath``)."""

    @app.get("/request_timings")
    async def request_timings():
        """tidal extension: where the most recent ``/generate`` requests spent their time (``RequestTiming``)."""
        return Response(dumps({"requests": [vars(t) for t in state.timings]}), media_type="application/json")

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        tok = state.engine.tokenizer
        first = tok.bos_token_id if tok.bos_token_id is not None else 0
        from tidal.rollout.types import SamplingParams

        try:
            await state.worker.generate([[first]], SamplingParams(temperature=0.0, max_new_tokens=1))
        except (*_REQUEST_ERRORS, RuntimeError) as e:
            return _error(e, 503)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        eng = state.engine
        return {
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.weight_version,
            "served_model_name": state.served_model_name,
            "dtype": str(eng.dtype).removeprefix("torch."),
            "device": str(eng.device),
            "max_context_length": getattr(eng.model.config.get_text_config(), "max_position_embeddings", None),
            "residency": eng.residency.state.value,
        }

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": state.weight_version}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        w = state.worker
        recent = [dataclasses.asdict(s) for s in w.recent]
        return {
            "model_path": state.model_path,
            "served_model_name": state.served_model_name,
            "weight_version": state.weight_version,
            "version": "tidal",
            "internal_states": [
                {
                    "engine_steps": w.steps,
                    "queued": w.queued(),
                    "running_rows": w.running_rows(),
                    "paused": w.paused,
                    "gc_enabled": gc.isenabled(),  # off only during a step and its replies' rendering
                    "recent_steps": recent,
                }
            ],
        }


def _tags(req: MemoryTagsReqInput | None) -> list[str]:
    tags = list(TAGS) if req is None or req.tags is None else list(req.tags)
    unknown = [t for t in tags if t not in TAGS]
    if unknown or not tags:
        raise UserError(f"tags {tags}: tidal's engine has the tags {list(TAGS)} (none given = all)")
    return tags


def _memory_routes(app: FastAPI, state: ServerState) -> None:
    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release(req: MemoryTagsReqInput | None = None):
        tags = _tags(req)
        try:
            report = await state.worker.call(lambda: state.engine.release_memory(tags))
        except (ResidencyError, ValueError) as e:
            return _error(e)
        return _ok(f"released {tags}", **report)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume(req: MemoryTagsReqInput | None = None):
        tags = _tags(req)

        def run():
            out = state.engine.resume_memory(tags)
            if "weights" in tags:
                state.applier.weights_resumed()
            return out

        try:
            report = await state.worker.call(run)
        except (ResidencyError, ValueError) as e:
            return _error(e)
        return _ok(f"resumed {tags}", **report)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        await state.worker.call(state.engine.flush_cache)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/pause_generation")
    async def pause(req: PauseGenerationReqInput | None = None):
        mode = req.mode if req is not None else "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise UserError(f"mode {mode!r}: use abort, retract or in_place")
        aborted = await state.worker.pause(mode)  # once no engine step runs, as SGLang answers
        return {"message": "Generation paused successfully.", "status": "ok", "num_aborted_requests": aborted}

    @app.post("/continue_generation")
    async def resume_generation():
        state.worker.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(req: AbortReqInput):
        if not req.abort_all:
            raise UserError("tidal serve aborts all requests only: send abort_all: true")
        held = state.worker.paused
        aborted = await state.worker.pause("abort")  # once the running step ended, its requests answered
        if not held:  # later requests are not held (a server paused before stays paused)
            state.worker.resume()
        return {"message": "Requests aborted.", "status": "ok", "num_aborted_requests": aborted}


async def _apply(state: ServerState, fn, version, what: str):
    """Run a weight update on the engine thread; adopt ``version`` only when it succeeded."""
    try:
        nbytes = await state.worker.call(fn)
    except (UserError, WeightSyncError, ResidencyError) as e:
        return _fail(e)
    state.set_version(version)
    msg = f"{what}: {nbytes} bytes applied." + (f" Weight version updated to {version}." if version is not None else "")
    return _ok(msg, num_paused_requests=0)


def _weight_update_routes(app: FastAPI, state: ServerState) -> None:
    """The endpoints that change the served weights or their version: from a folder, from tensors, pulled."""
    from tidal.serve import weights as w

    @app.post("/update_weights_from_disk")
    async def from_disk(req: UpdateWeightFromDiskReqInput):
        if w.is_tidal_folder(req.model_path):
            version = req.weight_version

            def run():
                try:
                    v = int(version) if version is not None else state.engine.get_weight_version()
                except ValueError:
                    v = state.engine.get_weight_version()  # a label: the engine keeps counting its own
                return state.engine.update_weights_from_disk(req.model_path, v)["bytes"]

            return await _apply(state, run, req.weight_version, "update_weights_from_disk")
        return await _apply(
            state, lambda: state.applier.load_folder(req.model_path), req.weight_version, "update_weights_from_disk"
        )

    @app.post("/update_weights_from_tensor")
    async def from_tensor(req: UpdateWeightsFromTensorReqInput):
        def run():
            pairs = w.named_tensors_from_payload(req.serialized_named_tensors, req.load_format)
            return state.applier.apply(pairs, req.checksums, req.tidal_checksum)

        return await _apply(state, run, req.weight_version, "update_weights_from_tensor")

    @app.post("/update_weight_version")
    async def update_weight_version(req: UpdateWeightVersionReqInput):
        await state.worker.call(lambda: None)  # after every request already queued
        state.set_version(req.new_version)
        return _ok(f"Weight version updated to {req.new_version}", new_version=str(req.new_version))

    @app.post("/pull_weights")
    async def pull_weights(req: PullWeightsReqInput):
        """slime's endpoint: bring ``local_checkpoint_dir`` up to ``target_version`` from the versions published
        under ``source_dir`` (verified); the engine's weights change only with the next update_weights_from_disk."""
        pull = getattr(state.engine, "pull_weights", None)
        if pull is None:
            return _fail(
                UserError("this engine has no pull_weights; use /update_weights_from_disk with the version folder")
            )
        if req.local_checkpoint_dir is None or req.target_version is None:
            raise UserError("pull_weights needs local_checkpoint_dir and target_version")
        try:
            target = int(req.target_version)
        except ValueError:
            raise UserError(f"target_version {req.target_version!r}: an integer version") from None

        def run():
            return pull(local_checkpoint_dir=req.local_checkpoint_dir, source_dir=req.source_dir, target_version=target)

        try:
            result = await state.worker.call(run)
        except (UserError, WeightSyncError, ResidencyError) as e:
            return _fail(e)
        return _ok(getattr(result, "message", f"pulled version {target}"), version=getattr(result, "version", target))


def _weight_read_routes(app: FastAPI, state: ServerState) -> None:
    """The endpoints that read or perturb the served weights in place: by name, checksums, seeded noise."""

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(req: GetWeightsByNameReqInput):
        p = state.applier.params.get(req.name)
        if p is None:
            raise UserError(f"weight {req.name!r} is not a parameter of the served model")

        def read():
            state.engine.residency.require_sync()
            return p.detach()[: req.truncate_size].float().cpu().tolist()

        return await state.worker.call(read)

    @app.get("/weight_checksums")
    async def weight_checksums():
        """tidal extension: name -> xxh3-128 of each parameter's bytes (tied weights once)."""
        return {
            "weight_version": state.weight_version,
            "checksums": await state.worker.call(state.engine.weight_checksums),
        }

    @app.post("/randomize_weights")
    async def randomize_weights(req: RandomizeWeightsReqInput):
        """tidal extension (``--check-weight-update-equal``): seeded noise in every weight; a missed tensor shows."""
        await state.worker.call(lambda: state.engine.randomize_weights(req.seed))
        return _ok(f"weights randomized with seed {req.seed}")


def _group_routes(app: FastAPI, state: ServerState) -> None:
    from tidal.serve import weights as w

    @app.post("/init_weights_update_group")
    async def init_group(req: InitWeightsUpdateGroupReqInput):
        if req.backend not in ("gloo", "nccl"):
            raise UserError(f"backend {req.backend!r}: use gloo (CPU) or nccl (GPU)")
        if req.backend == "nccl" and state.engine.device.type != "cuda":
            raise UserError("backend nccl needs a CUDA engine; this server runs on CPU: use gloo")

        def run():
            from tidal.weight_sync.group import make_group

            where = (req.master_address, req.master_port, req.rank_offset, req.world_size, req.backend)
            pg, _ = make_group(None, *where, sglang_name=req.group_name)
            state.applier.groups[req.group_name] = pg

        try:
            # Not through the engine queue: forming the group waits for the trainer, generation may go on.
            import asyncio

            await asyncio.to_thread(run)
        except Exception as e:  # noqa: BLE001 - a failed rendezvous is the caller's to see
            return _fail(
                RuntimeError(f"could not join group {req.group_name!r} at {req.master_address}:{req.master_port}: {e}")
            )
        return _ok(f"joined group {req.group_name} as rank {req.rank_offset} of {req.world_size}")

    @app.post("/update_weights_from_distributed")
    async def from_distributed(req: UpdateWeightsFromDistributedReqInput):
        pg = state.applier.groups.get(req.group_name)
        if pg is None:
            raise UserError(f"no weight update group {req.group_name!r}; call /init_weights_update_group first")
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            raise UserError(
                f"names, dtypes and shapes differ in length ({len(req.names)}, {len(req.dtypes)}, {len(req.shapes)})"
            )
        if req.load_format not in (None, "direct", "flattened_bucket"):
            raise UserError(f"load_format {req.load_format!r}: use null, direct or flattened_bucket")
        dtypes = [w.dtype_of(d) for d in req.dtypes]

        def run():
            dev = state.engine.device if type(pg).__name__ == "ProcessGroupNCCL" else None
            pairs, buf = w.receive_broadcast(
                pg, req.names, dtypes, req.shapes, dev, flat=req.load_format == "flattened_bucket"
            )
            return state.applier.apply(pairs, req.checksums, req.tidal_checksum, buf)

        return await _apply(state, run, req.weight_version, "update_weights_from_distributed")

    @app.post("/destroy_weights_update_group")
    async def destroy_group(req: DestroyWeightsUpdateGroupReqInput):
        pg = state.applier.groups.pop(req.group_name, None)
        if pg is None:
            return _fail(UserError(f"no weight update group {req.group_name!r}"))
        del pg
        return _ok(f"destroyed group {req.group_name}")
