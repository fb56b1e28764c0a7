"""``tidal serve`` as a separate process on 127.0.0.1, driven over real HTTP.

Requests are written from SGLang's documented shapes (``io_struct.py``, ``http_server.py``) with
httpx, and the weight payloads with the serializer SGLang documents (torch's ``ForkingPickler``,
base64), not with tidal's client; the OpenAI endpoints are driven by the stock ``openai`` client.
Weights sent are compared bitwise with what the server holds afterwards (xxh3-128 computed here of
the bytes sent, and exact values read back through ``/get_weights_by_name``).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import httpx
import pytest
import torch
import xxhash
from serve_process import http_engine, serve_process, server_state, wait_for_state

from tidal.rollout.types import Sample, SamplingParams

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    # Each decode step 2 ms longer: a 250-token request then outlasts the pause tests' polls and the 0.2 s after
    # which a newcomer joins a running step (the tiny model alone: ~0.17 s for it on an idle core).
    env = {"OMP_NUM_THREADS": "1"}
    with serve_process(["--model", "tiny"], log, key=KEY, env_extra=env, step_delay_s=0.002) as client:
        yield client


def _model():
    from tidal.model import build_model, resolve_model

    return build_model(resolve_model("tiny", None, False))


def _random_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(p.shape, generator=gen)) for n, p in _model().named_parameters()]


def _xxh(t: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def _serialize(obj) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True)."""
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors between unrelated processes
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def _assert_holds(server, weights) -> None:
    got = server.get("/weight_checksums").json()["checksums"]
    assert got == {n: _xxh(t) for n, t in weights}
    name, t = weights[1]
    values = server.post("/get_weights_by_name", json={"name": name, "truncate_size": 10**6}).json()
    assert torch.equal(torch.tensor(values, dtype=t.dtype), t)


def test_generate_in_sglang_shapes(server):
    one = server.post(
        "/generate", json={"text": "12+3=", "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    )
    assert one.status_code == 200, one.text
    out = one.json()
    assert isinstance(out, dict) and set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 5  # one token per character
    assert meta["completion_tokens"] == len(out["output_ids"]) == len(meta["output_token_logprobs"])
    for lp, tid, text in meta["output_token_logprobs"]:
        assert lp <= 0 and isinstance(tid, int) and text is None
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["finish_reason"]["type"] in ("stop", "length") and isinstance(meta["weight_version"], str)

    batch = server.post(
        "/generate",
        json={"input_ids": [[1, 5, 6], [1, 7]], "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 0}},
    ).json()
    assert len(batch) == 4 and [b["meta_info"]["prompt_tokens"] for b in batch] == [3, 3, 2, 2]
    assert batch[0]["output_ids"] == batch[1]["output_ids"]  # greedy: both samples of a prompt agree
    for b in batch:
        fr = b["meta_info"]["finish_reason"]
        assert fr == {"type": "length", "length": 3} or (fr["type"] == "stop" and fr["matched"] == 2)

    # A stop token ends the response; SGLang keeps it in output_ids and names it in finish_reason.
    first = batch[0]["output_ids"][0]
    stopped = server.post(
        "/generate",
        json={
            "input_ids": [1, 5, 6],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "stop_token_ids": [first]},
        },
    ).json()
    assert stopped["output_ids"] == [first] and stopped["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": first,
    }


def test_api_key_is_enforced(server):
    for path in ("/health", "/model_info", "/v1/models"):
        assert httpx.get(str(server.base_url) + path).status_code == 401
        bad = httpx.get(str(server.base_url) + path, headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401 and bad.json() == {"error": "Unauthorized"}
    for path in ("/generate", "/release_memory_occupation", "/update_weights_from_disk", "/pause_generation"):
        assert httpx.post(str(server.base_url) + path, json={}).status_code == 401
    assert server.get("/health").status_code == 200


def test_concurrent_requests_share_an_engine_step(server):
    assert server.post("/pause_generation", json={"mode": "in_place"}).status_code == 200

    async def burst():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as c:
            body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2}}
            tasks = [asyncio.create_task(c.post("/generate", json=body)) for _ in range(6)]
            for _ in range(100):  # every request is queued behind the pause
                if (await c.get("/server_info")).json()["internal_states"][0]["queued"] == 6:
                    break
                await asyncio.sleep(0.05)
            await c.post("/continue_generation")
            return [r.json() for r in await asyncio.gather(*tasks)]

    outs = asyncio.run(burst())
    steps = {o["meta_info"]["engine_step"] for o in outs}
    assert len(steps) == 1 and all(o["meta_info"]["engine_step_requests"] == 6 for o in outs)


def test_bench_clients_and_request_timings(server):
    """``tidal bench serve``'s client processes (h11 over asyncio, one keep-alive connection a request) get
    every reply, and the server's ``/request_timings`` puts each request's stages in order, on the clock
    the clients use, so the burst's split adds up to its wall time."""
    from argparse import Namespace

    from tidal.bench.serve import PHASES, _Clients, split

    args = Namespace(new_tokens=2, temperature=1.0, seed=3, client_procs=2)
    clients = _Clients(str(server.base_url), [[1, 5 + i, 6] for i in range(6)], args, api_key=KEY)
    try:
        for _ in range(2):  # the second burst reuses the connections of the first
            t0, out = clients.burst()
            assert all(t0 < a < b for a, b in zip(out["sent"], out["done"])) and out["tokens"] > 0
    finally:
        clients.close()
    rids = {f"bench-{i}" for i in range(6)}
    mine = {t["rid"]: t for t in server.get("/request_timings").json()["requests"] if t["rid"] in rids}
    assert set(mine) == rids
    order = ("arrived", "queued", "started", "ended", "resumed", "rendered")
    for t in mine.values():
        assert [t[k] for k in order] == sorted(t[k] for k in order) and t["step"] in out["steps"], t
    parts = split(t0, list(mine.values()), out["done"])
    assert tuple(parts) == PHASES and min(parts.values()) >= 0
    assert abs(sum(parts.values()) - (max(out["done"]) - t0)) < 1e-9


# A 1-row decode that runs its 250 tokens without an EOS from these weights (the fixture's, before any test
# of this module changes them) and this seed: long enough (0.6 s and more on CPU) to be cut while it runs.
LONG = {"max_new_tokens": 250, "temperature": 1.0, "sampling_seed": 38}


def _long(pool, server, prompt):
    return pool.submit(
        server.post, "/generate", json={"input_ids": prompt, "sampling_params": LONG, "return_logprob": True}
    )


def _whole(out: dict) -> dict:
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] != "abort", meta
    assert meta["completion_tokens"] == len(out["output_ids"]) == len(meta["output_token_logprobs"]) > 0
    return meta


