"""Start a local Ray cluster or join an existing one, and always shut it down.

``tidal train`` starts Ray on the local machine by default (CPUs and GPUs it can see), or joins
the cluster at ``--ray-address``. Ray is started with logical CPUs at least as many as the actors
ask for, so a 2-core laptop can host a trainer group and engines that share cores.

A cluster started here is a lean one: Ray's head starts an autoscaler monitor and a dashboard head
process (even with the dashboard off: its usage-stats module) and waits for the latter to publish
its address before it starts the raylet. A local cluster of fixed size uses neither, and on a
2-core host they cost ~2 s of CPU at every start and ~1 s at every stop (``lean_head``). The
raylet, the log monitor (actor output on the console) and the object store are Ray's as usual; on a cluster with a
warm process the raylet's two agents are light stand-ins (``light_agents``, ``tidal.cluster.ray_agents``: ~2 s of
CPU less at every start). Joining a cluster (``--ray-address``) changes nothing there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence

from tidal.errors import UserError

log = logging.getLogger(__name__)

# Preloaded modules that import Ray: Ray's workers import them themselves (tidal.cluster.warm says why).
RAY_IMPORTING = ("tidal.rollout.actor",)
# Modules only one kind of actor needs: a forked worker imports its own, beside the others, rather than the warm
# process importing all of them first (its imports are the start's critical path: the actors wait for the forks).
ONE_ACTOR_ONLY = ("tidal.rollout.embedded", "torch.distributed.fsdp", "tidal.trainer.actor")
IDLE_WORKER_KEEP_MS = 60_000
# How much lower than the warm process the rest of the start runs (``yield_to_warm``): nice 5 weighs a third of nice 0.
START_NICE = 5
_warm = None  # the warm process of the cluster started here (tidal.cluster.warm), if any
# The cluster start_ray started here: its GCS address and the environment every one of its workers has.
_started: tuple[str, dict[str, str]] | None = None

# Environment every tidal process should see; set before Ray starts so actors inherit it.
BASE_ENV = {
    "RAY_AUTH_MODE": "disabled",  # otherwise Ray writes a token file and warns on every start
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "0",
}


def start_ray(
    address: str | None,
    *,
    num_cpus: float,
    num_gpus: int,
    worker_env: dict[str, str] | None = None,
    preload: Sequence[str] = (),
) -> bool:
    """Start or join Ray. Returns True when this process started the cluster (and must stop it).

    A cluster started here gets ``worker_env`` in the environment of its processes (so every worker
    has it without a runtime env). With a warm process (``start_warm``) its workers are forks of it, started
    as the actors ask for them; without one it prestarts its workers with the ``preload`` modules imported
    (``local_system_config``). Joining a cluster changes none of this.
    """
    import ray

    _set_base_env()
    if ray.is_initialized():
        return False
    if address:
        try:
            ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=True)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise UserError(
                f"--ray-address {address}: cannot join the Ray cluster ({e}); start one with `ray start --head` or drop the flag"
            ) from e
        return False
    logical_cpus = max(float(os.cpu_count() or 1), num_cpus)
    from tidal.signals import shielded

    # address="local" starts a new cluster even when another one runs here (joining is --ray-address's job).
    # Shielded: Ray's processes ignore SIGINT, so Ctrl-C stops the run through the driver alone.
    with shielded(), _environ(worker_env or {}):
        if _warm is not None:
            import ray._private.services  # noqa: F401 - where ray_processes_below_warm finds Ray's Popen

            with _environ(_warm.env()), ray_processes_below_warm(), light_agents():
                _init_local(logical_cpus, num_gpus, [], warm=True)
        else:
            _init_local(logical_cpus, num_gpus, list(preload))
    global _started
    _started = (ray.get_runtime_context().gcs_address, dict(worker_env or {}))
    log.info("started a local Ray cluster: %d CPUs, %d GPUs", int(logical_cpus), num_gpus)
    return True


def started_cluster_env() -> dict[str, str] | None:
    """The environment every worker of the cluster this process is connected to has, where ``start_ray`` started
    that cluster here (and it still runs); None for a cluster joined, or started by anything else. A session in
    a process that keeps one cluster across runs (a test session's) then creates the actors that need nothing
    more without a runtime env, as on a cluster it started itself: they take the warm process's forks."""
    import ray

    if _started is None or not ray.is_initialized():
        return None
    address, env = _started
    return dict(env) if ray.get_runtime_context().gcs_address == address else None


def start_warm(
    address: str | None, worker_env: dict[str, str], preload: Sequence[str], *, forks_import: bool = True
) -> bool:
    """Start the warm process (``tidal.cluster.warm``) for the local cluster ``start_ray`` will start,
    as early as possible: it imports ``preload`` while the driver starts Ray. Only for a cluster
    started here, on Linux, with modules to preload (``prestart_modules``; none with ``--warm-process off``).
    ``forks_import``: the modules only one kind of actor needs (``ONE_ACTOR_ONLY``) are left to the forks; off,
    the warm process imports them too, for a cluster that outlives many runs (a test session's), whose start
    is not on any run's path. Returns whether it started one; ``stop_ray`` stops it."""
    global _warm
    ray = sys.modules.get("ray")  # not imported for this: the warm process should start first
    if address or not preload or _warm is not None or not sys.platform.startswith("linux"):
        return False
    if ray is not None and ray.is_initialized():
        return False
    from tidal.cluster.warm import WarmProcess
    from tidal.signals import shielded

    _set_base_env()
    try:
        with shielded(), _environ(worker_env):
            skip = RAY_IMPORTING + (ONE_ACTOR_ONLY if forks_import else ())
            _warm = WarmProcess.start([m for m in preload if m not in skip])
    except OSError as e:  # e.g. a temp folder whose path is too long for a Unix socket: Ray starts the workers
        log.info("no warm process (%s); Ray starts each worker itself", e)
        return False
    return True


def below_warm() -> int | None:
    """The nice value that the rest of the start takes while the warm process imports (None: no warm process).

    Its imports are the start's critical path. On 2 cores the driver's inputs (torch's import), Ray's head and
    its agents otherwise take half of its core; ``START_NICE`` lower they share the second core and leave it the
    first. On Linux a nice value is a thread's own, inherited by what it starts, and it cannot be lowered again:
    only the driver's inputs thread (``yield_to_warm``, it ends) and Ray's processes (``ray_processes_below_warm``,
    their work between steps is small) take it, never the driver's main thread, on the steps' path."""
    if _warm is None:
        return None
    try:
        return min(19, os.getpriority(os.PRIO_PROCESS, _warm.proc.pid) + START_NICE)
    except OSError:
        return None


def yield_to_warm() -> None:
    """The calling thread (one that ends after the start) runs below the warm process (``below_warm``)."""
    nice = below_warm()
    with contextlib.suppress(OSError):
        if nice is not None and os.getpriority(os.PRIO_PROCESS, 0) < nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)


