"""Actor groups: the trainer ranks and the rollout engines as Ray actors in their bundles.

``TrainerGroup.call(method, ...)`` calls a method on every rank at once (FSDP collectives need all
of them) and returns rank 0's result. ``EngineGroup.call(method, ...)`` returns every engine's
result. ``get`` (``tidal.errors.ray_get``) waits on object refs and turns a user error raised inside
an actor back into the same ``UserError`` on the driver, so it is printed as one line rather than a
remote traceback. The trainer class is the one ``--train-backend`` picks (``tidal.trainer.base``).
"""

from __future__ import annotations

import socket
from typing import Any

from tidal.cluster.placement import Placement, actor_options
from tidal.errors import ray_get

get = ray_get  # the cluster's name for it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rendezvous_address(placement: Placement, bundle: int) -> tuple[str, int]:
    """IP and a free port on the node that holds ``bundle`` (where rank 0 will listen)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0)
    def probe() -> tuple[str, int]:
        return ray.util.get_node_ip_address(), _free_port()

    strategy = PlacementGroupSchedulingStrategy(placement_group=placement.pg, placement_group_bundle_index=bundle)
    return get(probe.options(scheduling_strategy=strategy).remote())


class TrainerGroup:
    """N trainer ranks forming one torch.distributed group."""

    def __init__(self, placement: Placement, *, env_vars: dict, **sections: Any):
        import ray

        from tidal.trainer.actor import TrainerActor

        addr, port = rendezvous_address(placement, placement.trainers[0].bundle)
        cls = ray.remote(TrainerActor)
        world = len(placement.trainers)
        self.actors = [
            cls.options(**actor_options(placement, slot, env_vars)).remote(
                rank, world, addr, port, device=placement.device, **sections
            )
            for rank, slot in enumerate(placement.trainers)
        ]

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list:
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return get(self.call_async(method, *args, **kwargs))[0]


class EngineGroup:
    """Independent rollout engines (each holds a full copy of the policy)."""

    def __init__(self, placement: Placement, **sections: Any):
        import ray

        from tidal.rollout.actor import EngineActor

        cls = ray.remote(EngineActor)
        self.actors = [
            cls.options(**actor_options(placement, slot)).remote(i, device=placement.device, **sections)
            for i, slot in enumerate(placement.engines)
        ]

    def __len__(self) -> int:
        return len(self.actors)

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list:
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        return get(self.call_async(method, *args, **kwargs))
