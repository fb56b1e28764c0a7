"""Megatron's process groups, destroyed before a pause and rebuilt after the resume, without patching Megatron.

NCCL communicators hold device memory (buffers per peer and channel, the device-side communicator)
that no memory region covers, so a paused trainer would keep it while the rollout engines need the
GPU. slime destroys every process group before its trainer sleeps and creates them again when it
wakes (its reloadable groups stand in for ``torch.distributed``'s by patching the module's functions).
tidal does the same with Megatron's own API and torch's public calls:

- ``release``: after a device synchronisation, ``parallel_state.destroy_model_parallel()`` clears
  Megatron's globals (and destroys its gloo groups), then every other group Megatron created for this
  rank (``parallel_state._global_process_group_list``, which ``create_group`` fills) is destroyed with
  ``torch.distributed.destroy_process_group``, which frees its communicators. The default group stays:
  it carries the host collectives (metrics, weight gathers from the host backups while paused), and
  its NCCL side never runs a collective, so it holds no communicator;
- ``rebuild``: ``initialize_model_parallel`` with the same sizes creates the same groups in the same
  order (collective over the default group: every rank rebuilds together), then every reference that
  Megatron's objects kept to an old group is pointed at its successor (``repoint``): DDP and its
  buffers and bucket groups, the optimizer's data- and model-parallel groups, the layers' ``tp_group``
  and ``pg_collection``. ``repoint`` walks the attributes and containers of those objects from the
  roots it is given and replaces each old group by identity; each successor's ranks are checked
  against the old group's.

With one rank per group (one GPU) the communicators are small, but they are freed the same way. The
CPU tests run the same path over gloo and check that no reference to a destroyed group is left
(reference counts, which also see containers the garbage collector does not track).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

# Objects whose attributes ``repoint`` walks: Megatron's, torch modules and optimizers, tidal's.
_WALKED = ("megatron.", "torch.nn.", "torch.optim.", "tidal.", "transformer_engine.")


class MegatronGroups:
    """Megatron's parallel state for one trainer rank: created once, released and rebuilt around pauses."""

    def __init__(self, *, tp: int, pp: int, cp: int, device: str):
        self.sizes = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp)
        self.device = device
        self.released: list[dist.ProcessGroup] | None = None  # the destroyed groups, until rebuilt
        self._ranks: dict[int, list[int]] = {}
        self.rebuilds = 0
        # The data-parallel ranks over gloo, tidal's own (checkpoints of the distributed optimizer's shards
        # sum over it, also while paused): not Megatron's, so never destroyed. None with one DP rank.
        self.dp_gloo: dist.ProcessGroup | None = None

    def initialize(self) -> None:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(**self.sizes)
        self.dp_gloo = _own_gloo_group(dist.get_process_group_ranks(ps.get_data_parallel_group()))

    def release(self) -> int:
        """Destroy every group Megatron created for this rank; returns how many. Call on all ranks together."""
        from megatron.core import parallel_state as ps

        if self.released is not None:
            return 0
        if self.device == "cuda":
            torch.cuda.synchronize()
        groups = [g for g in (ps._global_process_group_list or []) if g is not None and g is not dist.group.WORLD]
        self._ranks = {id(g): dist.get_process_group_ranks(g) for g in groups}
        ps.destroy_model_parallel()
        registered = dist.distributed_c10d._world.pg_map
        for g in groups:
            if g in registered:  # destroy_model_parallel has destroyed the gloo ones
                dist.destroy_process_group(g)
        self.released = groups
        return len(groups)

    def rebuild(self, roots: Iterable[object]) -> int:
        """Create the groups again and point ``roots``' references at them; returns the references replaced."""
        from megatron.core import parallel_state as ps

        if self.released is None:
            return 0
        old = self.released
        ps.initialize_model_parallel(**self.sizes)
        new = [g for g in ps._global_process_group_list if g is not None and g is not dist.group.WORLD]
        if len(new) != len(old):
            raise RuntimeError(f"Megatron created {len(new)} process groups on rebuild, {len(old)} before the pause")
        for o, n in zip(old, new):
            if dist.get_process_group_ranks(n) != self._ranks[id(o)]:
                raise RuntimeError("Megatron's process groups came back in a different order; cannot re-point them")
        replaced = repoint(roots, {id(o): n for o, n in zip(old, new)})
        self.released, self._ranks = None, {}
        self.rebuilds += 1
        return replaced


def _own_gloo_group(my_ranks: list[int]) -> dist.ProcessGroup | None:
    """A gloo group of ``my_ranks`` (every rank passes its own set; each set is created once, in the same
    order on every rank, as ``new_group`` requires). None for a one-rank set."""
    world = dist.get_world_size()
    sets: list = [None] * world
    dist.all_gather_object(sets, sorted(my_ranks), group=dist.group.WORLD)
    mine = None
    for ranks in sorted({tuple(r) for r in sets}):
        group = dist.new_group(list(ranks), backend="gloo") if len(ranks) > 1 else None
        if dist.get_rank() in ranks:
            mine = group
    return mine


def repoint(roots: Iterable[object], mapping: dict[int, object]) -> int:
    """Replace, in place, every reference to an object whose ``id`` is in ``mapping`` by its value, in the
    attributes and containers reachable from ``roots`` (dicts, lists, tuples, sets; the attributes of
    objects from ``_WALKED`` packages). Tuples and sets are rebuilt into their parent. Returns the count."""
    seen: set[int] = set()
    stack = list(roots)
    count = 0

    def sub(value):
        """The value to store instead of ``value`` (itself unless it is, or holds in a tuple/set, an old group)."""
        nonlocal count
        target = mapping.get(id(value))
        if target is not None:
            count += 1
            return target
        if isinstance(value, (tuple, frozenset, set)) and value:
            items = [sub(v) for v in value]
            if any(a is not b for a, b in zip(items, value)):
                return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
            return value
        if _walkable(value):
            stack.append(value)
        return value

    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            _fix_dict(obj, sub, mapping)
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                new = sub(v)
                if new is not v:
                    obj[i] = new
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                _fix_dict(attrs, sub, mapping)
    return count


def _fix_dict(d: dict, sub, mapping: dict[int, object]) -> None:
    for k in list(d):
        v = d[k]
        new = sub(v)
        if id(k) in mapping:  # a group as a key (a cache by group)
            del d[k]
            k = mapping[id(k)]
        if new is not v or k not in d:
            d[k] = new


def _walkable(value) -> bool:
    if isinstance(value, (dict, list)):
        return True
    if isinstance(value, (torch.Tensor, type)) or callable(value) and not isinstance(value, torch.nn.Module):
        return False
    return type(value).__module__.startswith(_WALKED) and hasattr(value, "__dict__")