@contextlib.contextmanager
def ray_processes_below_warm() -> Iterator[None]:
    """The processes ``ray.init`` starts (its head, the raylet, and through it the agents) run below the warm
    process (``below_warm``). Should a Ray release rename the class it starts them with, they run as before."""
    nice = below_warm()
    services = sys.modules.get("ray._private.services")
    popen = getattr(services, "ConsolePopen", None)
    if nice is None or not isinstance(popen, type):
        yield
        return

    class Lowered(popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, self.pid, max(nice, os.getpriority(os.PRIO_PROCESS, self.pid)))

    services.ConsolePopen = Lowered
    try:
        yield
    finally:
        services.ConsolePopen = popen


@contextlib.contextmanager
def light_agents() -> Iterator[None]:
    """The raylet that ``ray.init`` starts runs ``tidal.cluster.ray_agents``'s stand-ins for its agents (the
    minimal dashboard agent's job without importing Ray; the runtime-env agent once a runtime env is needed):
    ~2 s of CPU less at every start, and the node registers without waiting for them. Only where this Ray
    writes its port files as the stand-ins do (``port_files_fit``); otherwise, or should a Ray release
    rename the class it starts its processes with, the agents are Ray's."""
    services = sys.modules.get("ray._private.services")
    popen = getattr(services, "ConsolePopen", None)
    if not isinstance(popen, type) or not port_files_fit():
        yield
        return
    from tidal.cluster.ray_agents import standin_command

    class WithStandins(popen):
        def __init__(self, args, *rest, **kwargs):
            if isinstance(args, list) and args and os.path.basename(str(args[0])) == "raylet":
                args = standin_command([str(a) for a in args])
            super().__init__(args, *rest, **kwargs)

    services.ConsolePopen = WithStandins
    try:
        yield
    finally:
        services.ConsolePopen = popen


