"""Placement: which bundle of a Ray placement group each trainer rank and each engine runs in.

Colocated: one bundle per trainer rank (one GPU, or a share of CPUs); engine ``i`` sits in bundle
``i`` beside trainer rank ``i`` and both ask for half of it, so Ray lets them share the device and
sets the same ``CUDA_VISIBLE_DEVICES`` for both. Disaggregated: trainer ranks and engines get
bundles of their own. The placement group is created with STRICT_PACK on one node when everything
fits there, else PACK.

Actors that need only the run's common environment (``worker_env``) are started without a Ray
runtime env when the run started the cluster itself with that environment: a runtime env of their
own would make Ray start a new worker process for each instead of using the ones it prestarts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tidal.config.schema import ClusterConfig
from tidal.errors import UserError


@dataclass
class ActorSlot:
    bundle: int
    num_cpus: float
    num_gpus: float


@dataclass
class Placement:
    colocated: bool
    device: str
    bundles: list[dict]
    trainers: list[ActorSlot]
    engines: list[ActorSlot]
    pg: object = field(default=None, repr=False)
    # The environment every worker of the Ray cluster already has (set when this run started the
    # cluster with ``worker_env`` in its environment): actors that need no other variables then get no
    # runtime env, so Ray can give them the workers it started with the cluster.
    cluster_env: dict | None = field(default=None, repr=False)

    @property
    def num_cpus(self) -> float:
        return sum(b.get("CPU", 0) for b in self.bundles)

    @property
    def num_gpus(self) -> int:
        return int(sum(b.get("GPU", 0) for b in self.bundles))


def plan_placement(cluster: ClusterConfig, device: str, num_engines: int, *, with_trainer: bool = True) -> Placement:
    """Decide bundles and per-actor resources (pure: no Ray calls); ``with_trainer=False``: engines only."""
    ranks = cluster.actor_num_nodes * cluster.actor_num_gpus_per_node if with_trainer else 0
    gpu = 1.0 if device == "cuda" else 0.0
    cpus = cluster.num_cpus_per_actor
    if cluster.colocate:
        if num_engines > ranks:
            raise UserError(
                f"--rollout-num-gpus {num_engines} exceeds the {ranks} trainer devices it is colocated with; use at most {ranks} or drop --colocate"
            )
        bundles = [{"CPU": cpus, **({"GPU": gpu} if gpu else {})} for _ in range(ranks)]
        trainers = [ActorSlot(i, cpus / 2, gpu / 2) for i in range(ranks)]
        engines = [ActorSlot(i, cpus / 2, gpu / 2) for i in range(num_engines)]
    else:
        bundles = [{"CPU": cpus, **({"GPU": gpu} if gpu else {})} for _ in range(ranks + num_engines)]
        trainers = [ActorSlot(i, cpus, gpu) for i in range(ranks)]
        engines = [ActorSlot(ranks + i, cpus, gpu) for i in range(num_engines)]
    return Placement(colocated=cluster.colocate, device=device, bundles=bundles, trainers=trainers, engines=engines)


def create_placement_group(placement: Placement, timeout_s: float = 120.0) -> Placement:
    """Reserve the bundles; fail with a clear message when the cluster cannot hold them."""
    if not placement.bundles:
        return placement  # nothing to reserve (--debug-rollout-only against external engines: no trainer, no engine bundle)
    import ray
    from ray.util.placement_group import placement_group

    available = ray.cluster_resources()
    need_gpu = placement.num_gpus
    if need_gpu > available.get("GPU", 0):
        raise UserError(
            f"placement needs {need_gpu} GPUs but the Ray cluster has {int(available.get('GPU', 0))}; lower --actor-num-gpus-per-node / --rollout-num-gpus"
        )
    one_node = len(ray.nodes()) == 1
    pg = placement_group(placement.bundles, strategy="STRICT_PACK" if one_node else "PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise UserError(
            f"Ray could not reserve {placement.bundles} within {timeout_s:.0f} s; the cluster has {available}"
        )
    placement.pg = pg
    return placement


def actor_options(placement: Placement, slot: ActorSlot, env_vars: dict | None = None) -> dict:
    """Ray ``.options(...)`` for an actor in ``slot``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    opts = {
        "num_cpus": slot.num_cpus,
        "num_gpus": slot.num_gpus,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=placement.pg, placement_group_bundle_index=slot.bundle
        ),
    }
    env = {**worker_env(placement), **(env_vars or {})}
    if not _has_env(placement.cluster_env, env):
        opts["runtime_env"] = {"env_vars": env}
    return opts


def _has_env(cluster_env: dict | None, env: dict) -> bool:
    """Whether every worker of the cluster already has ``env`` (it may have more, e.g. the compile
    cache's variables): then the actor needs no runtime env and can take a prestarted worker."""
    return cluster_env is not None and all(cluster_env.get(k) == v for k, v in env.items())


def worker_env(placement: Placement) -> dict[str, str]:
    """Environment variables every actor of the run gets.

    On CPU, OpenMP's threads sleep when they wait (``OMP_WAIT_POLICY=PASSIVE``, unless the user set a
    policy): by default they spin, and with colocated actors, the driver and Ray sharing a few cores a
    spinning thread burns the core another process needs. The default run's trainer used 0.47-0.66 s
    of CPU per step spinning on a busy 2-core host against 0.07-0.08 s passive (same threads)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads_per_actor(placement))}
    if placement.device == "cpu":
        env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    return env


def threads_per_actor(placement: Placement) -> int:
    """CPU threads per actor: colocated actors take turns, so each may use its bundle's share of cores."""
    cores = os.cpu_count() or 1
    concurrent = len(placement.trainers) if placement.colocated else len(placement.trainers) + len(placement.engines)
    return max(1, cores // max(1, concurrent))
