"""Start a local Ray cluster or join an existing one, and always shut it down.

``tidal train`` starts Ray on the local machine by default (CPUs and GPUs it can see), or joins
the cluster at ``--ray-address``. Ray is started with logical CPUs at least as many as the actors
ask for, so a 2-core laptop can host a trainer group and engines that share cores.
"""

from __future__ import annotations

import logging
import os

from tidal.errors import UserError

log = logging.getLogger(__name__)

# Environment every tidal process should see; set before Ray starts so actors inherit it.
BASE_ENV = {
    "RAY_AUTH_MODE": "disabled",  # otherwise Ray writes a token file and warns on every start
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "0",
}


def start_ray(address: str | None, *, num_cpus: float, num_gpus: int) -> bool:
    """Start or join Ray. Returns True when this process started the cluster (and must stop it)."""
    import ray

    for k, v in BASE_ENV.items():
        os.environ.setdefault(k, v)
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
    with shielded():
        _init_local(logical_cpus, num_gpus)
    log.info("started a local Ray cluster: %d CPUs, %d GPUs", int(logical_cpus), num_gpus)
    return True


def _init_local(logical_cpus: float, num_gpus: int) -> None:
    import ray

    ray.init(
        address="local",
        num_cpus=int(round(logical_cpus + 0.49)),
        num_gpus=num_gpus,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=True,
    )


def stop_ray(started: bool) -> None:
    import ray

    if started and ray.is_initialized():
        ray.shutdown()
