"""Shared fixtures: one real local Ray cluster per test session (CPU), torn down at the end."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every test that needs actors, started as `tidal train` starts its own: lean,
    with a warm process whose forks are the workers (each actor of a run with the default placement then starts
    with torch, the tiny model's code and the actor modules imported, instead of ~5 s of imports of its own;
    an actor that needs another environment gets a runtime env and a worker of Ray's)."""
    import ray

    from tidal.cluster import ray_cluster as rc
    from tidal.cluster.placement import Placement, worker_env
    from tidal.config.environment import Environment
    from tidal.config.schema import ModelConfig
    from tidal.model import resolve_model

    started = False
    if not ray.is_initialized():
        # The environment of the default placement's actors: one colocated trainer rank, which may use every core.
        env = worker_env(Placement(colocated=True, device="cpu", bundles=[{"CPU": 1}], trainers=[], engines=[]))
        model_type = resolve_model(ModelConfig().model, None, False).config_dict().get("model_type")
        # The host's GPUs (none on CI): the GPU tests' actors ask for them, and a cluster without them never
        # places those actors.
        gpus = Environment.detect().device_count
        preload = rc.prestart_modules(model_type, actors=2, trainer=True, num_gpus=gpus, any_host=True)
        rc.start_warm(None, env, preload, forks_import=False)
        started = rc.start_ray(None, num_cpus=8, num_gpus=gpus, worker_env=env)
    yield ray
    rc.stop_ray(started)
