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
from tidal.errors import is_engine_death, ray_get

get = ray_get  # the cluster's name for it


# Ports other processes take while the actors start: Ray's workers listen on 10002-19999 (its default worker
# port range) and every outgoing connection or port-0 listener gets one from the kernel's ephemeral range.
# A port picked inside either and bound later by rank 0 can be taken in between: a second `tidal train` on
# an H100 host failed with EADDRINUSE on a rendezvous port of 42615.
RENDEZVOUS_PORTS = range(20000, 32768)
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_range(path: str = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's ephemeral ports (Linux's default 32768-60999 where the file cannot be read)."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _free_port(ephemeral: tuple[int, int] | None = None, tries: int = 64) -> int:
    """A port rank 0's rendezvous store can listen on: free now, and outside the ranges other processes take
    ports from meanwhile (``RENDEZVOUS_PORTS`` less the ephemeral range); one the kernel picks where none of
    those is free."""
    import random

    low, high = ephemeral or _ephemeral_range()
    candidates = [p for p in RENDEZVOUS_PORTS if not low <= p <= high]
    for port in random.sample(candidates, min(tries, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rendezvous_address(placement: Placement, bundle: int) -> tuple[str, int]:
    """IP and a free port on the node that holds ``bundle`` (where rank 0 will listen)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if len(ray.nodes()) == 1:
        # One node, the driver's: no need to start a worker process just to ask it (a second or more at start-up).
        return ray.util.get_node_ip_address(), _free_port()

    @ray.remote(num_cpus=0)
    def probe() -> tuple[str, int]:
        return ray.util.get_node_ip_address(), _free_port()

    strategy = PlacementGroupSchedulingStrategy(placement_group=placement.pg, placement_group_bundle_index=bundle)
    return get(probe.options(scheduling_strategy=strategy).remote())


class TrainerGroup:
    """N trainer ranks forming one torch.distributed group."""

    def __init__(self, placement: Placement, *, env_vars: dict, **sections: Any):
        import ray

        from tidal.trainer.base import trainer_class

        addr, port = rendezvous_address(placement, placement.trainers[0].bundle)
        cls = ray.remote(trainer_class(sections["trainer"].train_backend))
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
    """Independent rollout engines (each holds a full copy of the policy), embedded or HTTP.

    ``--rollout-engine embedded`` makes ``EngineActor``s; ``sglang`` makes ``HttpEngineActor``s,
    each a client of one server: an external address (the actor needs no device and no bundle), or
    a server the actor starts in its bundle. ``restart(i)`` replaces engine ``i`` (a new actor, or
    the same actor restarting/reconnecting its server); its weights are undefined until a sync.
    """

    def __init__(self, placement: Placement, **sections: Any):
        self.placement = placement
        self.sections = sections
        rollout = sections["rollout"]
        self.kind = rollout.rollout_engine
        self.addresses = list(rollout.rollout_external_engine_addrs) if self.kind == "sglang" else []
        count = len(self.addresses) or len(placement.engines)
        self.actors = [self._start(i) for i in range(count)]

    def _start(self, i: int):
        import ray

        if self.kind == "sglang":
            from tidal.rollout.http_engine import HttpEngineActor

            # The /health probe and a restart run beside a hung generate call (their own concurrency
            # group); every other call stays serial, in the order it was sent.
            cls = ray.remote(concurrency_groups={"probe": 2})(HttpEngineActor)
            if self.addresses:
                opts = {"num_cpus": 0, "runtime_env": {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}}
                return cls.options(**opts).remote(
                    i, device=self.placement.device, address=self.addresses[i], **self.sections
                )
        else:
            from tidal.rollout.actor import ProbedEngineActor

            cls = ray.remote(concurrency_groups={"probe": 2})(ProbedEngineActor)  # health() beside a generate
        slot = self.placement.engines[i]
        env = {str(k): str(v) for k, v in self.sections["rollout"].rollout_env_vars.items()}
        return cls.options(**actor_options(self.placement, slot, env)).remote(
            i, device=self.placement.device, **self.sections
        )

    def __len__(self) -> int:
        return len(self.actors)

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list:
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        return get(self.call_async(method, *args, **kwargs))

    def restart(self, i: int, *, initial_weights: bool = False) -> None:
        """Engine ``i`` back up: the same actor restarts (or reconnects) its server when it still
        answers, else a new actor replaces it in the same bundle. ``initial_weights``: the weights a
        server starts with are the ones to generate with (no trainer, ``--debug-rollout-only``), so
        it needs no sync first; a new embedded actor always starts from them."""
        import ray

        old = self.actors[i]
        if self.kind == "sglang":
            try:
                get(old.restart.remote(initial_weights=initial_weights))
                return
            except Exception as e:  # noqa: BLE001 - the actor itself is gone: replace it below
                if not is_engine_death(e):
                    raise
        ray.kill(old, no_restart=True)
        self.actors[i] = self._start(i)
        get(self.actors[i].init.remote())

    def shutdown(self) -> None:
        """Stop the servers HTTP engines started (they also die with their actor)."""
        if self.kind != "sglang":
            return
        import ray

        refs = [a.shutdown.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=15)
