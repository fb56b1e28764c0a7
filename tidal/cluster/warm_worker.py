"""The worker command of a local cluster: ask the warm process for a forked Ray worker, or start one.

Ray's raylet starts every worker as ``python <worker script> <Ray's worker flags>``; a local
cluster that ``tidal train`` starts names this file as that script (``tidal.cluster.warm``). It
imports only the standard library, so it is up in some 20 ms. It connects to the warm process
(``TIDAL_WARM_SOCKET``), hands over its command line, environment, working directory and its
stdin/stdout/stderr (the raylet's log files), and the warm process forks a child that runs Ray's
worker with torch and the model's modules already imported. This process stays as the raylet's
handle on that worker: it forwards the signals the raylet sends (SIGTERM to stop it) and exits
with the worker's exit status; the worker exits when this process is killed outright.

When the warm process cannot serve the worker (no socket, or an environment that differs from the
one the warm process was started with in a variable that must be set before a process starts:
a runtime env's variables, ``LD_PRELOAD``), this process becomes Ray's own worker instead
(``exec`` of Ray's ``default_worker.py``), exactly as Ray would have started it.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "TIDAL_WARM_SOCKET"  # the warm process's listening socket (a path)
DEFAULT_WORKER_ENV = "TIDAL_WARM_DEFAULT_WORKER"  # Ray's default_worker.py, the fallback
ENV_KEYS_ENV = "TIDAL_WARM_ENV"  # JSON: the variables the warm process was started with (name -> value)
# Variables the raylet sets per worker: they differ from the warm process's and do not matter before start.
PER_WORKER_PREFIXES = ("RAY_", "TIDAL_WARM", "SPT_NOENV", "CUDA_VISIBLE_DEVICES", "OLDPWD", "PWD", "_")
# Variables a fork applies itself (``warm.apply_in_fork``): a worker may set them otherwise and still be a fork.
APPLIED_IN_FORK = ("OMP_NUM_THREADS",)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _fallback(argv: list[str]) -> None:
    worker = os.environ.get(DEFAULT_WORKER_ENV)
    if not worker:
        sys.stderr.write("tidal warm worker: Ray's default_worker.py is unknown (TIDAL_WARM_DEFAULT_WORKER unset)\n")
        raise SystemExit(1)
    os.execv(sys.executable, [sys.executable, worker, *argv])


def thread_count(env: dict[str, str]) -> int:
    """The positive thread count ``env`` sets (``OMP_NUM_THREADS``), 0 where it sets none or something else."""
    threads = env.get("OMP_NUM_THREADS", "")
    return int(threads) if threads.isdigit() else 0


def differing(env: dict[str, str], warm_env: dict[str, str]) -> list[str]:
    """The variables that keep a worker with ``env`` from being a fork of the warm process started
    with ``warm_env``: those set differently in the two, except the ones the raylet sets per worker and
    those a fork applies itself where both set them (``APPLIED_IN_FORK``; a thread count must be a positive
    integer)."""
    keys = set(env) | set(warm_env)

    def applied(k: str) -> bool:
        return k in APPLIED_IN_FORK and k in warm_env and thread_count(env) > 0

    return sorted(
        k for k in keys if env.get(k) != warm_env.get(k) and not k.startswith(PER_WORKER_PREFIXES) and not applied(k)
    )


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def main(argv: list[str]) -> int:
    path = os.environ.get(SOCKET_ENV)
    try:
        warm_env = json.loads(os.environ.get(ENV_KEYS_ENV, "null"))
    except ValueError:
        warm_env = None
    if not path or not isinstance(warm_env, dict):
        _fallback(argv)
    if differing(dict(os.environ), warm_env):
        _fallback(argv)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        fds = array.array("i", [0, 1, 2])
        conn.sendmsg([struct.pack("!I", len(request)), request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        reply = _recv_exact(conn, 4)
    except OSError:
        reply = b""
    if len(reply) != 4:
        conn.close()
        _fallback(argv)  # the warm process is gone: be Ray's worker ourselves
    (child,) = struct.unpack("!i", reply)

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for s in FORWARDED:
        signal.signal(s, forward)
    status = _recv_exact(conn, 4)  # the worker's exit status, when it exits
    return exit_as(struct.unpack("!i", status)[0] if len(status) == 4 else 1)


def exit_as(code: int) -> int:
    """End as the worker ended, for the raylet to see: killed by the same signal (a negative ``code``), else
    returning its exit code. A signal this script forwards has a handler here, reset first; SIGKILL has none
    and cannot be given one."""
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL: no handler to reset
            pass
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
