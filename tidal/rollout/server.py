"""Engine servers that tidal starts itself: ``tidal serve`` (default) or SGLang's ``launch_server``.

With ``--rollout-engine sglang`` and no ``--rollout-external-engine-addrs``, every HTTP engine actor
starts one server process in its own placement-group bundle (so the server inherits the bundle's
device through ``CUDA_VISIBLE_DEVICES``), on 127.0.0.1 and a free port, and waits for ``/health``.

The command line:

    tidal serve     python -m tidal serve <the engine's model, rollout, memory and weight-sync flags
                    that differ from their defaults> --device D --seed S --host 127.0.0.1 --port 0
                    (it binds a free port and prints it: ``tidal serve: listening on http://H:P``)
    sglang          python -m sglang.launch_server --model-path M [--tokenizer-path T]
                    [--trust-remote-code] --host 127.0.0.1 --port P --random-seed S
                    [--enable-memory-saver] [--dtype bfloat16] <every --sglang-X flag as --X>

(``--sglang-mem-fraction-static 0.7`` reaches SGLang as ``--mem-fraction-static 0.7``, as slime
passes its ``--sglang-*`` flags on.) ``server_command`` is pure and unit-tested; a real SGLang
server is not run in tidal's tests. The server's output goes to a log file whose last lines are
quoted when it exits before answering.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import fields

from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig, WeightSyncConfig
from tidal.errors import UserError

# The API key of a tidal serve process, when not given as --api-key (so that it does not show in ps).
API_KEY_ENV = "TIDAL_SERVE_API_KEY"

# Rollout fields that describe the engine itself (the rest are the driver's: batch sizes, sampling, ...).
ENGINE_ROLLOUT_FIELDS = (
    "rollout_seed",
    "rollout_fast_decode",
    "rollout_mem_fraction",
    "rollout_cuda_graphs",
    "rollout_max_batch",
    "rollout_kv_block",
    "rollout_compile",
    "rollout_compile_options",
    "rollout_prefix_cache_mb",  # multi-turn: the server keeps prompt KV between turns too
    "rollout_fused_decode",
    "rollout_fused_kv_write",
    "rollout_decode_attention",
)


def section_flags(section: object, names: tuple[str, ...] | None = None) -> list[str]:
    """Flags that reproduce the fields of a config section that differ from their defaults."""
    from tidal.config.args import flag_of

    out: list[str] = []
    defaults = type(section)()
    for f in fields(section):
        if names is not None and f.name not in names:
            continue
        value, default = getattr(section, f.name), getattr(defaults, f.name)
        if value == default or value is None:
            continue
        flag = flag_of(f.name)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def server_command(
    kind: str,
    *,
    model: ModelConfig,
    rollout: RolloutConfig,
    memory: MemoryConfig,
    weight_sync: WeightSyncConfig,
    device: str,
    seed: int,
    port: int,
    host: str = "127.0.0.1",
) -> list[str]:
    """The argv that starts one engine server (``kind``: tidal or sglang). The key of a tidal server is
    not on it (``server_env``: argv shows in ``ps``); SGLang's server takes it only as ``--api-key``."""
    key = ["--api-key", rollout.rollout_engine_api_key] if rollout.rollout_engine_api_key else []
    if kind == "tidal":
        return [
            sys.executable,
            "-m",
            "tidal",
            "serve",
            *section_flags(model),
            *section_flags(rollout, ENGINE_ROLLOUT_FIELDS),
            *section_flags(memory),
            *section_flags(weight_sync),
            "--device",
            device,
            "--seed",
            str(seed),
            "--host",
            host,
            "--port",
            str(port),
        ]
    if kind == "sglang":
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model.model]
        if model.tokenizer:
            cmd += ["--tokenizer-path", model.tokenizer]
        if model.trust_remote_code:
            cmd.append("--trust-remote-code")
        cmd += ["--host", host, "--port", str(port), "--random-seed", str(seed)]
        if memory.offload_rollout:
            cmd.append("--enable-memory-saver")  # release/resume_memory_occupation need it
        if device == "cuda":
            cmd += ["--dtype", "bfloat16"]  # the trainer sends weights in the engine dtype
        return cmd + key + list(rollout.sglang_server_args)
    raise ValueError(f"unknown server kind {kind!r}; use tidal or sglang")


def server_env(kind: str, rollout: RolloutConfig) -> dict[str, str]:
    """Environment variables the server gets on top of ours: the API key of a tidal server
    (``TIDAL_SERVE_API_KEY``, which ``tidal serve`` reads when ``--api-key`` is not given)."""
    if kind == "tidal" and rollout.rollout_engine_api_key:
        return {API_KEY_ENV: rollout.rollout_engine_api_key}
    return {}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the engine actor that started it dies (Linux prctl)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    """One started engine server: its process, address and log file."""

    def __init__(self, engine_rank: int, model, rollout, memory, weight_sync, *, device: str, seed: int):
        self.engine_rank = engine_rank
        self.kind = rollout.sglang_server
        self.sections = dict(model=model, rollout=rollout, memory=memory, weight_sync=weight_sync)
        self.device, self.seed = device, seed
        self.proc: subprocess.Popen | None = None
        self.log_path = ""

    def start(self, timeout_s: float) -> str:
        """Start the server and wait until ``/health`` answers 200; returns host:port."""
        import httpx

        # tidal serve binds a free port itself and prints it; SGLang gets one picked here.
        port = 0 if self.kind == "tidal" else free_port()
        cmd = server_command(self.kind, **self.sections, device=self.device, seed=self.seed, port=port)
        fd, self.log_path = tempfile.mkstemp(prefix=f"tidal-engine-{self.engine_rank}-", suffix=".log")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **server_env(self.kind, self.sections["rollout"])}
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=_die_with_parent
            )
        address = f"127.0.0.1:{port}" if port else None
        key = self.sections["rollout"].rollout_engine_api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UserError(
                    f"engine {self.engine_rank}: `{' '.join(cmd[1:4])} ...` exited with code {self.proc.returncode} "
                    f"before answering /health: {self.last_line()} (log: {self.log_path})"
                )
            address = address or self.listening()
            try:
                if address and httpx.get(f"http://{address}/health", headers=headers, timeout=2.0).status_code == 200:
                    return address
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise UserError(
            f"engine {self.engine_rank}: the server on {address} did not answer /health within {timeout_s:.0f} s "
            f"(log: {self.log_path}); raise --engine-start-timeout or read the log"
        )

    def listening(self) -> str | None:
        """host:port from tidal serve's ``tidal serve: listening on http://HOST:PORT`` line, once printed."""
        try:
            with open(self.log_path, errors="replace") as f:
                for line in f:
                    if line.startswith("tidal serve: listening on http://"):
                        return line.split("http://", 1)[1].strip().rstrip("/")
        except OSError:
            pass
        return None

    def last_line(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [ln.strip() for ln in f if ln.strip()]
        except OSError:
            return "no output"
        return lines[-1] if lines else "no output"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Terminate the server (its whole session), then kill it if it does not exit within 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
