"""``tidal bench startup``'s timer: seconds to a command's first step line and to its exit, from outside."""

from __future__ import annotations

import sys

from tidal.bench.startup import _median, time_command

SCRIPT = (
    "import time; print('starting'); time.sleep(0.3); print('step    0 | reward 0.1'); time.sleep(0.2); print('done')"
)


def test_time_command_sees_the_first_step_line_and_the_exit():
    row = time_command([sys.executable, "-c", SCRIPT], "step    0 |")
    assert row["rc"] == 0 and row["last_line"] == "done"
    assert 0.3 <= row["first_step_s"] < row["total_s"]
    assert time_command([sys.executable, "-c", "print('no step')"], "step    0 |")["first_step_s"] is None


# A child burns 0.3 s of CPU, says so, and lives until its parent exits (its stdin closes) a second after the
# step line: the sampler sees it after its burn however busy the host is.
BURN = (
    "import subprocess, sys, time\n"
    "child = 'import sys, time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass\\n"
    "print(1, flush=True)\\nsys.stdin.read()'\n"
    "p = subprocess.Popen([sys.executable, '-c', child], stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
    "p.stdout.readline(); time.sleep(0.3); print('step    0 | x', flush=True); time.sleep(1)\n"
)


def test_time_command_counts_the_cpu_of_every_process_of_the_command():
    row = time_command([sys.executable, "-c", BURN], "step    0 |")
    assert row["rc"] == 0 and row["cpu_first_step_s"] >= 0.28, row  # the child's busy loop
    assert row["cpu_total_s"] >= row["cpu_first_step_s"] and "driver" in row["cpu_first_step_by_role"]
    assert row["load"] >= 0


def test_processes_of_a_run_are_named_by_role():
    from tidal.bench.startup import role

    assert role(["python", "-m", "tidal", "train"], root=True) == "driver"
    assert role(["ray::TrainerActor"], root=False) == "TrainerActor"
    assert role(["ray::ProbedEngineActor.generate"], root=False) == "ProbedEngineActor"
    assert role(["ray::IDLE"], root=False) == "ray idle worker"
    assert role(["python", "-m", "tidal.cluster.warm", "/tmp/s", "3", "4", "torch"], root=False) == "warm process"
    assert role(["/x/raylet", "--raylet_socket_name=/s", "--python_worker_command=default_worker.py"], False) == "ray"


def test_medians_leave_out_failed_runs():
    rows = [{"rc": 0, "total_s": 3.0}, {"rc": 0, "total_s": 5.0}, {"rc": 1, "total_s": 0.1}, {"rc": 0, "total_s": None}]
    assert _median(rows, "total_s") == 4.0
    assert _median([{"rc": 1, "total_s": 1.0}], "total_s") is None


def test_step0_breakdown_reads_the_first_row(tmp_path):
    from tidal.bench.startup import step0_breakdown

    rows = [
        '{"step": 0, "elapsed_s": 9.5, "generate_s": 2.0, "train_s": 1.5, "startup_ray_s": 3.1, "startup_actors_s": 6.0, "reward_mean": 0.1}',
        '{"step": 1, "elapsed_s": 10.0, "generate_s": 0.1, "startup_ray_s": 99}',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    got = step0_breakdown(str(tmp_path))
    assert got == {
        "device": None,  # no config.yaml
        "step0_elapsed_s": 9.5,
        "step0_generate_s": 2.0,
        "step0_train_s": 1.5,
        "startup_ray_s": 3.1,
        "startup_actors_s": 6.0,
    }
    assert step0_breakdown(str(tmp_path / "missing")) == {}
    (tmp_path / "config.yaml").write_text("cluster:\n  ray_address: null\n  device: cuda\nmodel:\n  model: tiny\n")
    assert step0_breakdown(str(tmp_path))["device"] == "cuda"


def test_first_step_limits_follow_the_device_and_the_cache():
    """8 s on a CPU; on a GPU 20 s warm, and with one fresh cache for every run the first run is the cold one (45 s)."""
    from tidal.bench.startup import first_step_limits

    cpu = [{"run": i, "rc": 0, "device": "cpu", "first_step_s": 5.0 + i} for i in range(3)]
    gpu = [{"run": i, "rc": 0, "device": "cuda", "first_step_s": s} for i, s in enumerate((60.0, 38.0, 36.0))]
    assert first_step_limits(cpu, fresh_cache=True) == {"first_step_limit_s": 8.0}
    assert first_step_limits(gpu, fresh_cache=False) == {"first_step_limit_s": 20.0}
    assert first_step_limits(gpu, fresh_cache=True) == {
        "first_step_cold_s": 60.0,
        "cold_limit_s": 45.0,
        "first_step_warm_s": 37.0,
        "warm_limit_s": 20.0,
    }


def test_a_lean_cluster_runs_actors_without_the_monitor_and_dashboard_head(ray_cluster):
    """The session's cluster is started as ``tidal train`` starts one (``lean_head``): actors run and
    print to the driver, and Ray's autoscaler monitor and dashboard head were never started."""
    import psutil

    from tidal.cluster.ray_cluster import lean_head

    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def answer() -> int:
        return 42

    assert ray.get(answer.remote()) == 42
    commands = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True) if p.is_running()]
    assert any("raylet" in c for c in commands) and any("log_monitor.py" in c for c in commands), commands
    assert not [c for c in commands if "autoscaler/_private/monitor.py" in c or "dashboard/dashboard.py" in c]
    from ray._private.node import Node

    before = (Node.start_monitor, Node.start_api_server)
    with lean_head():
        assert (Node.start_monitor, Node.start_api_server) != before
    assert (Node.start_monitor, Node.start_api_server) == before  # Ray's own methods again