def _policy_logprobs(prompt: list[int], out: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(served log-probs, the fixture weights' log-probs of the same tokens from one forward pass here)."""
    from tidal.config.schema import TrainerConfig
    from tidal.model import build_model, resolve_model

    model = build_model(resolve_model("tiny", None, False), seed=TrainerConfig.seed)  # the server's weights
    ids = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    want = logp[len(prompt) - 1 :].gather(1, ids[0, len(prompt) :, None]).squeeze(1)
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]), want


def test_pause_modes_and_rows_joining_a_running_step(server):
    """SGLang's pause modes against a running engine step, and rows arriving during a step joining it."""
    warm = {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}}
    assert server.post("/generate", json=warm).status_code == 200  # the decoder built before a step is cut
    with ThreadPoolExecutor(2) as pool:
        try:
            _retract(pool, server)
            _admission_then_abort(pool, server)
        finally:
            server.post("/continue_generation")  # a failed check leaves nothing held for the tests after it


def _retract(pool, server) -> None:
    """The running step is cut at its next host sync and the pause answers once it returned; the request
    stays open, one sent while paused waits, a weight-version update still runs; after continue both finish
    in one step, the cut row continued from its tokens (served log-probs = the policy's over the whole)."""
    first = _long(pool, server, [1, 5, 6])
    wait_for_state(server, lambda s: s["running_rows"] == 1, "a running step")
    time.sleep(0.1)  # past the prefill: the row has tokens when it is cut
    paused = server.post("/pause_generation", json={"mode": "retract"})
    assert paused.status_code == 200 and paused.json()["num_aborted_requests"] == 0
    state = server_state(server)
    assert state["paused"] and state["running_rows"] == 0 and state["queued"] == 1
    cut = state["recent_steps"][-1]
    assert (cut["rows"], cut["cut_rows"], cut["cut_for"]) == (1, 1, "pause") and 0 < cut["new_tokens"] < 250
    second = _long(pool, server, [1, 7, 8, 9])
    wait_for_state(server, lambda s: s["queued"] == 2, "the second request queued")
    assert server.post("/update_weight_version", json={"new_version": "7"}).status_code == 200
    assert not first.done() and not second.done()
    server.post("/continue_generation")
    out = first.result(timeout=120).json()
    a, b = _whole(out), _whole(second.result(timeout=120).json())
    assert a["engine_step"] == b["engine_step"] == cut["step"] + 1 and a["engine_step_requests"] == 2
    assert a["weight_version"] == b["weight_version"] == "7"
    # The continuing step added only what the row lacked: it kept the tokens it had when it was cut.
    # (A request is answered as its rows end: the step is recorded when its last row ended, maybe a moment later.)
    state = wait_for_state(
        server, lambda st: a["engine_step"] in {x["step"] for x in st["recent_steps"]}, "the step recorded"
    )
    after = {x["step"]: x for x in state["recent_steps"]}[a["engine_step"]]
    assert after["new_tokens"] == a["completion_tokens"] - cut["new_tokens"] + b["completion_tokens"]
    got, want = _policy_logprobs([1, 5, 6], out)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def _admission_then_abort(pool, server) -> None:
    """A request arriving while a step runs joins it: the step is cut once it ran 0.2 s (``cut_for:
    admission``) and both run in the next step. An abort pause then answers both at once, from that step, with
    the tokens they had and an ``abort`` finish reason; a request sent while paused waits for continue."""
    third = _long(pool, server, [1, 5, 6])
    wait_for_state(server, lambda s: s["running_rows"] == 1, "a running step")
    fourth = _long(pool, server, [1, 9])
    wait_for_state(server, lambda s: s["running_rows"] == 2, "the step both requests run in")
    time.sleep(0.1)  # past the prefill: both rows have tokens when they are cut
    aborted = server.post("/pause_generation", json={"mode": "abort"}).json()["num_aborted_requests"]
    outs = [third.result(timeout=10).json(), fourth.result(timeout=10).json()]
    kinds = [o["meta_info"]["finish_reason"]["type"] for o in outs]
    # The second row's own tokens run long from this seed; the first's continuation may meet an EOS first.
    assert kinds[1] == "abort" and kinds[0] in ("abort", "stop") and aborted == kinds.count("abort")
    for out in outs:
        meta = out["meta_info"]
        assert 0 < meta["completion_tokens"] < 250
        assert len(out["output_ids"]) == len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    c, d = (o["meta_info"] for o in outs)
    assert c["engine_step"] == d["engine_step"] and d["engine_step_requests"] == 2
    state = server_state(server)
    assert state["gc_enabled"]  # the collector, off during a step, is on again once its replies are out
    steps = {s["step"]: s for s in state["recent_steps"]}
    joined = steps[c["engine_step"] - 1]
    assert (joined["rows"], joined["cut_rows"], joined["cut_for"]) == (1, 1, "admission")

    body = {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}}
    later = pool.submit(server.post, "/generate", json=body)
    wait_for_state(server, lambda s: s["queued"] == 1, "a request held by the pause")
    server.post("/continue_generation")
    assert later.result(timeout=60).json()["meta_info"]["finish_reason"]["type"] != "abort"

    # tidal's HTTP engine through the same pause: its requests come back aborted, are sent again, held by the
    # paused server, and answered whole after continue.
    engine = http_engine(str(server.base_url).removeprefix("http://"), rollout_engine_api_key=KEY)
    for seed in range(38, 46):
        # A row of up to 250 slowed steps; with the tiny vocabulary an EOS may still end it before the pause
        # reaches its step (the draws depend on the server's steps before it): then it is tried again.
        sample = Sample(index=0, group=0, prompt=None, prompt_ids=[1, 9])
        done = pool.submit(engine.generate, [sample], SamplingParams(temperature=1.0, max_new_tokens=250, seed=seed))
        wait_for_state(server, lambda s, done=done: s["running_rows"] == 1 or done.done(), "a running step")
        engine.pause_generation()
        state = wait_for_state(
            server, lambda s, done=done: s["queued"] == 1 or done.done(), "the engine's request sent again and held"
        )
        if state["queued"] == 1:
            break
        engine.continue_generation()  # answered before the pause cut it: nothing was sent again
    else:
        raise AssertionError("no request of the HTTP engine was held by the pause (each ended before it)")
    engine.continue_generation()
    (out,) = done.result(timeout=60)
    assert out.status in ("completed", "truncated") and len(out.response_ids) == len(out.response_logprobs) > 0


