"""Stand-ins for the two agents Ray's raylet starts on a local CPU cluster: light until they are needed.

Every raylet starts a dashboard agent and a runtime-env agent, each a Python process that imports
Ray (~1 s of CPU each on a small host), and registers its node only once both have written their
ports into the session folder. A lean cluster (``ray_cluster.lean_head``, no dashboard) runs the
dashboard agent ``--minimal``: it writes -1 for its ports (no metrics agent, no HTTP server) and
then only waits for the raylet to exit. The runtime-env agent serves one thing: setting up an actor's
or a job's runtime env (none of a run whose actors take the warm process's workers has one).

On a cluster ``tidal train`` starts with a warm process, the raylet runs this script instead:

- ``dashboard``: writes the three ports as the minimal agent does (-1, in Ray's port-file format),
  then waits for the raylet to exit, the minimal agent's whole job;
- ``runtime-env``: binds the port as the agent would and writes it; on the first connection (the
  raylet needs a runtime env) it becomes the real agent (``exec`` of Ray's own command, on the same
  port), whose start the raylet waits for as it waits for a slow agent.

Standard library only, like ``warm_worker.py``: up in some 20 ms. ``ray_cluster.light_agents`` puts
them in the raylet's command line (``standin_command``) when the Ray in use writes its port files the
way ``persist_port`` does here; otherwise the agents stay Ray's.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time

# The port files these stand-ins write, and the Ray releases whose raylet reads them that way
# (``{name}_{node_id}``, the decimal port as the whole content).
DASHBOARD_PORTS = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")
RUNTIME_ENV_PORT = "runtime_env_agent_port"
# The raylet's flags that carry each agent's command line (one string, split as a shell splits words).
AGENT_FLAGS = {"--dashboard_agent_command=": "dashboard", "--runtime_env_agent_command=": "runtime-env"}


def standin_command(raylet_argv: list[str], python: str = sys.executable) -> list[str]:
    """The raylet's command line with each agent's command run through this script. The dashboard agent
    only when it is the minimal one (a dashboard's agent serves metrics and HTTP: it stays Ray's)."""
    out = []
    for arg in raylet_argv:
        for flag, kind in AGENT_FLAGS.items():
            if arg.startswith(flag):
                agent = arg[len(flag) :]
                if kind == "runtime-env" or "--minimal" in shlex.split(agent):
                    arg = f"{flag}{subprocess.list2cmdline([python, os.path.abspath(__file__), kind, '--'])} {agent}"
        out.append(arg)
    return out


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name=value`` (or ``--name value``) in ``argv``."""
    for i, a in enumerate(argv):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def persist_port(session_dir: str, node_id: str, name: str, port: int) -> None:
    """Write ``port`` where the raylet waits for it, whole or not at all (the raylet polls for the file)."""
    path = os.path.join(session_dir, f"{name}_{node_id}")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)


def wait_for_parent() -> None:
    """Until the raylet (the parent) exits: the agents share its fate, and it stops them with SIGTERM."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)


def dashboard(agent_argv: list[str]) -> int:
    session_dir, node_id = _flag(agent_argv, "session-dir"), _flag(agent_argv, "node-id")
    if not session_dir or not node_id:
        sys.stderr.write("tidal dashboard agent stand-in: no --session-dir/--node-id in the agent's command\n")
        return 1
    for name in DASHBOARD_PORTS:
        persist_port(session_dir, node_id, name, -1)
    wait_for_parent()
    return 0


def runtime_env(agent_argv: list[str]) -> int:
    """Bind the agent's port and write it, then on the first connection exec Ray's agent on that port."""
    session_dir, node_id = _flag(agent_argv, "session-dir"), _flag(agent_argv, "node-id")
    host = _flag(agent_argv, "node-ip-address")
    if not session_dir or not node_id or not host:
        sys.stderr.write("tidal runtime-env agent stand-in: no --session-dir/--node-id/--node-ip-address\n")
        return 1
    port = int(_flag(agent_argv, "runtime-env-agent-port") or 0)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(16)
    port = listener.getsockname()[1]
    persist_port(session_dir, node_id, RUNTIME_ENV_PORT, port)
    conn, _ = listener.accept()  # the raylet needs a runtime env: it retries until the real agent answers
    conn.close()
    listener.close()
    argv = [a for a in agent_argv if not a.startswith("--runtime-env-agent-port")]
    os.execv(argv[0], [*argv, f"--runtime-env-agent-port={port}"])
    return 1  # not reached


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in ("dashboard", "runtime-env") or argv[1] != "--":
        sys.stderr.write("usage: ray_agents.py dashboard|runtime-env -- AGENT COMMAND...\n")
        return 2
    return dashboard(argv[2:]) if argv[0] == "dashboard" else runtime_env(argv[2:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
