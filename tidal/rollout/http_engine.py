"""The HTTP engine: a rollout engine that is a client of a server speaking SGLang's HTTP protocol.

``HttpEngineActor`` implements ``tidal.rollout.engine.RolloutEngine`` as a small Ray actor that
talks to one server (``tidal serve``, or SGLang's own ``python -m sglang.launch_server``) through
``SglangClient`` (httpx; it and the field mappings are ``tidal.rollout.sglang_client``). The server is either given (``--rollout-external-engine-addrs``) or
started by the actor itself in its placement-group bundle (``tidal.rollout.server.ServerProcess``),
so a started server gets the bundle's device exactly as an embedded engine would.

Calls map one to one onto SGLang's endpoints (``docs/engines.md`` has the table):

    generate                      POST /generate (input_ids, sampling_params, return_logprob)
    release/resume_memory         POST /release_memory_occupation, /resume_memory_occupation {tags}
    update_weights_from_disk      POST /update_weights_from_disk {model_path, weight_version}
    update_weights_from_tensor    POST /update_weights_from_tensor {serialized_named_tensors: [base64
                                  of torch ForkingPickler bytes of [(name, tensor), ...]]}
    init_weights_update_group     POST /init_weights_update_group {master_address, master_port, ...}
    update_weights_from_distributed  POST /update_weights_from_distributed {names, dtypes, shapes,
                                  load_format: flattened_bucket}, while the trainer broadcasts
    get_weight_version / health   GET /model_info, GET /health
    flush_cache                   POST /flush_cache
    pause/continue_generation     POST /pause_generation {mode: abort}, /continue_generation; with
                                  --partial-rollout POST /abort_request {abort_all: true} (slime's), again
                                  while the generate request is still out, and no new request until
                                  continue_generation (nothing to send then: the server was never paused)
    pull_weights                  POST /pull_weights (slime's; delta over disk)

``--partial-rollout``: ``pause_generation`` answers beside a running ``generate`` (the ``probe``
concurrency group). The server aborts the requests in flight; each returns ``finish_reason`` abort
with the tokens and log-probs it had, and those samples come back ``aborted``. A later call sends
them again as ``input_ids`` = prompt + response so far with ``max_new_tokens`` = what is left, and
appends what comes back (each token's ``weight_version`` recorded), as slime's rollout does. The
server matches stop strings in the continuation alone, so the whole response is then cut at the
first stop string in its text (``cut_at_stop``): one that spans the pause ends the response where it
would have ended without the pause. Abort, not ``/pause_generation``: SGLang's pause holds requests that arrive after it until
``/continue_generation``, and a request already on its way when the pause lands would then hold the
call (and the sync waiting for it) for good; an abort never holds one, and is sent again until the
call returned.

Verification: every bucket's checksum is checked when it reaches this actor (tensor transport), and
each tensor's xxh3-128 travels along as ``checksums`` (name -> hex), which ``tidal serve`` checks
before applying anything and other servers ignore; after the last bucket ``/model_info`` must
report the new ``weight_version``. An update that fails part-way leaves the engine marked stale: it refuses to
generate until a full version has been applied, so a half-updated engine never samples.

Errors: a server that cannot be reached mid-run raises ``EngineDiedError`` (the driver restarts or
reconnects it); an unreachable address at start, a server that does not speak the protocol or a
non-200 reply is one ``UserError`` line naming the address, the endpoint and the reply.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

from tidal.errors import EngineDiedError, UserError, WeightSyncError
from tidal.rollout.engine import (
    TAGS,
    BucketHeader,
    EngineHealth,
    MemoryReport,
    RolloutEngine,
    WeightUpdateResult,
)
from tidal.rollout.sglang_client import (
    EngineReplyError,
    SglangClient,
    append_output,
    cut_at_stop,
    fill_sample,
    parse_version,
    sampling_body,
    serialize_named_tensors,
    short,
)
from tidal.rollout.types import DecodeStats, Sample, SamplingParams
from tidal.weight_sync.group import SGLANG_GROUP

log = logging.getLogger(__name__)


class HttpEngineActor(RolloutEngine):
    """One HTTP engine (a Ray actor): ``address`` of an external server, or None to start one here."""

    def __init__(self, engine_rank: int, *, address: str | None = None, **sections: Any) -> None:
        """``sections``: ``RolloutEngine``'s keyword arguments (model, rollout, memory, weight_sync, device, seed)."""
        super().__init__(engine_rank, **sections)
        self.external = address
        self.address = address or ""
        self.server = None
        self.client: SglangClient | None = None
        self._version = -1
        self._stale = False  # a weight update failed part-way: refuse to generate until a full version landed
        self._residency = "AWAKE"
        # --partial-rollout: pause_generation (probe thread) and generate (the call's thread) meet here.
        self._cv = threading.Condition()
        self._pausing = False  # asked to pause: no request is sent until continue_generation
        self._posting = False  # a /generate request is out
        self._tokenizer = None  # the model's, loaded when a stop string may span a pause (cut_at_stop)

    # ------------------------------------------------------------------ lifecycle

    def init(self) -> dict:
        """Start the server (unless external), wait for /health and check it speaks SGLang's protocol."""
        if self.external is None:
            from tidal.rollout.server import ServerProcess

            self.server = ServerProcess(
                self.engine_rank,
                self.model_cfg,
                self.rollout_cfg,
                self.memory_cfg,
                self.weight_sync_cfg,
                device=self.device,
                seed=self.seed,
            )
            self.address = self.server.start(self.rollout_cfg.engine_start_timeout)
        self.client = SglangClient(self.address, api_key=self.rollout_cfg.rollout_engine_api_key)
        info = self._connect(first=True)
        return {
            "engine_rank": self.engine_rank,
            "address": self.address,
            "server": "external" if self.external else self.server.kind,
            "model_path": str(info.get("model_path", "")),
        }

    def _connect(self, first: bool) -> dict:
        """GET /health then /model_info; an unreachable address at start is the user's to fix."""
        try:
            self.client.get("/health", timeout=self.rollout_cfg.engine_health_timeout)
        except EngineDiedError as e:
            if not first:
                raise
            where = "--rollout-external-engine-addrs" if self.external else "the started server"
            raise UserError(f"{e}; start the server or fix {where}") from None
        info = self.client.get("/model_info")
        if not isinstance(info, dict) or not ({"model_path", "weight_version"} & set(info)):
            raise EngineReplyError(
                f"engine {self.address}: GET /model_info answered {short(str(info))}; not a server speaking SGLang's protocol"
            )
        self._version = parse_version(info.get("weight_version", "default"))
        return info

    @ray.method(concurrency_group="probe")
    def restart(self, initial_weights: bool = False) -> dict:
        """Bring the server back: restart a started one, or wait for an external one to answer again.

        What it held is gone either way: weights are undefined until the next sync, memory is awake.
        ``initial_weights``: the weights the server starts with are the ones wanted (no trainer exists
        to sync any, ``--debug-rollout-only``), so it generates again at once.
        """
        if self.server is not None:
            self.server.stop()
            self.address = self.server.start(self.rollout_cfg.engine_start_timeout)
            self.client = SglangClient(self.address, api_key=self.rollout_cfg.rollout_engine_api_key)
        deadline = time.monotonic() + self.rollout_cfg.engine_start_timeout
        while True:
            try:
                self._connect(first=False)
                break
            except EngineDiedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self._stale, self._residency = not initial_weights, "AWAKE"
        return {"engine_rank": self.engine_rank, "address": self.address}

    def server_pid(self) -> int | None:
        """The started server's process id (None for an external server)."""
        return self.server.proc.pid if self.server is not None and self.server.proc is not None else None

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _c(self) -> SglangClient:
        if self.client is None:
            raise RuntimeError(f"engine {self.engine_rank}: init() was not called")
        return self.client

    # ------------------------------------------------------------------ generation

    def generate(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        if self._stale:
            raise WeightSyncError(
                f"engine {self.address}: its last weight update did not complete; it generates again after a full sync"
            )
        if self._residency != "AWAKE":
            from tidal.errors import ResidencyError

            raise ResidencyError(f"engine {self.address}: generate while {self._residency}; resume its memory first")
        if self.rollout_cfg.partial_rollout:
            return self._generate_partial(samples, sampling)
        todo = list(samples)
        for _ in range(3):  # requests the server aborted (a pause, an update) are sent again
            if not todo:
                return samples
            body = {
                "input_ids": [s.prompt_ids for s in todo],
                "sampling_params": sampling_body(sampling),
                "return_logprob": True,
                "logprob_start_len": -1,
            }
            out = self._c().post("/generate", body)
            out = out if isinstance(out, list) else [out]
            if len(out) != len(todo):
                raise EngineReplyError(
                    f"engine {self.address}: POST /generate answered {len(out)} results for {len(todo)} prompts"
                )
            where = f"engine {self.address}: POST /generate"
            todo = [s for s, o in zip(todo, out) if not fill_sample(s, o, where, self._version)]
        if todo:
            raise EngineDiedError(f"engine {self.address}: POST /generate aborted {len(todo)} requests three times")
        return samples

    def _generate_partial(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        """``--partial-rollout``: pending and aborted samples are sent from prompt + response so far; rows an
        abort of ours cut short come back ``aborted`` (see the module docstring). Aborts the server made on
        its own are continued at once, up to three times."""
        where = f"engine {self.address}: POST /generate"
        for _ in range(3):
            send = []
            for s in samples:
                left = sampling.max_new_tokens - len(s.response_ids)
                if s.status in ("pending", "aborted"):
                    if left > 0:
                        send.append((s, left))
                    else:
                        s.status = "truncated"
            with self._cv:
                if self._pausing:  # rows not started stay aborted with what they have (as the embedded engine's)
                    for x, _ in send:
                        x.status = "aborted"
                if not send or self._pausing:
                    return samples
                self._posting = True
            try:
                body = {
                    "input_ids": [list(s.prompt_ids) + list(s.response_ids) for s, _ in send],
                    "sampling_params": [
                        sampling_body(dataclasses.replace(sampling, max_new_tokens=left)) for _, left in send
                    ],
                    "return_logprob": True,
                    "logprob_start_len": -1,
                }
                out = self._c().post("/generate", body)
            finally:
                with self._cv:
                    self._posting = False
                    self._cv.notify_all()
            out = out if isinstance(out, list) else [out]
            if len(out) != len(send):
                raise EngineReplyError(f"{where} answered {len(out)} results for {len(send)} prompts")
            for (s, _), o in zip(send, out):
                spans = bool(s.response_ids) and any(sampling.stop)  # a stop string may start in a piece before
                append_output(s, o, where, self._version, sampling.max_new_tokens)
                if spans:
                    cut_at_stop(s, sampling.stop, self._tok())
        if any(s.status == "aborted" for s in samples) and not self._pausing:
            raise EngineDiedError(f"{where} aborted requests three times")
        return samples

    def _tok(self):
        """The model's tokenizer (``--model`` / ``--tokenizer``), which the server decodes responses with."""
        if self._tokenizer is None:
            from tidal.model import load_tokenizer, resolve_model

            spec = resolve_model(self.model_cfg.model, self.model_cfg.tokenizer, self.model_cfg.trust_remote_code)
            self._tokenizer = load_tokenizer(spec)
        return self._tokenizer

    # ------------------------------------------------------------------ memory

    def release_memory(self, tags: Sequence[str] = TAGS) -> MemoryReport:
        t0 = time.perf_counter()
        self._c().post("/release_memory_occupation", {"tags": list(tags)})
        self._residency = "ASLEEP"
        return MemoryReport(self._residency, {"memory/engine_release/seconds": time.perf_counter() - t0})

    def resume_memory(self, tags: Sequence[str] = TAGS) -> MemoryReport:
        t0 = time.perf_counter()
        self._c().post("/resume_memory_occupation", {"tags": list(tags)})
        self._residency = "AWAKE" if "kv_cache" in tags else "WEIGHTS_ONLY"
        return MemoryReport(self._residency, {"memory/engine_resume/seconds": time.perf_counter() - t0})

    # ------------------------------------------------------------------ weights

    def _update(self, endpoint: str, body: dict, version: int, last: bool, nbytes: int) -> WeightUpdateResult:
        """POST one weight update; on the last bucket check /model_info reports the version."""
        t0 = time.perf_counter()
        self._stale = True
        reply = self._c().post(endpoint, {**body, "weight_version": str(version) if last else None})
        if isinstance(reply, dict) and reply.get("success") is False:
            raise WeightSyncError(
                f"engine {self.address}: POST {endpoint} answered success=false: {short(str(reply.get('message', '')))}"
            )
        if last:
            got = self._c().get("/model_info").get("weight_version")
            if parse_version(got) != version:
                raise WeightSyncError(
                    f"engine {self.address}: GET /model_info reports weight_version {got!r} after updating to {version}"
                )
            self._version, self._stale = version, False
        return WeightUpdateResult(version, last, self._version, time.perf_counter() - t0, nbytes)

    def update_weights_from_disk(self, path: str, version: int) -> WeightUpdateResult:
        return self._update("/update_weights_from_disk", {"model_path": path, "flush_cache": True}, version, True, 0)

    def update_weights_from_tensor(self, bucket: BucketHeader, version: int) -> WeightUpdateResult:
        import torch

        from tidal.weight_sync.bucket import buffer_checksum, entry_views
        from tidal.weight_sync.checksum import tensor_checksum
        from tidal.weight_sync.receiver import bucket_buffer

        buf = bucket_buffer(bucket)
        got = buffer_checksum(buf)
        if got != bucket.checksum:
            raise WeightSyncError(
                f"weight sync v{version}: bucket {bucket.index} checksum mismatch ({got} != {bucket.checksum}) on its way to {self.address}; nothing applied"
            )
        if buf.device.type == "cpu":
            # Into shared memory once, so the server maps the tensors instead of receiving their bytes.
            shared = torch.empty(buf.numel(), dtype=torch.uint8).share_memory_()
            shared.copy_(buf)
            buf = shared
        else:
            # torch refuses to pass on CUDA memory it received over IPC: one device copy of the bucket,
            # which this actor owns and shares with the server (kept alive until the server answered).
            buf = buf.clone()
        entries = list(bucket.entries)
        named = [(e["name"], t) for e, t in zip(entries, entry_views(buf, entries))]
        if not named:
            return self._version_only(version, bool(bucket.last))
        body = {
            "serialized_named_tensors": [serialize_named_tensors(named)],
            "load_format": None,
            "flush_cache": bool(bucket.last),
            "checksums": {name: tensor_checksum(t) for name, t in named},
        }
        return self._update("/update_weights_from_tensor", body, version, bool(bucket.last), buf.numel())

    def init_weights_update_group(
        self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str
    ) -> None:
        body = {
            "master_address": master_addr,
            "master_port": int(master_port),
            "rank_offset": int(rank),
            "world_size": int(world_size),
            "group_name": SGLANG_GROUP,
            "backend": backend,
        }
        reply = self._c().post("/init_weights_update_group", body)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise WeightSyncError(
                f"engine {self.address}: POST /init_weights_update_group answered success=false: {short(str(reply.get('message', '')))}"
            )

    def destroy_weights_update_group(self) -> None:
        self._c().post("/destroy_weights_update_group", {"group_name": SGLANG_GROUP})

    def update_weights_from_distributed(self, bucket: BucketHeader, version: int) -> WeightUpdateResult:
        entries = list(bucket.entries)
        if not entries:
            return self._version_only(version, bool(bucket.last))
        body = {
            "names": [e["name"] for e in entries],
            "dtypes": [e["dtype"] for e in entries],
            "shapes": [list(e["shape"]) for e in entries],
            "group_name": SGLANG_GROUP,
            "load_format": "flattened_bucket",
            "flush_cache": bool(bucket.last),
            "checksums": bucket.tensor_checksums,
        }
        nbytes = sum(int(e["nbytes"]) for e in entries)
        return self._update("/update_weights_from_distributed", body, version, bool(bucket.last), nbytes)

    def pull_weights(self, source_dir: str, local_checkpoint_dir: str | None = None, target_version=None):
        """slime's ``POST /pull_weights`` (delta over disk): the server brings its local checkpoint to
        ``target_version``; its weights change with the next ``update_weights_from_disk``."""
        from tidal.weight_sync.local_checkpoint import PullResult

        t0 = time.perf_counter()
        body = {
            "source_dir": source_dir,
            "local_checkpoint_dir": local_checkpoint_dir,
            "target_version": None if target_version is None else str(target_version),
        }
        reply = self._c().post("/pull_weights", body)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise WeightSyncError(
                f"engine {self.address}: POST /pull_weights answered success=false: {short(str(reply.get('message', '')))}"
            )
        got = reply.get("version", target_version) if isinstance(reply, dict) else target_version
        return PullResult(version=int(got) if got is not None else -1, seconds=time.perf_counter() - t0)

    def _version_only(self, version: int, last: bool) -> WeightUpdateResult:
        """A bucket with no tensors (nothing left to send) still commits the version."""
        if last:
            self._c().post("/update_weight_version", {"new_version": str(version)})
            return self._update("/flush_cache", {}, version, True, 0)
        return WeightUpdateResult(version, False, self._version)

    def get_weight_version(self) -> int:
        self._version = parse_version(self._c().get("/model_info").get("weight_version", "default"))
        return self._version

    def flush_cache(self) -> None:
        """``POST /flush_cache``: the server drops its radix (prefix) cache; retried while requests still run."""
        for attempt in range(10):  # SGLang refuses a flush while requests run
            try:
                self._c().post("/flush_cache")
                return
            except EngineReplyError:
                if attempt == 9:
                    raise
                time.sleep(0.2)

    @ray.method(concurrency_group="probe")
    def take_decode_stats(self) -> DecodeStats:
        """The server decodes, not this client: zeros, answered beside a running ``generate``."""
        return DecodeStats()

    @ray.method(concurrency_group="probe")
    def pause_generation(self) -> None:
        """Without ``--partial-rollout``, SGLang's ``abort`` mode: the server answers what it is generating as
        aborted (``generate`` sends those requests again; the server holds them until ``continue_generation``).
        With it: the requests in flight return at the server's next step, their rows ``aborted`` with the
        tokens they have, and no request is sent until ``continue_generation`` (module docstring)."""
        if not self.rollout_cfg.partial_rollout:
            self._c().post("/pause_generation", {"mode": "abort"})
            return
        deadline = time.monotonic() + self.rollout_cfg.engine_health_timeout
        with self._cv:
            self._pausing = True
        while True:
            self._c().post("/abort_request", {"abort_all": True}, timeout=self.rollout_cfg.engine_health_timeout)
            with self._cv:  # a request still out may have reached the server after the abort: abort again
                if not self._cv.wait_for(lambda: not self._posting, timeout=0.5) and time.monotonic() < deadline:
                    continue
                return

    def continue_generation(self) -> None:
        """The server generates again (``--partial-rollout``: requests may be sent again; same concurrency group
        as ``generate``, so before the next call)."""
        if not self.rollout_cfg.partial_rollout:
            self._c().post("/continue_generation")
            return
        with self._cv:
            self._pausing = False

    @ray.method(concurrency_group="probe")
    def health(self) -> EngineHealth:
        self._c().get("/health", timeout=self.rollout_cfg.engine_health_timeout)
        return EngineHealth(self.engine_rank, self.get_weight_version(), self._residency, self.address, "sglang")

    # ------------------------------------------------------------------ checks (tidal serve only)

    def weight_checksums(self, algo: str = "xxh3-128") -> dict[str, str]:
        """``GET /weight_checksums`` (tidal serve): ``{weight_version, checksums: name -> xxh3-128}``."""
        try:
            reply = self._c().get("/weight_checksums", timeout=600.0)
        except EngineReplyError as e:
            raise UserError(
                f"{e}; --check-weight-update-equal needs a tidal serve engine (other servers are checked by weight_version only)"
            ) from None
        return dict(reply["checksums"])

    def randomize_weights(self, seed: int) -> None:
        """``POST /randomize_weights`` (tidal serve); a server without it keeps its weights (logged once)."""
        try:
            self._c().post("/randomize_weights", {"seed": int(seed)})
        except EngineReplyError as e:
            log.warning("%s: weights not randomised before the equality check", e)

    @ray.method(concurrency_group="probe")
    def memory_stats(self) -> dict[str, int]:
        """This client's host memory (the server's own figures are its business); answered beside a call."""
        from tidal.memory.telemetry import process_memory_stats

        return process_memory_stats("cpu")

    def residency(self) -> str:
        return self._residency