def test_a_request_is_answered_when_its_rows_end(server):
    """Two requests in one engine step: the one whose row ends first (an EOS, from this seed) is answered then,
    while the step goes on for the other."""
    from concurrent.futures import FIRST_COMPLETED, wait

    with ThreadPoolExecutor(2) as pool:
        both = [_long(pool, server, [1, 5, 6]), _long(pool, server, [1, 9])]
        done, _ = wait(both, timeout=60, return_when=FIRST_COMPLETED)
        state = server_state(server)
        (early,) = done
        later = both[1] if early is both[0] else both[0]
        assert state["running_rows"] == 2 and not later.done()  # the step still runs for the other row
        first, second = early.result().json()["meta_info"], later.result(timeout=60).json()["meta_info"]
    assert first["engine_step"] == second["engine_step"] and first["engine_step_requests"] == 2
    assert first["finish_reason"]["type"] == "stop" and first["completion_tokens"] < second["completion_tokens"]


def test_abort_request_answers_the_running_step_and_holds_nothing(server):
    """SGLang's ``/abort_request`` with ``abort_all`` (what slime's partial rollout sends): the running request is
    answered at once with the tokens and log-probs it had and finish reason ``abort``; unlike an abort pause,
    a request sent after it runs at once."""
    warm = {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}}
    assert server.post("/generate", json=warm).status_code == 200  # the decoder built before a step is cut
    with ThreadPoolExecutor(1) as pool:
        running = _long(pool, server, [1, 5, 6])
        wait_for_state(server, lambda s: s["running_rows"] == 1, "a running step")
        time.sleep(0.1)  # past the prefill: the row has tokens when it is cut
        reply = server.post("/abort_request", json={"abort_all": True})
        assert reply.status_code == 200 and reply.json()["num_aborted_requests"] == 1
        out = running.result(timeout=10).json()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 250
    assert [p[1] for p in meta["output_token_logprobs"]] == out["output_ids"] and len(out["output_ids"]) > 0
    assert not server_state(server)["paused"]
    assert _whole(server.post("/generate", json={**warm, "return_logprob": True}).json())
    assert server.post("/abort_request", json={"rid": "x"}).status_code == 400  # only abort_all


