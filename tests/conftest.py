"""Shared fixtures: one real local Ray cluster per test session (CPU), torn down at the end."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every test that needs actors (starting one costs ~4 s)."""
    import ray

    from tidal.cluster.ray_cluster import lean_head

    if not ray.is_initialized():
        # address="local": always a fresh cluster, even when another one runs on this machine; lean, as
        # `tidal train` starts it (no autoscaler monitor, no dashboard head).
        with lean_head():
            ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=True, configure_logging=False)
    yield ray
    ray.shutdown()