def port_files_fit() -> bool:
    """Whether this Ray's agents write their ports as ``tidal.cluster.ray_agents`` does: the same names, and
    what Ray's own ``persist_port`` writes is what the stand-ins write."""
    import tempfile

    from tidal.cluster import ray_agents

    try:
        from ray import _raylet

        names = (_raylet.METRICS_AGENT_PORT_NAME, _raylet.METRICS_EXPORT_PORT_NAME)
        names += (_raylet.DASHBOARD_AGENT_LISTEN_PORT_NAME, _raylet.RUNTIME_ENV_AGENT_PORT_NAME)
        if names != (*ray_agents.DASHBOARD_PORTS, ray_agents.RUNTIME_ENV_PORT):
            return False
        node = _raylet.NodeID.from_random().hex()
        with tempfile.TemporaryDirectory(prefix="tidal-ports-") as theirs, tempfile.TemporaryDirectory() as ours:
            for port in (-1, 40123):
                _raylet.persist_port(theirs, node, names[0], port)
                ray_agents.persist_port(ours, node, names[0], port)
                with (
                    open(os.path.join(theirs, f"{names[0]}_{node}")) as a,
                    open(os.path.join(ours, f"{names[0]}_{node}")) as b,
                ):
                    if a.read() != b.read():
                        return False
        return True
    except Exception:  # noqa: BLE001 - any difference at all: Ray's own agents
        log.debug("port files differ from Ray's; its agents start as usual", exc_info=True)
        return False


def _set_base_env() -> None:
    for k, v in BASE_ENV.items():
        os.environ.setdefault(k, v)


def prestart_modules(
    model_type: str | None, *, actors: int, trainer: bool, num_gpus: int, any_host: bool = False
) -> list[str]:
    """Modules the prestarted workers of a local CPU cluster import before they host an actor.

    Ray prestarts one Python worker per logical CPU when it starts; the actors of a run that need no
    runtime env of their own are placed on them. Importing torch, the model's transformers module
    and the actor classes there (``preload_python_modules``) overlaps 4-5 s of imports per actor
    with Ray's own start and the driver's set-up, instead of running them after the actors are
    created. Only on a small CPU host, where the prestarted workers are about as many as the actors:
    each preloaded worker costs some 400 MB, and on a many-core host most of them would host nothing.
    On GPUs with torch_memory_saver's preload variables the trainer needs a fresh process anyway.
    ``any_host`` (``--warm-process on``): the same list on any host, for a warm process, which forks only the
    workers the actors ask for (it prestarts none).
    """
    if not any_host and (num_gpus or float(os.cpu_count() or 1) > 2 * max(1, actors)):
        return []
    mods = ["torch"]
    if model_type and _has_transformers_model(model_type):
        mods.append(f"transformers.models.{model_type}.modeling_{model_type}")
    mods += ["tidal.rollout.actor", "tidal.rollout.embedded"]
    if trainer:
        mods += ["torch.distributed.fsdp", "tidal.trainer.actor"]  # FSDP2 is imported where the model is sharded
    return mods