def test_a_stop_string_spanning_a_partial_rollout_pause_ends_the_response_where_it_would_have(server):
    """``--partial-rollout`` over HTTP: a row a pause cut after ``j`` tokens is continued by a request that starts
    there, so the server cannot see a stop string whose first character came before the pause; tidal's HTTP
    engine cuts the whole response at it, giving what one uninterrupted request answers (greedy, so the same
    tokens), each token with its own weight version."""
    engine = http_engine(str(server.base_url).removeprefix("http://"), rollout_engine_api_key=KEY, partial_rollout=True)
    tok, greedy = engine._tok(), SamplingParams(temperature=0.0, max_new_tokens=12)
    fresh = lambda: Sample(index=0, group=0, prompt=None, prompt_ids=[1, 12])  # noqa: E731
    (ref,) = engine.generate([fresh()], greedy)  # 12 tokens without an end token from the fixture's weights
    spans = [
        j
        for j in range(2, len(ref.response_ids) - 1)
        if len(stop := tok.decode(ref.response_ids[j - 1 : j + 1])) == 2
        and stop not in tok.decode(ref.response_ids[:j])
    ]
    assert spans, ref.response_ids
    j = spans[0]
    stop = tok.decode(ref.response_ids[j - 1 : j + 1])  # its first character before the pause, its second after
    with_stop = dataclasses.replace(greedy, stop=[stop])
    (whole,) = engine.generate([fresh()], with_stop)  # no pause: the server ends the response at the stop string
    assert whole.response_ids == ref.response_ids[: j + 1] and whole.status == "completed"

    server.post("/update_weight_version", json={"new_version": "11"})
    # What a pause after j tokens leaves (the HTTP engine's abort tests check that it does): the row aborted with
    # its tokens, log-probs and their version. The next call sends prompt + those j tokens on version 11.
    cut = fresh()
    cut.response_ids, cut.response_logprobs = ref.response_ids[:j], ref.response_logprobs[:j]
    cut.response_text, cut.status, cut.weight_version = tok.decode(cut.response_ids), "aborted", 10
    (out,) = engine.generate([cut], with_stop)
    assert out.response_ids == whole.response_ids and out.status == "completed"
    assert out.response_text == whole.response_text and out.response_text.endswith(stop)
    assert out.response_logprobs == pytest.approx(whole.response_logprobs, abs=1e-4)
    assert out.token_versions == [10] * j + [11] and out.weight_version == 10


