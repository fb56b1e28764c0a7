"""``tidal serve`` on one CUDA GPU: colocated ``update_weights_from_tensor`` through CUDA IPC handles, and
release/resume through the torch_memory_saver backend.

Run on the GPU host: ``pytest -m gpu -s tests/gpu/test_serve_gpu.py``. The server is a separate
process on 127.0.0.1 (bf16 engine, ``--memory-backend tms``); this test process plays the trainer:
it holds bf16 CUDA tensors on the same GPU and sends them in SGLang's form (torch ``ForkingPickler``
bytes, base64; CUDA tensors travel as IPC handles, never as values), then compares the server's
weights bitwise with what it sent. Then the engine worker's cuts on CUDA: a pause that retracts a running
decode, a request joining a running step, an abort pause.
"""

from __future__ import annotations

import base64
import io
import time
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import xxhash
from serve_process import serve_process, server_state, wait_for_state

pytestmark = pytest.mark.gpu

KEY = "gpu-key"
SHAPE = "qwen2.5-0.5b-shape"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--model", SHAPE, "--device", "cuda", "--memory-backend", "tms", "--no-check-memory-plan"]
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with serve_process(args, log, key=KEY, health_s=120.0, timeout=600.0, stop_s=60.0) as client:
        yield client


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    from tidal.model import build_model, resolve_model

    model = build_model(resolve_model(SHAPE), dtype=torch.bfloat16, seed=seed, device="cuda")
    return [(n, p.detach()) for n, p in model.named_parameters()]


def _xxh(t: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())


def _serialize(obj) -> str:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def test_update_weights_from_tensor_over_cuda_ipc(server):
    info = server.get("/model_info").json()
    assert info["dtype"] == "bfloat16" and info["device"].startswith("cuda")
    weights = _weights(11)
    payload = _serialize(weights)
    assert len(payload) < 10 * 2**20  # handles, not the ~1 GB of bf16 values
    t0 = time.perf_counter()
    r = server.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload], "weight_version": "1"})
    print(f"update_weights_from_tensor (CUDA IPC, {len(weights)} tensors): {time.perf_counter() - t0:.3f} s")
    assert r.status_code == 200 and r.json()["success"], r.text
    assert server.get("/weight_checksums").json()["checksums"] == {n: _xxh(t) for n, t in weights}
    out = server.post("/generate", json={"input_ids": [[5, 6, 7, 8]] * 4, "sampling_params": {"max_new_tokens": 8}})
    assert out.status_code == 200 and all(o["meta_info"]["weight_version"] == "1" for o in out.json())


def test_release_resume_through_tms(server):
    weights = _weights(12)
    param_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    rel = server.post("/release_memory_occupation", json={}).json()
    freed = rel["memory/engine_release/device_used_before"] - rel["memory/engine_release/device_used_after"]
    print(
        f"release: {freed / 2**20:.0f} MiB freed (weights {param_bytes / 2**20:.0f} MiB), {rel['memory/engine_release/seconds']:.4f} s"
    )
    assert rel["residency"] == "ASLEEP" and freed >= 0.9 * param_bytes
    assert server.post("/generate", json={"input_ids": [1, 2]}).status_code == 400
    assert server.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()["residency"] == "WEIGHTS_ONLY"
    r = server.post(
        "/update_weights_from_tensor", json={"serialized_named_tensors": [_serialize(weights)], "weight_version": "2"}
    )
    assert r.json()["success"], r.text
    assert server.get("/weight_checksums").json()["checksums"] == {n: _xxh(t) for n, t in weights}
    res = server.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()
    assert res["residency"] == "AWAKE"
    out = server.post("/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8}}).json()
    assert out["meta_info"]["weight_version"] == "2" and out["meta_info"]["completion_tokens"] >= 1


def test_pause_and_rows_joining_a_running_step_on_cuda(server):
    """The engine worker's cuts on CUDA (captured graphs, compiled decode step): a retract pause cuts a running
    1-row decode and, after continue, the row runs on to its full length from the tokens it had; a request
    arriving during a step joins it (``cut_for: admission``); an abort pause answers both with what they had.
    (1000 tokens of the 0.5B shape's 151,936-word vocabulary: an EOS from random weights is rare.)"""
    from concurrent.futures import ThreadPoolExecutor

    def long(prompt):
        sp = {"max_new_tokens": 1000, "temperature": 1.0, "sampling_seed": 5}
        return pool.submit(server.post, "/generate", json={"input_ids": prompt, "sampling_params": sp})

    # One short request first: the first step on a fresh server compiles and captures for longer than the
    # 0.3 s the pause below waits, so the cut would come before the row's first token.
    warm = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 5}
    assert server.post("/generate", json={"input_ids": [11, 12, 13], "sampling_params": warm}).status_code == 200
    with ThreadPoolExecutor(2) as pool:
        try:
            first = long([11, 12, 13])
            wait_for_state(server, lambda s: s["running_rows"] == 1, "a running step")
            time.sleep(0.3)
            assert server.post("/pause_generation", json={"mode": "retract"}).status_code == 200
            cut = server_state(server)["recent_steps"][-1]
            assert (cut["cut_rows"], cut["cut_for"]) == (1, "pause") and 0 < cut["new_tokens"] < 1000
            server.post("/continue_generation")
            meta = first.result(timeout=120).json()["meta_info"]
            step = meta["engine_step"]
            state = wait_for_state(
                server, lambda st: step in {x["step"] for x in st["recent_steps"]}, "the step recorded"
            )
            after = {x["step"]: x for x in state["recent_steps"]}[step]
            print(
                f"retract: cut after {cut['new_tokens']} tokens, {after['new_tokens']} more in {after['seconds']:.3f} s"
            )
            if meta["finish_reason"]["type"] == "length":
                assert meta["completion_tokens"] == 1000 == cut["new_tokens"] + after["new_tokens"]

            second = long([21, 22, 23])
            wait_for_state(server, lambda s: s["running_rows"] == 1, "a running step")
            third = long([31, 32])
            wait_for_state(server, lambda s: s["running_rows"] == 2, "the step both requests run in")
            time.sleep(0.2)
            assert server.post("/pause_generation", json={"mode": "abort"}).json()["num_aborted_requests"] == 2
            b, c = second.result(timeout=60).json()["meta_info"], third.result(timeout=60).json()["meta_info"]
            assert b["finish_reason"]["type"] == c["finish_reason"]["type"] == "abort"
            assert b["engine_step"] == c["engine_step"] and 0 < c["completion_tokens"] < 1000
            joined = {s["step"]: s for s in server_state(server)["recent_steps"]}[b["engine_step"] - 1]
            assert (joined["rows"], joined["cut_for"]) == (1, "admission")
        finally:
            server.post("/continue_generation")
