"""A small server written from SGLang's documented HTTP protocol, independent of tidal (no tidal import).

Tests point tidal's HTTP engine at it to check that tidal speaks the protocol as SGLang defines it
(``python/sglang/srt/managers/io_struct.py`` and ``entrypoints/http_server.py``): the request fields
and response shapes of ``/generate``, the weight-update endpoints (``MultiprocessingSerializer`` =
torch ``ForkingPickler`` bytes, base64; ``flattened_bucket`` = every tensor's bytes back to back,
broadcast from rank 0 of a group whose store prefix is ``"<group_name>/"``), memory, version,
health. It holds weights by name and generates a deterministic toy sequence (it is not a model).

Run: ``python sglang_like_server.py --port P [--die-on-generate K] [--tidal-extras] [--api-key KEY]``.
``--die-on-generate K`` exits the process on the K-th /generate request, before answering (an engine
that dies mid-run); ``--hang-on-generate K[,K2...]`` makes it answer nothing, ``/health`` included, for
``--hang-seconds`` from the K-th request on, then answer again (an engine that stops answering for a
while). ``--tidal-extras`` adds ``GET /weight_checksums`` and ``POST /randomize_weights``
(xxh3-128 of each tensor's bytes; what ``tidal serve`` offers for ``--check-weight-update-equal``).
``POST /abort_request`` (``abort_all`` or a ``rid``) stops the requests running at their next token,
each answered with the tokens it has and finish reason ``abort``; ``POST /toy_pace`` and
``GET /generate_bodies`` are the tests' own (seconds per token, and every N-th request from then on
waiting after its first token until an abort; the /generate bodies received).
"""

from __future__ import annotations

import argparse
import base64
import glob
import os
import threading
import time
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import uvicorn
import xxhash
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse

VOCAB = 64