def test_update_weights_from_tensor_direct_and_flattened(server):
    weights = _random_weights(1)
    body = {"serialized_named_tensors": [_serialize(weights)], "weight_version": "5", "flush_cache": True}
    r = server.post("/update_weights_from_tensor", json=body)
    assert r.status_code == 200 and r.json()["success"], r.text
    _assert_holds(server, weights)
    assert server.get("/model_info").json()["weight_version"] == "5"

    # The log-probs served are the policy's: a forward pass here over prompt + response, with the weights sent.
    model = _model()
    model.load_state_dict(dict(weights), strict=False)
    prompt = [1, 5, 6, 7]
    out = server.post(
        "/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 6}, "return_logprob": True}
    ).json()
    ids = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    want = logp[len(prompt) - 1 :].gather(1, ids[0, len(prompt) :, None]).squeeze(1)
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, want, atol=1e-4), (got, want)

    # flattened_bucket: one uint8 tensor plus per-tensor metadata (SGLang's FlattenedTensorMetadata fields).
    weights = _random_weights(2)
    flat = torch.cat([t.view(-1).view(torch.uint8) for _, t in weights])
    meta, at = [], 0
    for n, t in weights:
        nb = t.numel() * t.element_size()
        meta.append(FlattenedTensorMetadata(n, t.shape, t.dtype, at, at + nb, t.numel()))
        at += nb
    body = {
        "serialized_named_tensors": [_serialize({"flattened_tensor": flat, "metadata": meta})],
        "load_format": "flattened_bucket",
        "weight_version": "6",
    }
    assert server.post("/update_weights_from_tensor", json=body).json()["success"]
    _assert_holds(server, weights)


class FlattenedTensorMetadata:
    """Stand-in for SGLang's class of this name (the server resolves it by name)."""

    def __init__(self, name, shape, dtype, start_idx, end_idx, numel):
        self.name, self.shape, self.dtype = name, shape, dtype
        self.start_idx, self.end_idx, self.numel = start_idx, end_idx, numel


def test_update_weights_from_disk_and_version(server, tmp_path):
    from safetensors.torch import save_file

    weights = _random_weights(3)
    half = len(weights) // 2
    save_file(dict(weights[:half]), str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(dict(weights[half:]), str(tmp_path / "model-00002-of-00002.safetensors"))
    r = server.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "7"})
    assert r.status_code == 200 and r.json()["success"], r.text
    _assert_holds(server, weights)
    assert server.get("/model_info").json()["weight_version"] == "7"
    out = server.post("/generate", json={"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 1}}).json()
    assert out["meta_info"]["weight_version"] == "7"
    r = server.post("/update_weight_version", json={"new_version": "8"})
    assert r.json()["new_version"] == "8" and server.get("/get_weight_version").json() == {"weight_version": "8"}

    # A full version folder as tidal's disk transport publishes it goes through the engine's own loader,
    # which checks every tensor against the checksum in the shard: one flipped byte refuses the update.
    from tidal.weight_sync.disk import write_full

    again = _random_weights(4)
    folder, _ = write_full(str(tmp_path / "pub"), 9, again, 1 << 30, "xxh3-128")
    shard = next(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    with open(shard, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    r = server.post("/update_weights_from_disk", json={"model_path": folder, "weight_version": "9"})
    assert r.status_code == 400 and not r.json()["success"] and "checksum" in r.json()["message"], r.text
    _assert_holds(server, weights)  # nothing of it applied


def test_update_weights_from_distributed_over_gloo(server):
    import torch.distributed as dist

    weights = _random_weights(4)
    group = "weight_update_group"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    replies = {}

    def post(path, body):
        replies[path] = server.post(path, json=body)

    join = threading.Thread(
        target=post,
        args=("/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
            "group_name": group, "backend": "gloo",
        }),
    )  # fmt: skip
    join.start()
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
    # torch's custom-group key layout, as SGLang's init_custom_process_group forms it; no probe broadcast.
    pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", dist.PrefixStore(f"{group}/", store)), 0, 2, opts)
    join.join()
    assert replies["/init_weights_update_group"].json()["success"]

    body = {
        "names": [n for n, _ in weights],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in weights],
        "shapes": [list(t.shape) for _, t in weights],
        "group_name": group,
        "weight_version": "9",
    }
    update = threading.Thread(target=post, args=("/update_weights_from_distributed", body))
    update.start()
    for _, t in weights:
        pg.broadcast(t.contiguous(), 0).wait()
    update.join()
    assert replies["/update_weights_from_distributed"].json()["success"], replies[
        "/update_weights_from_distributed"
    ].text
    _assert_holds(server, weights)

    # flattened_bucket: one uint8 broadcast of every tensor's bytes back to back.
    # tidal's bucket checksum of the flat buffer travels along and is verified before applying.
    from tidal.weight_sync.bucket import buffer_checksum

    weights = _random_weights(7)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in weights])
    flat_body = {**body, "load_format": "flattened_bucket", "tidal_checksum": buffer_checksum(flat)}
    update = threading.Thread(target=post, args=("/update_weights_from_distributed", flat_body))
    update.start()
    pg.broadcast(flat, 0).wait()
    update.join()
    assert replies["/update_weights_from_distributed"].json()["success"]
    _assert_holds(server, weights)
    assert server.post("/destroy_weights_update_group", json={"group_name": group}).json()["success"]


