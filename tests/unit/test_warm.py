"""The warm process: Ray's workers of a local CPU cluster are forks of one process that imported the actors' modules.

The cluster test runs in its own process (a Ray cluster of its own, as ``tidal train`` starts one): an actor runs
in a fork of the warm process with the workers' environment and the preloaded module (frozen out of its collector);
Ray's processes and the driver's inputs thread run below the warm process's priority, the driver's own thread not;
no worker is prestarted (ray.init does not wait for the forks); the raylet's agents are light stand-ins, and the runtime-env one becomes Ray's agent when an actor with a runtime env
of its own is started (by Ray, as usual); a worker dies with its handle, even a stopped one; the warm process
stops with ``stop_ray``, without the interpreter's teardown, and not at the end of a session that joined the
cluster (whose actors took its forks too).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tidal.cluster.placement import ActorSlot, Placement, actor_options, worker_env
from tidal.cluster.warm_worker import differing

CLUSTER = textwrap.dedent(
    """
    import os, signal, sys, time
    import psutil
    from tidal.cluster import ray_cluster
    from tidal.cluster.ray_cluster import start_ray, start_warm, stop_ray

    env = {"TIDAL_TEST_MARK": "warm"}
    assert start_warm(None, env, ["colorsys", "atexit_mark"])
    warm = ray_cluster._warm.proc
    started = start_ray(None, num_cpus=2, num_gpus=0, worker_env=env, preload=["colorsys", "atexit_mark"])
    import ray

    def handles_now():
        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                out += [p.pid] if p.cmdline()[1:2] and p.cmdline()[1].endswith("warm_worker.py") else []
            except psutil.Error:
                pass
        return out

    # No worker was prestarted for ray.init to wait for: the actors' workers are started (forked) as they are created.
    assert handles_now() == [], handles_now()

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self):
            print("hello from a warm worker", flush=True)
            import gc

            frozen = gc.get_freeze_count() > 0
            return os.getpid(), psutil.Process().ppid(), os.environ.get("TIDAL_TEST_MARK"), "colorsys" in sys.modules, frozen

    # The rest of the start runs below the warm process (its imports are the critical path).
    below_warm = min(19, psutil.Process(warm.pid).nice() + ray_cluster.START_NICE)  # 19: the lowest there is
    assert ray_cluster.below_warm() == below_warm
    assert os.getpriority(os.PRIO_PROCESS, 0) == psutil.Process(warm.pid).nice()  # the driver's own stays
    import threading

    inputs_nice = []
    def inputs():
        ray_cluster.yield_to_warm()
        inputs_nice.append(os.getpriority(os.PRIO_PROCESS, 0))

    t = threading.Thread(target=inputs)
    t.start()
    t.join()
    assert inputs_nice == [below_warm] and os.getpriority(os.PRIO_PROCESS, 0) < below_warm or below_warm == 19
    def nice_of_ray_process(p):  # None: the warm process, one of its forks, or gone
        try:
            return None if warm.pid in (p.pid, p.ppid()) else p.nice()
        except psutil.Error:
            return None

    ray_nice = [n for n in map(nice_of_ray_process, psutil.Process().children(recursive=True)) if n is not None]
    assert ray_nice and min(ray_nice) == below_warm, ray_nice
    def command(p):
        try:
            return " ".join(p.cmdline())
        except psutil.Error:
            return ""

    # The raylet's two agents are the stand-ins (tidal.cluster.ray_agents), not processes that imported Ray.
    standins = {command(p).split("ray_agents.py ")[1].split(" ")[0]: p for p in psutil.Process().children(recursive=True) if "ray_agents.py" in command(p)}
    assert sorted(standins) == ["dashboard", "runtime-env"], standins
    first = Probe.remote()
    pid, parent, mark, preloaded, frozen = ray.get(first.where.remote())
    assert (parent, mark, preloaded) == (warm.pid, "warm", True), (parent, warm.pid, mark, preloaded)
    assert frozen, "the warm process's imports should be frozen out of the worker's collector"
    own = Probe.options(runtime_env={"env_vars": {"TIDAL_TEST_MARK": "own"}}).remote()
    own_pid, own_parent, own_mark, _, _ = ray.get(own.where.remote())
    assert own_parent != warm.pid and own_mark == "own", (own_parent, own_mark)
    # That runtime env was set up by Ray's own agent, which the stand-in became (same process, Ray's command).
    assert "runtime_env" in command(standins["runtime-env"]) or "RuntimeEnvAgent" in command(standins["runtime-env"])
    assert "ray_agents.py" not in command(standins["runtime-env"]), command(standins["runtime-env"])
    # The raylet's handles on the forked workers: killed outright, their workers die too, even one that is stopped
    # (whose own thread waiting for its handle cannot run: the warm process kills it).
    handles = [p for p in psutil.Process().children(recursive=True) if "warm_worker.py" in command(p)]
    assert handles
    os.kill(pid, signal.SIGSTOP)
    for h in handles:
        h.send_signal(signal.SIGKILL)
    def gone(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    for _ in range(300):
        if gone(pid):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("a forked worker outlived its handle")
    # A session that joins this cluster knows its workers' environment, and its end leaves the warm process.
    assert ray_cluster.started_cluster_env() == env
    stop_ray(False)
    assert ray_cluster._warm is not None and warm.poll() is None
    stop_ray(started)
    assert warm.wait(timeout=10) == 0 and ray_cluster._warm is None
    assert ray_cluster.started_cluster_env() is None
    # It exits without the interpreter's teardown (where an atexit handler of a preloaded module would run).
    assert not os.path.exists("finalized")
    print("warm ok")
    """
)


def test_workers_of_a_local_cluster_are_forks_of_the_warm_process(tmp_path):
    mark = "import atexit\natexit.register(lambda: open('finalized', 'w').close())\n"
    (tmp_path / "atexit_mark.py").write_text(mark)  # preloaded from the working folder
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", CLUSTER], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )
    assert out.returncode == 0 and "warm ok" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert "hello from a warm worker" in out.stdout + out.stderr  # actor output still reaches the driver


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_handle_ends_as_its_worker_ended(sig):
    """The raylet sees a forked worker's end in its handle's: killed by the same signal, SIGKILL included (which no
    handler can be set for; the handle has one for each signal it forwards), or returning the same exit code."""
    code = (
        "import signal, sys; from tidal.cluster.warm_worker import exit_as; "
        "signal.signal(signal.SIGTERM, lambda *a: None); sys.exit(exit_as(int(sys.argv[1])))"
    )
    killed = subprocess.run([sys.executable, "-c", code, str(-sig)], capture_output=True, text=True)
    assert killed.returncode == -sig, killed.stderr[-2000:]
    assert subprocess.run([sys.executable, "-c", code, "3"]).returncode == 3


def test_a_worker_forks_only_when_its_environment_matches():
    warm = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert differing({**warm, "RAY_JOB_ID": "01000000", "SPT_NOENV": "1", "TIDAL_WARM_SOCKET": "/s"}, warm) == []
    # A thread count the fork sets itself (warm.apply_in_fork), where the warm process had one too.
    assert differing({**warm, "OMP_NUM_THREADS": "2"}, warm) == []
    assert differing({**warm, "OMP_NUM_THREADS": "0"}, warm) == ["OMP_NUM_THREADS"]
    assert differing({**warm, "OMP_NUM_THREADS": "two"}, warm) == ["OMP_NUM_THREADS"]
    assert differing({"PATH": "/bin", "OMP_NUM_THREADS": "2"}, {"PATH": "/bin"}) == ["OMP_NUM_THREADS"]
    assert differing({**warm, "LD_PRELOAD": "/x.so"}, warm) == ["LD_PRELOAD"]
    assert differing({"PATH": "/bin"}, warm) == ["OMP_NUM_THREADS"]


def test_a_fork_takes_its_workers_thread_count():
    """OpenMP read the warm process's OMP_NUM_THREADS when torch was imported; a fork told another count sets it."""
    code = (
        "import os, sys; os.environ['OMP_NUM_THREADS'] = '2'; import torch; "
        "from tidal.cluster.warm import apply_in_fork; assert torch.get_num_threads() == 2; "
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    apply_in_fork({'OMP_NUM_THREADS': '1'}); os._exit(0 if torch.get_num_threads() == 1 else 3)\n"
        "_, status = os.waitpid(pid, 0); sys.exit(os.waitstatus_to_exitcode(status))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_actors_need_no_runtime_env_when_the_cluster_already_has_their_variables():
    """The cluster's workers may have more variables than an actor needs (the compile cache's): it still takes
    a prestarted worker; a variable it needs set otherwise gives it a runtime env."""
    placement = Placement(colocated=True, device="cpu", bundles=[{"CPU": 1}], trainers=[], engines=[])
    placement.cluster_env = {**worker_env(placement), "TORCHINDUCTOR_CACHE_DIR": "/c"}
    slot = ActorSlot(bundle=0, num_cpus=0.5, num_gpus=0.0)
    assert "runtime_env" not in actor_options(placement, slot, {})
    assert "runtime_env" not in actor_options(placement, slot, {"TORCHINDUCTOR_CACHE_DIR": "/c"})
    opts = actor_options(placement, slot, {"LD_PRELOAD": "/x.so"})
    assert opts["runtime_env"]["env_vars"]["LD_PRELOAD"] == "/x.so"
    placement.cluster_env = None  # a joined cluster: every actor says what it needs
    assert "runtime_env" in actor_options(placement, slot, {})


def test_cpu_actors_wait_passively_unless_the_user_chose(monkeypatch):
    cpu = Placement(colocated=True, device="cpu", bundles=[{"CPU": 1}], trainers=[], engines=[])
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert worker_env(cpu)["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert worker_env(cpu)["OMP_WAIT_POLICY"] == "ACTIVE"
    gpu = Placement(colocated=True, device="cuda", bundles=[{"CPU": 1, "GPU": 1}], trainers=[], engines=[])
    assert "OMP_WAIT_POLICY" not in worker_env(gpu)


def test_no_warm_process_where_its_socket_cannot_be_made(tmp_path, monkeypatch):
    """A temp folder whose path is too long for a Unix socket: Ray starts the workers itself, nothing is left."""
    from tidal.cluster import ray_cluster

    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr("tempfile.tempdir", None)
    monkeypatch.delitem(sys.modules, "ray", raising=False)  # as in a driver before Ray starts (the suite's Ray is up)
    monkeypatch.setattr(ray_cluster, "_warm", None)  # nor the suite's cluster's warm process
    assert not ray_cluster.start_warm(None, {}, ["colorsys"]) and ray_cluster._warm is None
    assert list(deep.iterdir()) == []


NO_PRESTART = textwrap.dedent(
    """
    import psutil, ray
    from tidal.cluster.ray_cluster import start_ray, stop_ray

    started = start_ray(None, num_cpus=6, num_gpus=0, preload=[])
    idle = [p for p in psutil.Process().children(recursive=True) if p.cmdline()[:1] == ["ray::IDLE"]]

    @ray.remote(num_cpus=0)
    def one():
        return 1

    print("idle", len(idle), "answer", ray.get(one.remote()), flush=True)
    stop_ray(started)
    """
)


def test_a_cluster_whose_workers_host_nothing_preloaded_starts_none_ahead():
    """Without modules to preload (GPUs, a many-core host) Ray prestarts no worker per logical CPU, which
    ``ray.init`` would wait for; a task still gets a worker on demand. With them it keeps its workers."""
    from tidal.cluster.ray_cluster import IDLE_WORKER_KEEP_MS, local_system_config

    assert local_system_config([], prestart=False) == {"prestart_worker_first_driver": False}
    prestarted = local_system_config([], prestart=True)
    assert prestarted == {"idle_worker_killing_time_threshold_ms": IDLE_WORKER_KEEP_MS}
    assert local_system_config(["torch"], prestart=True)["preload_python_modules"] == ["torch"]
    out = subprocess.run(
        [sys.executable, "-c", NO_PRESTART], capture_output=True, text=True, timeout=120, env={**os.environ}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "idle 0 answer 1" in out.stdout, out.stdout[-500:]


def test_agent_standins_take_the_raylets_agent_commands_and_write_ports_as_ray_does(tmp_path):
    """The raylet's command with the stand-ins: both agents' commands are kept whole after the stand-in's, the dashboard
    agent only when it is the minimal one. A port file is what Ray's own ``persist_port`` writes (checked against it)."""
    import shlex

    from ray import _raylet

    from tidal.cluster import ray_agents
    from tidal.cluster.ray_cluster import port_files_fit

    minimal = "/py -u /ray/dashboard/agent.py --node-id=ab --session-dir=/s --minimal --head"
    runtime = "/py -u /ray/runtime_env/agent/main.py --node-id=ab --runtime-env-agent-port=0"
    raylet = [
        "/ray/raylet",
        "--node_id=ab",
        f"--dashboard_agent_command={minimal}",
        f"--runtime_env_agent_command={runtime}",
    ]
    out = ray_agents.standin_command(raylet, python="/py")
    assert out[:2] == raylet[:2]
    dash, rt = (shlex.split(a.split("=", 1)[1]) for a in out[2:])
    assert dash[:4] == ["/py", ray_agents.__file__, "dashboard", "--"] and dash[4:] == shlex.split(minimal)
    assert rt[:4] == ["/py", ray_agents.__file__, "runtime-env", "--"] and rt[4:] == shlex.split(runtime)
    full = f"--dashboard_agent_command={minimal.replace(' --minimal', '')}"
    assert ray_agents.standin_command([raylet[0], full], python="/py") == [raylet[0], full]
    node = _raylet.NodeID.from_random().hex()
    for port in (-1, 51234):
        (tmp_path / "ray").mkdir(exist_ok=True)
        (tmp_path / "ours").mkdir(exist_ok=True)
        _raylet.persist_port(str(tmp_path / "ray"), node, _raylet.RUNTIME_ENV_AGENT_PORT_NAME, port)
        ray_agents.persist_port(str(tmp_path / "ours"), node, ray_agents.RUNTIME_ENV_PORT, port)
        name = f"{ray_agents.RUNTIME_ENV_PORT}_{node}"
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "ray" / name).read_bytes()
    assert port_files_fit()


def test_a_run_that_joins_a_cluster_started_in_its_process_takes_the_warm_forks(ray_cluster, tmp_path):
    """The test session's cluster (tests/conftest.py) is started here with a warm process: a run that joins it
    creates its actors without a runtime env where their environment is the workers', so they are forks."""
    import psutil

    from tidal.cluster import ray_cluster as rc
    from tidal.config import parse, resolve
    from tidal.driver import train

    argv = ["--colocate", "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
    argv += ["--rollout-max-response-len", "2", "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path)]
    cfg, prov = parse(argv)
    forks: list[str] = []

    def on_step(s, rollout_id, row):
        if rollout_id < 0:
            forks.extend(p.name() for p in psutil.Process(rc._warm.proc.pid).children())

    train(resolve(cfg, prov), on_step=on_step)
    assert any("TrainerActor" in n for n in forks) and any("EngineActor" in n for n in forks), forks
    assert rc._warm is not None and rc._warm.proc.poll() is None  # the run's end left it to the cluster