def build_app(args) -> FastAPI:
    app = FastAPI()
    state = {"version": "default", "weights": {}, "released": set(), "generates": 0, "groups": {}, "group_calls": []}
    # /abort_request: every request running when an abort comes stops at its next token (``aborts`` counts them);
    # ``token_seconds`` (POST /toy_pace, the tests' own) makes each token take that long, so one can be caught.
    # ``hold_every`` N (also /toy_pace): every N-th /generate from then on waits after its first token until an abort.
    state.update(aborts=0, token_seconds=0.0, generate_bodies=[], tokens=0, hold_every=0, paced=0)
    lock = threading.Lock()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if args.api_key and request.headers.get("authorization") != f"Bearer {args.api_key}":
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    def health():
        if state.get("hung"):
            time.sleep(args.hang_seconds + 5)  # asked during the hang: never answered in time
        return PlainTextResponse("")

    @app.get("/model_info")
    def model_info():
        return {"model_path": "sglang-like", "is_generation": True, "weight_version": state["version"]}

    @app.post("/generate")
    def generate(body: dict):
        state["generates"] += 1
        if args.die_on_generate and state["generates"] == args.die_on_generate:
            os._exit(17)
        if state["generates"] in args.hang_on_generate:
            state["hung"] = True  # answers nothing (not even /health) for a while
            time.sleep(args.hang_seconds)
            state["hung"] = False
        if state["released"]:
            raise HTTPException(400, f"memory released: {sorted(state['released'])}")
        state["generate_bodies"].append(body)
        ids = body["input_ids"]
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(prompts)
        epoch = state["aborts"]
        state["paced"] += 1
        hold = bool(state["hold_every"]) and state["paced"] % state["hold_every"] == 0
        made = [0]

        def aborted() -> bool:
            if state["token_seconds"]:
                time.sleep(state["token_seconds"])
            deadline = time.monotonic() + 60
            while hold and made[0] == 1 and state["aborts"] == epoch and time.monotonic() < deadline:
                time.sleep(0.01)
            if state["aborts"] != epoch:
                return True
            state["tokens"] += 1
            made[0] += 1
            return False

        logprob = bool(body.get("return_logprob"))
        out = [_one(p, sp, logprob, state["version"], aborted) for p, sp in zip(prompts, params)]
        return out if batched else out[0]

    @app.post("/abort_request")
    def abort(body: dict):
        if not body.get("abort_all") and not body.get("rid"):
            return JSONResponse({"error": "give rid or abort_all"}, status_code=400)
        state["aborts"] += 1
        return {}

    @app.post("/toy_pace")
    def pace(body: dict):
        """For the tests (not SGLang's): seconds each generated token takes."""
        state["token_seconds"] = float(body.get("token_seconds", 0.0))
        state["hold_every"], state["paced"] = int(body.get("hold_every", 0)), 0
        return {}

    @app.get("/generate_bodies")
    def generate_bodies():
        """For the tests (not SGLang's): every /generate body received, in order, and tokens generated so far."""
        return {"bodies": state["generate_bodies"], "tokens": state["tokens"]}

    @app.post("/release_memory_occupation")
    def release(body: dict):
        state["released"] |= set(body.get("tags") or ["weights", "kv_cache"])
        return {}

    @app.post("/resume_memory_occupation")
    def resume(body: dict):
        state["released"] -= set(body.get("tags") or ["weights", "kv_cache"])
        return {}

    @app.post("/flush_cache")
    def flush():
        return PlainTextResponse("Cache flushed.")

    @app.post("/pause_generation")
    def pause(body: dict):
        return {}

    @app.post("/continue_generation")
    def cont(body: dict):
        return {}

    def set_version(v):
        if v is not None:
            state["version"] = str(v)

    @app.post("/update_weights_from_disk")
    def from_disk(body: dict):
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(body["model_path"], "*.safetensors")))
        if not files:
            return {"success": False, "message": f"no safetensors in {body['model_path']}"}
        for f in files:
            state["weights"].update(load_file(f))
        set_version(body.get("weight_version"))
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    @app.post("/update_weights_from_tensor")
    def from_tensor(body: dict):
        if "weights" in state["released"]:
            return {"success": False, "message": "weights are released"}
        named = ForkingPickler.loads(base64.b64decode(body["serialized_named_tensors"][0]))
        with lock:
            for name, t in named:
                state["weights"][name] = t.detach().clone()
        set_version(body.get("weight_version"))
        return {"success": True, "message": "Succeeded to update model weights."}

    @app.post("/init_weights_update_group")
    def init_group(body: dict):
        timeout = timedelta(seconds=120)
        store = dist.TCPStore(body["master_address"], body["master_port"], is_master=False, timeout=timeout)
        # torch's custom-group layout (as SGLang's init_custom_process_group gets it): group, then device.
        prefixed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{body['group_name']}/", store))
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=body["master_address"])]
        pg = dist.ProcessGroupGloo(prefixed, body["rank_offset"], body["world_size"], opts)
        state["groups"][body["group_name"]] = (pg, store)
        state["group_calls"].append(["init", body["group_name"], body["master_port"]])
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/destroy_weights_update_group")
    def destroy_group(body: dict):
        if state["groups"].pop(body["group_name"], None) is None:
            return JSONResponse({"success": False, "message": f"no group {body['group_name']}"}, status_code=400)
        state["group_calls"].append(["destroy", body["group_name"]])
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.get("/group_calls")
    def group_calls():
        """For the tests (not SGLang's): every group joined and left, in order."""
        return state["group_calls"]

    @app.post("/update_weights_from_distributed")
    def from_distributed(body: dict):
        pg, _ = state["groups"][body["group_name"]]
        shapes = [tuple(s) for s in body["shapes"]]
        dtypes = [getattr(torch, d) for d in body["dtypes"]]
        if body.get("load_format") == "flattened_bucket":
            sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, dtypes)]
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
            pg.broadcast(flat, 0).wait()
            parts, off = [], 0
            for n in sizes:
                parts.append(flat[off : off + n])
                off += n
            tensors = [p.view(d).view(s).clone() for p, d, s in zip(parts, dtypes, shapes)]
        else:
            tensors = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes)]
            for t in tensors:
                pg.broadcast(t, 0).wait()
        state["weights"].update(zip(body["names"], tensors))
        set_version(body.get("weight_version"))
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/update_weight_version")
    def update_version(body: dict):
        set_version(body["new_version"])
        return {"success": True, "message": "ok"}

    if args.tidal_extras:

        @app.get("/weight_checksums")
        def checksums():
            sums = {
                n: xxhash.xxh3_128_hexdigest(t.contiguous().view(-1).view(torch.uint8).numpy())
                for n, t in state["weights"].items()
            }
            return {"weight_version": state["version"], "checksums": sums}

        @app.post("/randomize_weights")
        def randomize(body: dict):
            g = torch.Generator().manual_seed(int(body["seed"]))
            for n, t in state["weights"].items():
                state["weights"][n] = torch.randn(t.shape, generator=g).to(t.dtype)
            return {}

    return app


def _one(prompt: list[int], sp: dict, logprob: bool, version: str, aborted=lambda: False) -> dict:
    """A deterministic toy continuation: token k is (sum(prompt) + 7k) mod VOCAB. A request aborted part-way
    ends with what it has and finish reason ``abort`` (SGLang answers an aborted request so, log-probs and
    weight version included)."""
    stop_ids = set(sp.get("stop_token_ids") or [])
    out, reason = [], {"type": "length", "length": sp.get("max_new_tokens", 16)}
    for k in range(int(sp.get("max_new_tokens", 16))):
        if aborted():
            reason = {"type": "abort", "message": "Abort in running batch"}
            break
        tok = (sum(prompt) + 7 * k) % VOCAB
        out.append(tok)
        if tok in stop_ids:
            reason = {"type": "stop", "matched": tok}
            break
    meta = {
        "id": "0",
        "finish_reason": reason,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(out),
        "weight_version": version,
    }
    if logprob:
        meta["output_token_logprobs"] = [[-0.1 * (1 + t % 5), t, None] for t in out]
    return {"text": " ".join(map(str, out)), "output_ids": out, "meta_info": meta}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--die-on-generate", type=int, default=0)
    p.add_argument("--hang-on-generate", type=lambda v: {int(k) for k in v.split(",")}, default=set())
    p.add_argument("--hang-seconds", type=float, default=10.0)
    p.add_argument("--tidal-extras", action="store_true")
    p.add_argument("--api-key", default=None)
    args = p.parse_args()
    uvicorn.run(build_app(args), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
