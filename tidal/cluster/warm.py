"""A warm process that forks Ray's workers with torch and the model's modules already imported.

Every actor of a run is a Ray worker process, and each imports torch, transformers' model code
(which pulls in ``torch._dynamo``, ``torch.distributed.tensor`` and sympy) and tidal's actor
modules: ~5-6 s of CPU per process on a small host (~15 s on the H100 hosts), paid once per actor, on
the cores the actors then share. A local cluster that ``tidal train`` starts pays it once instead: the driver starts
one warm process (``WarmProcess.start``) as it starts Ray; it imports those modules once, then
forks a child per Ray worker, which runs Ray's own ``default_worker.py`` unchanged with the imports
done (copy-on-write: the children share the imported code's memory too). What only one kind of
actor needs (``ray_cluster.ONE_ACTOR_ONLY``) each child imports itself, beside the others: the
warm process's imports are the start's critical path, since the actors wait for the forks (transformers'
index of its lazy modules is read from a file there: ``tidal.cluster.transformers_index``).

How Ray reaches it: the raylet's worker command names ``tidal/cluster/warm_worker.py`` instead of
Ray's ``default_worker.py`` (``worker_command``, while ``ray.init`` starts the raylet). That small
script hands its command line, environment and standard streams to this process over a Unix
socket and stays as the raylet's handle on the forked worker (signals forwarded, exit status
returned, and the worker killed here should the handle be killed outright); a worker whose environment
must be set before its process starts (a runtime env's variables, ``LD_PRELOAD`` for torch_memory_saver) is
started by Ray as usual, except for a thread count (``OMP_NUM_THREADS``), which a fork sets itself
(``apply_in_fork``). The socket listens before Ray starts: the workers Ray starts for the actors wait for the
imports instead of doing their own.

Only on a cluster started here with embedded engines (``--warm-process auto``, the default, or ``on``), CPU or
GPU: the warm process imports torch and the model's code without touching CUDA (each fork initialises it as its actor's GPU is known), and an actor whose environment must be set before
its process starts (torch_memory_saver's ``LD_PRELOAD``) is started by Ray as usual. ``--ray-address``
(joining a cluster) changes nothing.
The warm process stops with the driver (a pipe from it closes) or at ``stop``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tidal.cluster.warm_worker import DEFAULT_WORKER_ENV, ENV_KEYS_ENV, SOCKET_ENV, thread_count

log = logging.getLogger(__name__)

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_worker.py")


def ray_default_worker() -> str:
    """Ray's worker script (what the raylet runs without a warm process), found without importing Ray."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    root = list(spec.submodule_search_locations or [])[0] if spec else ""
    return os.path.join(root, "_private", "workers", "default_worker.py")


@dataclass
class WarmProcess:
    """The driver's handle: the warm process, its socket's folder and the pipe that keeps it alive."""

    proc: subprocess.Popen
    folder: str
    socket_path: str
    alive_w: int  # closing it (or the driver dying) stops the warm process

    @classmethod
    def start(cls, modules: Sequence[str]) -> WarmProcess:
        """Listen on a fresh socket, then start the warm process on it (it imports ``modules``).

        Call with the workers' environment in ``os.environ``: the warm process is started with it,
        and forks only for workers whose environment matches (``env``)."""
        folder = tempfile.mkdtemp(prefix="tidal-warm-")
        path = os.path.join(folder, "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(64)
        except OSError:
            listener.close()
            os.rmdir(folder)
            raise
        alive_r, alive_w = os.pipe()
        cmd = [sys.executable, "-m", "tidal.cluster.warm", path, str(listener.fileno()), str(alive_r), *modules]
        try:
            proc = subprocess.Popen(cmd, pass_fds=(listener.fileno(), alive_r), stdin=subprocess.DEVNULL)
        finally:
            listener.close()
            os.close(alive_r)
        return cls(proc=proc, folder=folder, socket_path=path, alive_w=alive_w)

    def env(self) -> dict[str, str]:
        """What every Ray worker's environment needs so that ``warm_worker.py`` finds this process."""
        started_with = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_WARM")}
        return {
            SOCKET_ENV: self.socket_path,
            DEFAULT_WORKER_ENV: ray_default_worker(),
            ENV_KEYS_ENV: json.dumps(started_with),
        }

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.alive_w)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
            os.rmdir(self.folder)


@contextlib.contextmanager
def worker_command() -> Iterator[None]:
    """While ``ray.init`` starts the raylet, its worker script is ``warm_worker.py`` (Ray's
    ``default_worker.py`` stays the fallback). Should a Ray release rename the method, nothing is
    patched and Ray starts its workers as it always did."""
    from ray._private.node import Node

    original = Node.__dict__.get("start_raylet")
    if original is None:
        yield
        return

    def start_raylet(self, *args, **kwargs):
        self._ray_params.worker_path = WORKER_SCRIPT
        return original(self, *args, **kwargs)

    Node.start_raylet = start_raylet
    try:
        yield
    finally:
        Node.start_raylet = original


# ---- the warm process ----------------------------------------------------------------------------


@dataclass
class _Request:
    conn: socket.socket
    argv: list[str]
    env: dict[str, str]
    cwd: str
    fds: list[int]


