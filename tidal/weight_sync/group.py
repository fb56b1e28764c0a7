"""A process group of the trainer's source rank and every engine, outside ``torch.distributed``'s default group.

The trainer ranks already hold a default group (FSDP2), and an engine may hold one of its own, so
the sync group cannot come from ``init_process_group``/``new_group``. It is built directly from a
``TCPStore`` (rank 0, the trainer, hosts it) and a backend class: ``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU. Rank 0 is the trainer's source rank, engines are 1..N.

NCCL refuses two ranks on one GPU, so a colocated trainer and engine share weights through the
``tensor`` transport, never through this group.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

PREFIX = "tidal-weight-sync"
# The group name tidal gives servers speaking SGLang's protocol (SGLang's default group_name).
SGLANG_GROUP = "weight_update_group"


def master_store(timeout_s: float = 300.0) -> tuple[dist.TCPStore, str, int]:
    """Host the rendezvous store on this node on a free port; returns (store, address, port)."""
    addr = node_ip()
    store = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return store, addr, store.port


def node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - fall back to the hostname below
        pass
    return socket.gethostbyname(socket.gethostname())


def make_group(
    store: dist.Store | None,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float = 300.0,
    *,
    sglang_name: str | None = None,
):
    """Join the sync group as ``rank``; blocks until every rank joined. Returns (group, store).

    The group's keys live under ``PREFIX`` in the store, and one broadcast runs right away so that a
    broken group fails here. ``sglang_name``: join the group named so as SGLang's
    ``/init_weights_update_group`` forms it instead: keys under ``<sglang_name>/`` then ``<cpu|cuda>/``
    (torch's own custom-group layout), no probe broadcast (SGLang runs none). The trainer (rank 0,
    hosting ``store``) and a server speaking SGLang's protocol both join so.
    """
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=timeout)
    probe = sglang_name is None
    prefixed = dist.PrefixStore(PREFIX if probe else f"{sglang_name}/", store)
    if not probe:
        prefixed = dist.PrefixStore("cuda/" if backend == "nccl" else "cpu/", prefixed)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # Loopback when the group lives on one host: the hostname may not resolve to a usable interface.
        if master_addr.startswith("127.") or master_addr == "localhost":
            opts._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=node_ip())]
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        if probe:
            # NCCL creates its communicator at the first collective; do it now so connect() fails early.
            first = torch.zeros(1, device=f"cuda:{torch.cuda.current_device()}")
            pg.broadcast(first, 0).wait()
            torch.cuda.synchronize()
    else:
        raise ValueError(f"unknown sync backend {backend!r}; use gloo or nccl")
    if backend == "gloo" and probe:
        pg.broadcast(torch.zeros(1), 0).wait()
    return pg, store


def broadcast(pg, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` from rank 0 in place on every rank."""
    pg.broadcast(tensor, 0).wait()
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()