def test_randomize_weights_changes_every_weight(server):
    before = server.get("/weight_checksums").json()["checksums"]
    assert server.post("/randomize_weights", json={"seed": 3}).json()["success"]
    after = server.get("/weight_checksums").json()["checksums"]
    assert set(after) == set(before) and all(after[n] != before[n] for n in before)


def test_release_resume_then_sync_before_generating(server):
    assert server.post("/release_memory_occupation", json={"tags": None}).json()["residency"] == "ASLEEP"
    r = server.post("/generate", json={"input_ids": [1, 5]})
    assert r.status_code == 400 and "ASLEEP" in r.json()["error"]["message"]
    assert server.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()["residency"] == "WEIGHTS_ONLY"
    assert server.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()["residency"] == "AWAKE"
    r = server.post("/generate", json={"input_ids": [1, 5]})
    assert r.status_code == 400 and "synced" in r.json()["error"]["message"]
    weights = _random_weights(5)
    assert server.post("/update_weights_from_tensor", json={"serialized_named_tensors": [_serialize(weights)]}).json()[
        "success"
    ]
    assert (
        server.post("/generate", json={"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 1}}).status_code
        == 200
    )
    assert server.post("/flush_cache").status_code == 200


def test_openai_endpoints_answer_a_stock_client(server):
    import openai

    client = openai.OpenAI(base_url=str(server.base_url) + "/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    comp = client.completions.create(model="tiny", prompt="12+3=", max_tokens=3, logprobs=0, n=2)
    assert len(comp.choices) == 2 and comp.usage.prompt_tokens == 5
    counts = [len(c.logprobs.tokens) for c in comp.choices]
    assert sum(counts) == comp.usage.completion_tokens and all(1 <= k <= 3 for k in counts)
    assert all(len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) for c in comp.choices)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "2+2"}], max_tokens=3, logprobs=True
    )
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.content) == chat.usage.completion_tokens and all(
        t.logprob <= 0 for t in choice.logprobs.content
    )
    with pytest.raises(openai.BadRequestError, match="serves 'tiny'"):
        client.completions.create(model="other", prompt="1", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(server.base_url) + "/v1", api_key="wrong").models.list()


@pytest.mark.parametrize(
    "path, body, needle",
    [
        ("/generate", {"text": "1", "input_ids": [1]}, "exactly one of text or input_ids"),
        ("/generate", {"input_ids": []}, "empty"),
        ("/generate", {"input_ids": [1, 999]}, "outside the vocabulary"),
        ("/generate", {"input_ids": [1], "sampling_params": {"ignore_eos": True}}, "ignore_eos is not supported"),
        ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
        ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}]}, "one per prompt"),
        ("/generate", {"input_ids": [1], "top_logprobs_num": 5}, "top_logprobs_num"),
        ("/generate", {"input_ids": [1], "stream": True}, "stream"),
        ("/release_memory_occupation", {"tags": ["cuda_graph"]}, "tags"),
        ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "no such directory"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["@@"]}, "not base64"),
        ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}, "init_weights_update_group"),
    ],
)
def test_bad_requests_get_a_clear_400(server, path, body, needle):
    r = server.post(path, json=body)
    assert r.status_code == 400
    j = r.json()
    message = j.get("message") or j["error"]["message"]
    assert needle in message


