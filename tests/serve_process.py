"""A ``tidal serve`` subprocess for tests: started on 127.0.0.1 and a free port, an httpx client once
``/health`` answers, and the server's own log printed afterwards (pytest shows it when a test failed).

Shared by ``tests/unit/test_serve.py`` (CPU) and ``tests/gpu/test_serve_gpu.py`` (CUDA); importable from
both because pytest puts the folder of ``tests/conftest.py`` on the path (its default import mode). Also here:
reading the engine worker's state from ``/server_info`` and waiting for one, and an ``HttpEngineActor`` pointed
at a server (used by those tests and by ``tests/unit/test_http_engine.py``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def serve_process(
    args, log_path, *, key, env_extra=None, health_s=20.0, timeout=60.0, stop_s=20.0, step_delay_s: float = 0.0
):
    """Run ``python -m tidal serve --port 0 ARGS`` with the key in ``TIDAL_SERVE_API_KEY`` (as a run starts its
    servers); yield a client bound to it. ``step_delay_s``: every decode step that much longer (``slow_steps``)."""
    tests = os.path.join(REPO, "tests")
    path = os.pathsep.join(p for p in (REPO, tests, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "TIDAL_SERVE_API_KEY": key, **(env_extra or {})}
    main = ["slow_steps", str(step_delay_s)] if step_delay_s else ["tidal"]
    cmd = [sys.executable, "-m", *main, "serve", *args, "--port", "0"]
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            line = proc.stdout.readline()
            assert line.startswith("tidal serve: listening on http://127.0.0.1:"), (line, log.seek(0) or log.read())
            client = httpx.Client(
                base_url=line.split()[-1], headers={"Authorization": f"Bearer {key}"}, timeout=timeout
            )
            deadline = time.monotonic() + health_s
            while time.monotonic() < deadline:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            try:
                yield client
            finally:
                client.close()
        finally:
            proc.terminate()
            proc.wait(timeout=stop_s)
            log.seek(0)
            print(log.read()[-4000:])  # the server's own log, shown when a test failed


def server_state(client) -> dict:
    """The engine worker's ``internal_states`` entry of ``/server_info``."""
    return client.get("/server_info").json()["internal_states"][0]


def wait_for_state(client, pred, what: str, timeout_s: float = 30.0) -> dict:
    """Poll ``server_state`` until ``pred`` holds for it (returned), failing after ``timeout_s`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = server_state(client)
        if pred(state):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"the server never had {what}: {state}")
        time.sleep(0.01)


def http_engine(address: str, **rollout):
    """A started ``HttpEngineActor`` (rank 0, CPU, default sections) for the server at ``address``."""
    from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig, WeightSyncConfig
    from tidal.rollout.http_engine import HttpEngineActor

    r = RolloutConfig(rollout_engine="sglang", rollout_external_engine_addrs=[address], **rollout)
    eng = HttpEngineActor(
        0,
        model=ModelConfig(),
        rollout=r,
        memory=MemoryConfig(),
        weight_sync=WeightSyncConfig(),
        device="cpu",
        address=address,
    )
    eng.init()
    return eng
