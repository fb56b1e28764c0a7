"""A ``tidal serve`` subprocess for tests: started on 127.0.0.1 and a free port, an httpx client once
``/health`` answers, and the server's own log printed afterwards (pytest shows it when a test failed).

Shared by ``tests/unit/test_serve.py`` (CPU) and ``tests/gpu/test_serve_gpu.py`` (CUDA); importable from
both because pytest puts the folder of ``tests/conftest.py`` on the path (its default import mode).
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
def serve_process(args, log_path, *, key, env_extra=None, health_s=20.0, timeout=60.0, stop_s=20.0):
    """Run ``python -m tidal serve --port 0 ARGS`` with the key in ``TIDAL_SERVE_API_KEY`` (as a run starts its
    servers); yield a client bound to it."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "TIDAL_SERVE_API_KEY": key, **(env_extra or {})}
    cmd = [sys.executable, "-m", "tidal", "serve", *args, "--port", "0"]
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
