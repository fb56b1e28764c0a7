"""The HTTP engine against a server written in the test from SGLang's documented protocol, and against tidal serve.

``sglang_like_server.py`` (no tidal import) runs as its own process on 127.0.0.1. The HTTP engine's
calls are checked one by one (generate, memory, versions, errors, a disk folder, the broadcast
group and flattened buckets), then the whole loop runs with ``--rollout-engine sglang``: against
the SGLang-shaped server (tensor transport, the server hanging mid-run), against an external
``tidal serve`` (broadcast, delta over disk) and against ``tidal serve`` started by tidal (tensor,
the server killed mid-run), every weight bitwise equal to the trainer's after every sync and the
same samples per step. An embedded engine actor killed mid-run is survived the same way, and a
killed trainer rank ends the run in one line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from serve_process import http_engine

from tidal.config import parse, resolve
from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig, WeightSyncConfig
from tidal.errors import EngineDiedError, RunFailed, UserError, WeightSyncError
from tidal.rollout.http_engine import HttpEngineActor
from tidal.rollout.server import API_KEY_ENV, server_command, server_env
from tidal.rollout.sglang_client import EngineReplyError
from tidal.rollout.types import Sample, SamplingParams
from tidal.weight_sync.verify import compare_checksums

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "sglang_like_server.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The SGLang-shaped server as a child process; ``start`` again brings it back on the same port."""

    def __init__(self, *flags: str):
        self.port = _free_port()
        self.flags = list(flags)
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, *extra: str) -> Server:
        cmd = [sys.executable, SERVER, "--port", str(self.port), *self.flags, *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                if httpx.get(f"http://{self.address}/health", timeout=1).status_code in (200, 401):
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("test server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server():
    """One server for the tests that leave it running (each run resyncs every weight it checks)."""
    srv = Server("--tidal-extras").start()
    yield srv
    srv.stop()


def _samples(n: int) -> list[Sample]:
    return [Sample(index=i, group=i, prompt="p", prompt_ids=[1 + i, 2, 3]) for i in range(n)]


def test_generate_fills_samples_from_sglang_shapes(server):
    eng = http_engine(server.address)
    assert eng.get_weight_version() == -1  # SGLang's "default" before any update
    out = eng.generate(_samples(3), SamplingParams(max_new_tokens=5, stop_token_ids=[13]))
    # The server's toy continuation: token k = (sum(prompt) + 7k) mod 64; 13 stops it.
    assert out[0].response_ids == [6, 13] and out[0].status == "completed"
    assert out[1].response_ids == [7, 14, 21, 28, 35] and out[1].status == "truncated"
    assert out[1].response_logprobs == pytest.approx([-0.1 * (1 + t % 5) for t in out[1].response_ids])
    assert out[2].response_text == " ".join(map(str, out[2].response_ids))
    health = eng.health()
    assert (health.address, health.protocol, health.residency) == (server.address, "sglang", "AWAKE")

    assert eng.release_memory().residency == "ASLEEP"
    with pytest.raises(Exception, match="resume its memory first"):
        eng.generate(_samples(1), SamplingParams())
    eng.resume_memory(["weights"])
    assert eng.resume_memory(["kv_cache"]).residency == "AWAKE"
    eng.flush_cache()
    eng.pause_generation()
    eng.continue_generation()
    assert len(eng.generate(_samples(2), SamplingParams(max_new_tokens=2))) == 2


def test_partial_rollout_aborts_requests_and_continues_them_from_their_tokens(server):
    """``--partial-rollout`` over SGLang's protocol: ``pause_generation`` aborts the request in flight
    (``/abort_request`` with ``abort_all``, as slime does); the rows come back ``aborted`` with the tokens and
    log-probs the server returned; the next call sends prompt + response so far with the budget left, on
    the new weight version, and appends (each token's version recorded)."""
    import threading

    eng = http_engine(server.address, partial_rollout=True)
    post = lambda path, body: httpx.post(f"http://{server.address}{path}", json=body).raise_for_status()  # noqa: E731
    progress = lambda: httpx.get(f"http://{server.address}/generate_bodies").json()  # noqa: E731
    post("/update_weight_version", {"new_version": "5"})
    eng.get_weight_version()
    post("/toy_pace", {"hold_every": 1})  # each request waits after its first token until an abort
    samples, sampling = _samples(3), SamplingParams(max_new_tokens=8)
    before = progress()
    call = threading.Thread(target=eng.generate, args=(samples, sampling))
    call.start()
    for _ in range(1000):  # the first row has its token: then the pause
        if progress()["tokens"] > before["tokens"]:
            break
        time.sleep(0.01)
    eng.pause_generation()
    call.join(30)
    post("/toy_pace", {})
    first = samples[0].response_ids
    assert all(s.status == "aborted" for s in samples) and len(first) == 1, [s.response_ids for s in samples]
    assert first == [(6 + 7 * k) % 64 for k in range(len(first))]  # the toy server's tokens for prompt [1, 2, 3]
    assert samples[0].response_logprobs == pytest.approx([-0.1 * (1 + t % 5) for t in first])
    assert samples[0].weight_version == 5 and not samples[1].response_ids and not samples[2].response_ids
    sent = len(progress()["bodies"])
    assert eng.generate(samples, sampling) is samples and len(progress()["bodies"]) == sent  # paused: not sent
    post("/update_weight_version", {"new_version": "6"})
    eng.continue_generation()
    eng.generate(samples, sampling)
    body = progress()["bodies"][-1]
    k = len(first)
    assert body["input_ids"][0] == [1, 2, 3, *first] and body["input_ids"][1] == [2, 2, 3]
    assert [sp["max_new_tokens"] for sp in body["sampling_params"]] == [8 - k, 8, 8]
    rest = [(6 + sum(first) + 7 * j) % 64 for j in range(8 - k)]
    assert samples[0].response_ids == first + rest and samples[0].status == "truncated"
    assert samples[0].response_versions == [5] * k + [6] * (8 - k) and samples[0].weight_version == 5
    assert len(samples[0].response_logprobs) == 8 and samples[0].response_text.count(" ") == 6
    assert samples[1].weight_version == 6 and not samples[1].response_versions and len(samples[1].response_ids) == 8
    post("/update_weight_version", {"new_version": "default"})


def test_cut_at_stop_finds_the_first_stop_string_of_the_whole_response():
    """The rule ``--partial-rollout`` applies after appending a piece: the shortest prefix whose text holds a stop
    string, wherever the pause fell; log-probs and per-token versions are cut with it."""
    from tidal.model.tokenizer import char_tokenizer
    from tidal.rollout.sglang_client import cut_at_stop

    tok = char_tokenizer()
    s = Sample(index=0, group=0, prompt="p", prompt_ids=[1], status="aborted", weight_version=5)
    s.response_ids = tok.encode("12+3=45=6")
    s.response_logprobs = [-0.1 * i for i in range(len(s.response_ids))]
    s.response_versions = [5] * 4 + [6] * 5  # "12+3" before the pause, "=45=6" after
    cut_at_stop(s, ["", "3=4", "=6"], tok)
    assert (s.response_text, s.status, s.response_ids) == ("12+3=4", "completed", tok.encode("12+3=4"))
    assert (
        s.response_logprobs == pytest.approx([-0.1 * i for i in range(6)]) and s.response_versions == [5] * 4 + [6] * 2
    )
    plain = Sample(index=1, group=1, prompt="p", prompt_ids=[1], status="truncated", response_ids=tok.encode("1+1"))
    cut_at_stop(plain, ["=6"], tok)
    assert plain.status == "truncated" and plain.response_ids == tok.encode("1+1")


def test_bad_addresses_and_replies_are_one_line(server, tmp_path):
    dead = f"127.0.0.1:{_free_port()}"
    with pytest.raises(UserError) as exc:
        http_engine(dead)
    msg = str(exc.value)
    assert dead in msg and "GET /health" in msg and "\n" not in msg
    # A server that does not speak the protocol: plain HTTP answering 404 everywhere but /health.
    port = _free_port()
    plain = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", tempfile.mkdtemp()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        with pytest.raises(UserError) as exc:
            http_engine(f"127.0.0.1:{port}")
        msg = str(exc.value)
        assert f"127.0.0.1:{port}" in msg and "GET /health answered 404" in msg and "\n" not in msg
    finally:
        plain.kill()
        plain.wait()
    # An update the server refuses: one line, and the engine refuses to generate until a full version landed.
    eng = http_engine(server.address)
    with pytest.raises(WeightSyncError) as exc:
        eng.update_weights_from_disk(str(tmp_path), 1)
    assert f"engine {server.address}: POST /update_weights_from_disk answered success=false" in str(exc.value)
    with pytest.raises(WeightSyncError, match="did not complete"):
        eng.generate(_samples(1), SamplingParams())


def test_disk_version_key_and_death_on_an_sglang_shaped_server(tmp_path):
    """On a server of its own (with a key; these weights are not the model the shared server's runs sync):
    the key is sent, a version folder of tidal's disk transport is a plain safetensors folder to SGLang's
    reader, and a server that dies under a request is an engine error naming it."""
    import torch

    from tidal.config.schema import WeightSyncConfig as W
    from tidal.weight_sync.checksum import tensor_checksum
    from tidal.weight_sync.disk import DiskStrategy

    weights = {"model.embed.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}
    cfg = W(update_weight_transport="disk", update_weight_disk_dir=str(tmp_path))
    path = DiskStrategy(cfg, []).write(weights.items(), 7)
    srv = Server("--tidal-extras", "--api-key", "k1").start()
    try:
        with pytest.raises(EngineReplyError, match="answered 401"):
            http_engine(srv.address)
        eng = http_engine(srv.address, rollout_engine_api_key="k1")
        assert eng.get_weight_version() == -1
        result = eng.update_weights_from_disk(path, 7)
        got = eng.weight_checksums()
    finally:
        srv.stop()
    assert (result.complete, result.engine_version) == (True, 7)
    assert {n: got[n] for n in weights} == {n: tensor_checksum(t) for n, t in weights.items()}
    with pytest.raises(EngineDiedError, match=f"engine {srv.address}: POST /generate failed"):
        eng.generate(_samples(1), SamplingParams())


def test_server_command_lines():
    model = ModelConfig(model="/models/qwen", tokenizer="/models/tok", trust_remote_code=True)
    cfg, _ = parse(
        [
            "--rollout-engine",
            "sglang",
            "--sglang-server",
            "sglang",
            "--sglang-mem-fraction-static",
            "0.7",
            "--sglang-enable-memory-saver",
            "--sglang-tp-size=2",
        ]
    )
    cmd = server_command(
        "sglang",
        model=model,
        rollout=cfg.rollout,
        memory=MemoryConfig(offload_rollout=True),
        weight_sync=WeightSyncConfig(),
        device="cuda",
        seed=5,
        port=31000,
    )
    assert cmd[1:] == [
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen",
        "--tokenizer-path",
        "/models/tok",
        "--trust-remote-code",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--random-seed",
        "5",
        "--enable-memory-saver",
        "--dtype",
        "bfloat16",
        "--mem-fraction-static",
        "0.7",
        "--enable-memory-saver",
        "--tp-size=2",
    ]
    rollout = RolloutConfig(
        rollout_engine="sglang",
        rollout_fast_decode=False,
        rollout_max_batch=64,
        rollout_engine_api_key="key",
        rollout_prefix_cache_mb=1024,
    )
    cmd = server_command(
        "tidal",
        model=ModelConfig(model="tiny-qwen2"),
        rollout=rollout,
        memory=MemoryConfig(memory_backend="portable"),
        weight_sync=WeightSyncConfig(update_weight_checksum="adler32"),
        device="cpu",
        seed=3,
        port=30001,
    )
    assert cmd[1:] == [
        "-m",
        "tidal",
        "serve",
        "--model",
        "tiny-qwen2",
        "--no-rollout-fast-decode",
        "--rollout-max-batch",
        "64",
        "--rollout-prefix-cache-mb",
        "1024",
        "--memory-backend",
        "portable",
        "--update-weight-checksum",
        "adler32",
        "--device",
        "cpu",
        "--seed",
        "3",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
    ]
    # The key travels in the environment, not on the command line (which ps shows); tidal serve reads it there.
    assert server_env("tidal", rollout) == {API_KEY_ENV: "key"} and server_env("sglang", rollout) == {}
    # Every flag tidal serve gets is a tidal flag.
    parse([a for a in cmd[4:] if a not in ("--host", "127.0.0.1", "--port", "30001")])


# ------------------------------------------------------------------------------------------- the loop


def _train(tmp_path, *flags, on_step=None):
    from tidal.driver import train

    argv = [
        "--num-rollout",
        "2",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "3",
        "--device",
        "cpu",
        "--output-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--rollout-engine",
        "sglang",
        *flags,
    ]
    cfg, prov = parse(argv)
    cfg = resolve(cfg, prov)
    train(cfg, on_step=on_step)
    return [json.loads(x) for x in open(os.path.join(cfg.logging.output_dir, "metrics.jsonl"))]


def _bitwise(seen):
    def on_step(s, rollout_id, row):
        want = s.trainer.call("weight_checksums")
        for got in s.engines.call("weight_checksums"):
            assert compare_checksums(want, got) == [], f"engine differs from the trainer after sync {rollout_id}"
        assert s.engines.call("get_weight_version") == [row["sync/version"]] * len(s.engines)
        seen.append(row["sync/version"])

    return on_step


def test_broadcast_in_sglang_layout_to_the_sglang_shaped_server(ray_cluster, server):
    """The broadcast strategy forms the group as SGLang joins it and sends flattened buckets (no
    alignment gaps); mixed dtypes and odd sizes over several buckets land bitwise; closing the strategy
    has the server leave the group."""
    import ray
    import torch

    from tidal.weight_sync.broadcast import BroadcastStrategy
    from tidal.weight_sync.checksum import tensor_checksum

    r = RolloutConfig(rollout_engine="sglang", rollout_external_engine_addrs=[server.address])
    actor = (
        ray.remote(concurrency_groups={"probe": 2})(HttpEngineActor)
        .options(num_cpus=0)
        .remote(0, model=ModelConfig(), rollout=r, memory=MemoryConfig(), weight_sync=WeightSyncConfig(),
                device="cpu", address=server.address)
    )  # fmt: skip
    ray.get(actor.init.remote())
    g = torch.Generator().manual_seed(0)
    weights = {
        "a.weight": torch.randn(7, 3, generator=g),
        "b.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.weight": torch.randn(33, 9, generator=g),
        "d.bias": torch.randn(3, generator=g),
    }
    cfg = WeightSyncConfig(update_weight_transport="broadcast", update_weight_buffer_size=1024)
    strategy = BroadcastStrategy(cfg, [actor], device="cpu", colocated=False)
    strategy.connect()
    report = strategy.sync(weights.items(), 1)
    assert report.bytes_total == sum(t.numel() * t.element_size() for t in weights.values())
    assert ray.get(actor.get_weight_version.remote()) == 1
    got = ray.get(actor.weight_checksums.remote())
    assert got == {n: tensor_checksum(t) for n, t in weights.items()}
    strategy.close()
    assert [c[0] for c in httpx.get(f"http://{server.address}/group_calls").json()] == ["init", "destroy"]


@pytest.mark.slow
def test_full_loop_with_partial_rollout_over_sglang_protocol(ray_cluster, server, tmp_path):
    """``--async full --partial-rollout`` with an HTTP engine: the SGLang-shaped server holds every second
    request after its first token until an abort, so each sync finds a request in flight; it is aborted,
    continued from its tokens on the new weights, and trained with its tokens' versions."""
    pace = lambda body: httpx.post(f"http://{server.address}/toy_pace", json=body).raise_for_status()  # noqa: E731
    pace({"hold_every": 2})
    try:
        rows = _train(
            tmp_path, "--rollout-external-engine-addrs", server.address, "--async", "full", "--partial-rollout",
            "--num-rollout", "2", "--rollout-max-response-len", "6", "--log-samples", "8",
        )  # fmt: skip
    finally:
        pace({})
    recs = [json.loads(x) for x in open(tmp_path / "run" / "samples.jsonl")]
    assert [r["async/paused_groups"] for r in rows] == [2, 2]  # the held request, at every sync
    assert [r["async/partial_samples"] for r in rows] == [0, 1]  # its first row: one token on the old weights
    spans = [x["response_versions"] for x in recs if "response_versions" in x]
    held = {r["step"]: r["async/trainer_version"] for r in rows}
    assert spans == [[[held[1] - 1, 1], [held[1], 5]]], spans


@pytest.mark.slow
def test_loop_survives_a_server_that_stops_answering(ray_cluster, tmp_path, caplog):
    """The server hangs on the rollout's /generate (and /health) for a while: after --engine-health-timeout
    the engine counts as dead, and tidal reconnects once the server answers again and resyncs it over a
    new broadcast group, the server leaving the old one first. Then a --debug-rollout-only run (no
    trainer) survives the same hang: the engine generates again with the weights the server holds, with
    no resync."""
    srv = Server("--tidal-extras").start("--hang-on-generate", "1,3", "--hang-seconds", "4")
    flags = ["--rollout-external-engine-addrs", srv.address, "--engine-start-timeout", "120"]
    flags += ["--engine-health-timeout", "2", "--num-rollout", "1"]
    seen: list[int] = []
    try:
        rows = _train(
            tmp_path / "train", *flags, "--no-colocate", "--update-weight-transport", "broadcast",
            "--check-weight-update-equal", on_step=_bitwise(seen),
        )  # fmt: skip
        calls = httpx.get(f"http://{srv.address}/group_calls").json()
        assert [c[0] for c in calls] == ["init", "destroy", "init"] and calls[0][2] != calls[2][2], calls
        # Found by the probe while the server still ran (hung).
        assert (
            "engine 0 died (no /health answer within 2 s (--engine-health-timeout)); restarting it (1/3)" in caplog.text
        )
        assert [r["engine_restarts"] for r in rows] == [1] and rows[0]["gen_samples"] == 4
        # The rollout was generated again after a resync that kept version 1; its step synced version 2.
        assert seen == [1, 2]
        caplog.clear()
        rows = _train(tmp_path / "rollout-only", *flags, "--debug-rollout-only")
    finally:
        srv.stop()
    assert "engine 0 died (no /health answer within 2 s" in caplog.text
    assert [r["engine_restarts"] for r in rows] == [1] and rows[0]["gen_samples"] == 4


@pytest.mark.slow
def test_embedded_engine_deaths_a_hang_and_a_trainer_death(ray_cluster, tmp_path, monkeypatch):
    """Embedded engines, in one rollout: one frozen (SIGSTOP) while it generates, found by its health
    probe, and one killed between generating and releasing its memory (outside generation); each is
    restarted and resynced at the version it had. Then a killed trainer ends the run in one line naming
    the checkpoint."""
    import signal

    import ray

    from tidal.driver import train
    from tidal.rollout import orchestrate

    argv = [
        "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "3", "--device", "cpu", "--output-dir", str(tmp_path / "run"), "--no-progress",
        "--save", str(tmp_path / "ck"), "--save-interval", "1", "--offload-rollout", "--engine-health-timeout", "3",
    ]  # fmt: skip
    cfg, prov = parse(argv)
    cfg = resolve(cfg, prov)
    generate = orchestrate.generate_rollout

    def with_faults(s, rollout_id):
        if rollout_id == 0:
            os.kill(ray.get(s.engines.actors[0].pid.remote()), signal.SIGSTOP)
        out = generate(s, rollout_id)
        if rollout_id == 0:
            ray.kill(s.engines.actors[0])  # the release of its memory finds it dead
        return out

    monkeypatch.setattr(orchestrate, "generate_rollout", with_faults)
    seen: list[int] = []
    check = _bitwise(seen)

    def on_step(s, rollout_id, row):
        check(s, rollout_id, row)
        if rollout_id == 0:
            ray.kill(s.trainer.actors[0])

    with pytest.raises(RunFailed) as exc:
        train(cfg, on_step=on_step)
    msg = str(exc.value)
    assert msg.startswith("trainer rank 0 died") and "\n" not in msg
    assert f"resume with --load {tmp_path / 'ck'} (newest checkpoint: iter_0000000)" in msg, msg
    rows = [json.loads(x) for x in open(os.path.join(cfg.logging.output_dir, "metrics.jsonl"))]
    assert [r["engine_restarts"] for r in rows] == [2] and rows[0]["gen_samples"] == 4
    assert seen == [1, 2]  # both resyncs kept version 1; the step's own sync pushed 2


def test_restarts_past_the_limit_are_one_line():
    from types import SimpleNamespace

    from tidal.session import Session

    cfg, prov = parse(["--max-engine-restarts", "0", "--device", "cpu"])
    fake = SimpleNamespace(cfg=resolve(cfg, prov), engine_restarts=0)
    fake.checkpoint_hint = lambda: Session.checkpoint_hint(fake)
    with pytest.raises(RunFailed) as exc:
        Session.restart_engines(fake, [0], "ActorDiedError: the actor died")
    msg = str(exc.value)
    assert "engine 0 died (ActorDiedError: the actor died) after 0 engine restart(s)" in msg and "\n" not in msg
    assert exc.value.exit_code == 1


# ------------------------------------------------------------------------------------ against tidal serve


class TidalServe:
    """``tidal serve`` as its own process on 127.0.0.1 (same --model and --seed as the run)."""

    def __init__(self, tmp_path, *flags: str):
        self.log = tmp_path / "serve.log"
        cmd = [sys.executable, "-m", "tidal", "serve", "--device", "cpu", "--port", "0", *flags]
        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(HERE))}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.address = ""
        for _ in range(1200):
            text = self.log.read_text()
            if "listening on http://" in text:
                self.address = text.split("listening on http://", 1)[1].split()[0]
                break
            assert self.proc.poll() is None, text
            time.sleep(0.05)
        assert self.address, self.log.read_text()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.mark.slow
def test_loop_over_external_tidal_serve_broadcast_and_delta_disk(ray_cluster, tmp_path):
    """One external tidal serve, two runs against it, disaggregated: broadcast (tidal serve joins the
    trainer's group as SGLang does), then delta over disk (the server pulls each version into its local
    checkpoint with /pull_weights, then loads it)."""
    serve = TidalServe(tmp_path)
    try:
        seen: list[int] = []
        rows = _train(
            tmp_path / "broadcast", "--rollout-external-engine-addrs", serve.address, "--no-colocate",
            "--update-weight-transport", "broadcast", "--check-weight-update-equal", "--num-rollout", "1",
            on_step=_bitwise(seen),
        )  # fmt: skip
        assert seen == [1, 2] and [r["gen_samples"] for r in rows] == [4]
        seen = []
        rows = _train(
            tmp_path / "delta", "--rollout-external-engine-addrs", serve.address, "--no-colocate",
            "--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "disk"),
            "--update-weight-mode", "delta", "--update-weight-local-checkpoint-dir", str(tmp_path / "local"),
            "--check-weight-update-equal", "--num-rollout", "1", on_step=_bitwise(seen),
        )  # fmt: skip
    finally:
        serve.stop()
    assert seen == [1, 2] and [r["gen_samples"] for r in rows] == [4]
    assert [r["sync/mode"] for r in rows] == ["delta"]


@pytest.mark.slow
def test_loop_with_tidal_serve_started_by_tidal(ray_cluster, tmp_path, monkeypatch):
    """tidal starts tidal serve in the engine's bundle (colocated, tensor transport); the server killed
    between generating and the sync is started again and resynced (outside generation)."""
    import signal

    import ray

    from tidal.rollout import orchestrate

    generate = orchestrate.generate_rollout

    def then_kill(s, rollout_id):
        out = generate(s, rollout_id)
        os.kill(ray.get(s.engines.actors[0].server_pid.remote()), signal.SIGKILL)
        return out

    monkeypatch.setattr(orchestrate, "generate_rollout", then_kill)
    seen: list[int] = []
    rows = _train(
        tmp_path, "--update-weight-transport", "tensor", "--check-weight-update-equal", "--num-rollout", "1",
        on_step=_bitwise(seen),
    )  # fmt: skip
    assert [r["engine_restarts"] for r in rows] == [1] and [r["gen_samples"] for r in rows] == [4]
    assert seen == [1, 2]  # the resync into the restarted server pushed version 2, the one its sync began