def test_refused_weight_updates_change_nothing(server):
    before = server.get("/weight_checksums").json()["checksums"]
    weights = _random_weights(6)
    wrong = [(n, t) for n, t in weights[:-1]] + [(weights[-1][0], torch.zeros(3))]
    r = server.post("/update_weights_from_tensor", json={"serialized_named_tensors": [_serialize(wrong)]})
    assert r.status_code == 400 and not r.json()["success"] and "shape" in r.json()["message"]
    sums = {n: _xxh(t) for n, t in weights}
    sums[weights[0][0]] = "0" * 32
    r = server.post(
        "/update_weights_from_tensor", json={"serialized_named_tensors": [_serialize(weights)], "checksums": sums}
    )
    assert r.status_code == 400 and "checksum" in r.json()["message"]
    r = server.post(
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": [_serialize(weights)], "tidal_checksum": "0" * 32},
    )
    assert r.status_code == 400 and "bucket checksum" in r.json()["message"]
    evil = base64.b64encode(b"cos\nsystem\n(S'true'\ntR.").decode()
    r = server.post("/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
    assert r.status_code == 400 and "refused" in r.json()["message"]
    assert server.get("/weight_checksums").json()["checksums"] == before


def test_serve_refuses_a_busy_port_with_one_line(capsys):
    """``tidal serve``'s command (``tidal.cli.main``, in this process: the port is refused before any engine is
    built) exits 2 with one line."""
    import socket

    from tidal.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code = main(["serve", "--port", str(port)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()] and f"--port {port}: cannot listen" in err


def _publish(disk, version: int, weights: dict, old: dict | None) -> None:
    """One version of slime's disk stream: full (old None) or an overwrite delta of the changed bytes, zstd."""
    import json

    import numpy as np
    import zstandard
    from safetensors.torch import save_file

    folder = disk / f"weight_v{version:06d}"
    folder.mkdir()
    tensors, sums = {}, {}
    for name, t in weights.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        sums[name] = xxhash.xxh3_128_hexdigest(raw.tobytes())
        if old is None:
            tensors[name] = t
            continue
        mask = raw != old[name].contiguous().reshape(-1).view(torch.uint8).numpy()
        if mask.any():
            pos = np.flatnonzero(mask).astype("<u4")
            d = np.concatenate([np.array([pos.size], "<u4").view(np.uint8), pos.view(np.uint8), raw[mask]])
            tensors[name] = torch.frombuffer(
                bytearray(zstandard.ZstdCompressor(level=1).compress(d.tobytes())), dtype=torch.uint8
            )
    shard = "model-00000-of-00001.safetensors"
    save_file(tensors, str(folder / shard), metadata={n: sums[n] for n in tensors})
    meta = {"version": f"{version:06d}", "checksum_format": "xxh3-128"}
    if old is not None:
        meta.update(base_version=f"{version - 1:06d}", delta_encoding="overwrite", compression_format="zstd")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": meta, "weight_map": dict.fromkeys(tensors, shard)})
    )


def test_pull_weights_then_load_the_local_checkpoint(server, tmp_path):
    disk, local = tmp_path / "stream", tmp_path / "local"
    disk.mkdir()
    w1 = dict(_random_weights(21))
    w2 = {n: t.clone() for n, t in w1.items()}
    first = next(iter(w2))
    w2[first].view(-1)[:3] += 1.0  # a few changed bytes
    _publish(disk, 1, w1, None)
    _publish(disk, 2, w2, w1)
    r = server.post(
        "/pull_weights", json={"source_dir": str(disk), "local_checkpoint_dir": str(local), "target_version": 2}
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    r = server.post("/update_weights_from_disk", json={"model_path": str(local), "weight_version": "2"})
    assert r.json()["success"], r.text
    _assert_holds(server, list(w2.items()))
    r = server.post(
        "/pull_weights",
        json={"source_dir": str(tmp_path / "none"), "local_checkpoint_dir": str(local), "target_version": 3},
    )
    assert r.status_code == 400 and not r.json()["success"]