def _has_transformers_model(model_type: str) -> bool:
    """Whether transformers ships ``models/<model_type>/modeling_<model_type>.py`` (without importing it)."""
    import importlib.util

    found = importlib.util.find_spec("transformers")
    roots = list(found.submodule_search_locations or []) if found else []
    return any(os.path.isfile(os.path.join(r, "models", model_type, f"modeling_{model_type}.py")) for r in roots)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in os.environ while Ray's processes are spawned (they inherit it), then as before."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def lean_head() -> Iterator[None]:
    """Ray's head node without the autoscaler monitor and the dashboard head while ``ray.init`` starts it.

    ``ray.init`` has no switch for either (``include_dashboard=False`` still starts the dashboard
    head with its usage-stats module, and ``ray.init`` waits for it before starting the raylet), so
    the two ``Node`` methods that start them are made no-ops for the duration of the call. Should a
    Ray release rename them, nothing is patched and Ray starts as it always did.
    """
    from ray._private.node import Node

    names = ("start_monitor", "start_api_server")
    saved = {n: Node.__dict__.get(n) for n in names}
    if any(v is None for v in saved.values()):
        yield
        return

    def no_monitor(self) -> None:
        return None

    def no_api_server(self, **_: object) -> None:
        self._webui_url = None

    Node.start_monitor, Node.start_api_server = no_monitor, no_api_server
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(Node, n, v)


def _init_local(logical_cpus: float, num_gpus: int, preload: list[str], *, warm: bool = False) -> None:
    from tidal.cluster.warm import worker_command

    with lean_head(), worker_command() if warm else contextlib.nullcontext():
        _ray_init_local(logical_cpus, num_gpus, local_system_config(preload, prestart=bool(preload) and not warm))


def local_system_config(preload: Sequence[str], *, prestart: bool) -> dict:
    """Ray's system config for a cluster started here.

    ``prestart``: Ray starts one Python worker per logical CPU as the driver connects, and the driver's
    ``ray.init`` returns only once they have started. That pays off where the actors take those workers
    (a small CPU host, ``prestart_modules``); elsewhere (GPUs, whose trainer needs a fresh process, or a
    many-core host) it costs a Ray import per core before the first actor is created: 16 workers made
    ``ray.init`` take 10.5 s on a 16-core GPU host. Without it Ray starts the workers the actors ask for.
    A cluster with a warm process prestarts none either: its workers are forks that wait for the warm
    process's imports, and ``ray.init`` waiting for them kept the driver from reserving the placement group
    and creating the actors meanwhile (a run of one rollout ended 0.5-0.9 s later, 12 A/B pairs).
    """
    if not prestart:
        return {"prestart_worker_first_driver": False}
    # The workers Ray prestarts are the ones the actors are meant to take; Ray stops a worker idle
    # for over a second when it has more than one per CPU, before the driver has asked for them.
    config: dict = {"idle_worker_killing_time_threshold_ms": IDLE_WORKER_KEEP_MS}
    if preload:
        config["preload_python_modules"] = list(preload)
    return config


def _ray_init_local(logical_cpus: float, num_gpus: int, system_config: dict) -> None:
    import ray

    ray.init(
        address="local",
        num_cpus=int(round(logical_cpus + 0.49)),
        num_gpus=num_gpus,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=True,
        _system_config=system_config,
    )


def stop_ray(started: bool) -> None:
    """Stop the cluster this process started (``started``), and the warm process unless it serves a cluster
    started here that still runs (one a session joined: ``started_cluster_env``)."""
    import ray

    global _warm, _started
    if started and ray.is_initialized():
        ray.shutdown()
    if not ray.is_initialized():
        _started = None
    if _warm is not None and _started is None:
        _warm.stop()
        _warm = None