def _receive(conn: socket.socket) -> _Request | None:
    """One worker's request: a length-prefixed JSON (argv, env, cwd) with its three standard streams."""
    fds: list[int] = []
    head, ancdata, _, _ = conn.recvmsg(4, socket.CMSG_SPACE(3 * 4))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4]))
    if len(head) != 4 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None
    (size,) = struct.unpack("!I", head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            break
        body += chunk
    try:
        msg = json.loads(body)
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        for fd in fds:
            os.close(fd)
        return None
    return _Request(conn, list(msg["argv"]), dict(msg["env"]), str(msg["cwd"]), fds)


def _become_worker(req: _Request, default_worker: str) -> None:
    """In the forked child: the worker's own streams, environment, folder and session, then Ray's worker."""
    import runpy
    import threading

    os.setsid()  # its own process group, as the raylet gives every worker
    for i, fd in enumerate(req.fds):
        os.dup2(fd, i)
        os.close(fd)
    os.environ.clear()
    os.environ.update(req.env)
    apply_in_fork(req.env)
    os.chdir(req.cwd)

    def exit_with_handle() -> None:
        """The handle (``warm_worker.py``) was killed outright: so is this worker."""
        with contextlib.suppress(OSError):
            req.conn.recv(1)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=exit_with_handle, daemon=True, name="warm-handle").start()
    sys.argv = [default_worker, *req.argv]
    runpy.run_path(default_worker, run_name="__main__")


def apply_in_fork(env: dict[str, str]) -> None:
    """What a fork sets itself of its worker's environment (``warm_worker.APPLIED_IN_FORK``): OpenMP read the warm
    process's ``OMP_NUM_THREADS`` as torch was imported there, so a worker told another count sets it through
    torch (OpenMP's and torch's own pools; none of them has started a thread in the warm process)."""
    threads, torch = thread_count(env), sys.modules.get("torch")
    if torch is not None and threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def serve(listen_fd: int, alive_fd: int, modules: Sequence[str]) -> _Request | None:
    """Import ``modules``, then fork one worker per request until the driver's pipe closes.

    Returns the request in a forked child (the caller turns into that worker, outside this loop),
    None in the warm process when it is done."""
    listener = socket.socket(fileno=listen_fd)
    # No collections while importing (each full pass walks every object imported so far), and what is
    # imported is then frozen out of the collector: a forked worker's gc.collect() (every actor runs one
    # as it starts) scans only what it made itself, ~0.3 s less each, and touches none of the pages it
    # shares with this process.
    gc.disable()
    from tidal.cluster import transformers_index

    transformers_index.install()  # transformers' index of its modules from a file, not ~0.6 s of reading its sources
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that fails here fails again, visibly, in the actor
            log.debug("warm process: importing %s failed", name, exc_info=True)
    gc.freeze()
    gc.enable()
    if "ray" in sys.modules:
        # Ray's C++ config reads the process's environment once, when it is first used: a worker
        # forked after that would keep this process's values (its job, its node). Serve nobody;
        # the workers start as Ray starts them.
        sys.stderr.write("tidal warm process: a preloaded module imported ray; workers start without it\n")
        return None
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the run through the driver
    children: dict[int, socket.socket] = {}
    while True:
        handles = {conn: pid for pid, conn in children.items()}
        ready, _, _ = select.select([listener, alive_fd, wake_r, *handles], [], [])
        if alive_fd in ready:
            return None
        _kill_orphans([handles[c] for c in ready if c in handles])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
            _reap(children)
        if listener in ready:
            conn, _ = listener.accept()
            conn.settimeout(10.0)  # a handle sends its request at once; one that does not is dropped
            try:
                req = _receive(conn)
            except (OSError, ValueError, KeyError, TypeError):
                req = None
            if req is None:
                conn.close()
                continue
            conn.settimeout(None)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # SIGINT stays ignored, as in every Ray worker of a cluster tidal starts
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w, alive_fd):
                    os.close(fd)
                listener.close()
                for other in children.values():
                    other.close()
                return req
            for fd in req.fds:
                os.close(fd)
            children[pid] = conn
            with contextlib.suppress(OSError):
                conn.sendall(struct.pack("!i", pid))


def _kill_orphans(pids: list[int]) -> None:
    """Workers whose handle's connection became readable: a handle sends nothing, so its end closed (the raylet
    killed it outright). Each worker is killed here too: its own thread that waits for the same (``_become_worker``)
    cannot run while the worker is stopped or holds the GIL in a hung call. Its exit is reaped as any other."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _reap(children: dict[int, socket.socket]) -> None:
    """Send each exited worker's status to its handle."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        with contextlib.suppress(OSError):
            conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
        conn.close()


def _main(argv: list[str]) -> None:
    path, listen_fd, alive_fd, modules = argv[0], int(argv[1]), int(argv[2]), argv[3:]
    default_worker = ray_default_worker()
    try:
        req = serve(listen_fd, alive_fd, modules)
    except Exception:  # noqa: BLE001 - the workers fall back to Ray's own start
        traceback.print_exc()
        req = None
    if req is not None:
        _become_worker(req, default_worker)
        return
    with contextlib.suppress(OSError):  # the driver may be gone without a word: leave nothing behind
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
    # Out without the interpreter's teardown: freeing torch's and transformers' modules took ~1 s of CPU
    # at the end of every run, and the driver waits for this process to exit.
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main(sys.argv[1:])
