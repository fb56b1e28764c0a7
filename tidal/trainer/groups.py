"""The trainer's process groups: a host group that lives for the whole run, and a compute group that can be rebuilt.

Two groups, because they have different lifetimes:

- the **host group** (gloo, the default group) carries CPU tensors: token counts, metrics, and the
  gathers that read weights from host backups while the trainer is paused. Gloo holds no device
  memory, so it is never torn down;
- the **compute group** carries FSDP2's all-gathers and reduce-scatters over the device mesh. On
  NCCL its communicators hold device memory (buffers per peer and channel), which must go while the
  rollout engines use the GPU: ``release()`` destroys it before a pause and ``rebuild()`` creates a
  new one after the resume. On CPU the compute group *is* the host group and is left alone.

FSDP2 and DTensor look a group up in two places, both repointed by ``rebuild()``: the device mesh
resolves its group by name (``_dim_group_names``), and each FSDP parameter group caches the group
object in its ``FSDPMeshInfo``. The same code path runs on CPU when asked
(``separate_compute_group=True``), which is how the tests exercise it without a GPU.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def rank_device(device: str) -> torch.device:
    """This rank's device: on CUDA the GPU ``LOCAL_RANK`` names (made current), else the CPU."""
    if device != "cuda":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def place(tr, **groups) -> tuple[torch.device, TrainerGroups]:
    """A trainer rank's device and its ``TrainerGroups`` (``groups``: the keywords after ``device``), from the
    rank's own fields (``rank``, ``world_size``, ``master_addr``/``master_port``, ``device_type``, ``cfg``)."""
    device = rank_device(tr.device_type)
    return device, TrainerGroups(
        tr.rank,
        tr.world_size,
        tr.master_addr,
        tr.master_port,
        device=tr.device_type,
        timeout_min=tr.cfg.dist_timeout_min,
        **groups,
    )


class TrainerGroups:
    """Creates the groups and the 1-D device mesh FSDP2 shards over; releases and rebuilds the compute group.

    ``world_backend`` is the default group's backend: gloo for FSDP2 (its device collectives use the
    compute group); the Megatron backend passes ``"cpu:gloo,cuda:nccl"``, so the groups Megatron
    creates from it carry device tensors over NCCL and host tensors over gloo, and asks for no mesh.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        *,
        device: str,
        separate_compute_group: bool,
        timeout_min: int = 30,
        world_backend: str = "gloo",
        mesh: bool = True,
    ):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.separate = separate_compute_group
        self.timeout = timedelta(minutes=timeout_min)  # --dist-timeout-min
        os.environ["MASTER_ADDR"] = str(master_addr)
        os.environ["MASTER_PORT"] = str(master_port)
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        if not dist.is_initialized():
            dist.init_process_group(
                world_backend, init_method="env://", rank=rank, world_size=world_size, timeout=self.timeout
            )
        self.host = dist.group.WORLD
        self.compute = self._new_compute_group() if self.separate else self.host
        self.mesh = DeviceMesh.from_group(self.compute, device) if mesh else None
        self.released = False
        self.rebuilds = 0

    def _new_compute_group(self) -> dist.ProcessGroup:
        backend = "nccl" if self.device == "cuda" else "gloo"
        return dist.new_group(ranks=list(range(self.world_size)), backend=backend, timeout=self.timeout)

    def release(self) -> bool:
        """Destroy the compute group (its communicators' device memory goes with it). False if not separate."""
        if not self.separate or self.released:
            return False
        if self.device == "cuda":
            torch.cuda.synchronize()
        dist.destroy_process_group(self.compute)
        self.compute = None
        self.released = True
        return True

    def rebuild(self, fsdp_modules) -> bool:
        """Create a new compute group and point the mesh and every FSDP module at it."""
        if not self.released:
            return False
        # new_group is collective over the host group: every rank runs this in the same order.
        group = self._new_compute_group()
        mesh = self.mesh
        mesh._dim_group_names = [group.group_name]
        infos = getattr(mesh, "_dim_group_infos", None)
        if infos:  # older torch keeps (tag, ranks, name) triples instead of names
            mesh._dim_group_infos = [(tag, ranks, group.group_name) for tag, ranks, *_ in infos]
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
            registry[group.group_name] = group
        for module in fsdp_modules:
            state = module._get_fsdp_state()
            param_group = state._fsdp_param_group
            if param_group is None:
                continue
            for info in {id(i): i for i in (param_group.mesh_info, param_group.post_forward_mesh_info) if i}.values():
                info.shard_process_group = group
                if hasattr(info, "reduce_scatter_process_group"):
                    info.reduce_scatter_process_group = None
        self.compute = group
        self.released = False
        self.rebuilds += 1
        return True

    def barrier(self) -> None:
        dist.barrier(group=self.host)

    def all_reduce_host(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """All-reduce a few floats over the host group (fp64 so token counts stay exact)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(t, op=op, group=self.host)
        return t.tolist()

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
