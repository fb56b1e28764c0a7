"""Where the time of one CUDA IPC bucket hand-over goes, between two Ray actors on one GPU.

    python scripts/profile_ipc.py [--sizes 64,512] [--reps 4]

For each bucket size and for a fresh buffer per send vs a reused one (the consumer keeps its mapping),
prints per-phase milliseconds: producer alloc+fill, reduce_tensor, Ray round trip, consumer rebuild
(cudaIpcOpenMemHandle), checksum, device copy, and release. Diagnostic only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import ray
import torch


@ray.remote(num_gpus=0.4)
class Producer:
    def __init__(self):
        torch.cuda.set_device(0)
        self.keep = []
        self.reused = None

    def make(self, nbytes: int, fresh: bool) -> dict:
        from torch.multiprocessing.reductions import reduce_tensor

        t0 = time.perf_counter()
        if fresh or self.reused is None or self.reused.numel() != nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            if not fresh:
                self.reused = buf
        else:
            buf = self.reused
        buf.fill_(7)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        rebuild, args = reduce_tensor(buf)
        t2 = time.perf_counter()
        self.keep.append(buf)
        self.keep = self.keep[-2:]
        return {"alloc_fill_ms": (t1 - t0) * 1e3, "reduce_ms": (t2 - t1) * 1e3, "payload": (rebuild, args)}

    def drop(self) -> float:
        t = time.perf_counter()
        self.keep.clear()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3


@ray.remote(num_gpus=0.4)
class Consumer:
    def __init__(self):
        torch.cuda.set_device(0)
        self.dst = None
        self.held = []

    def take(self, payload, keep: bool) -> dict:
        from tidal.weight_sync.bucket import device_checksum

        rebuild, args = payload
        t0 = time.perf_counter()
        buf = rebuild(*args)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        device_checksum(buf)
        t2 = time.perf_counter()
        if self.dst is None or self.dst.numel() != buf.numel():
            self.dst = torch.empty_like(buf)
        self.dst.copy_(buf)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if keep:
            self.held.append(buf)
            self.held = self.held[-2:]
        del buf
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        return {
            "rebuild_ms": (t1 - t0) * 1e3,
            "checksum_ms": (t2 - t1) * 1e3,
            "copy_ms": (t3 - t2) * 1e3,
            "release_ms": (t4 - t3) * 1e3,
        }

    def noop(self, x=None) -> int:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,512")
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args()
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False)
    p, c = Producer.remote(), Consumer.remote()
    ray.get([c.noop.remote(), p.drop.remote()])
    t = time.perf_counter()
    for _ in range(20):
        ray.get(c.noop.remote())
    print(json.dumps({"ray_roundtrip_ms": (time.perf_counter() - t) / 20 * 1e3}))
    for mib in [int(s) for s in a.sizes.split(",")]:
        for fresh in (True, False):
            rows = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                m = ray.get(p.make.remote(mib << 20, fresh))
                t1 = time.perf_counter()
                r = ray.get(c.take.remote(m.pop("payload"), not fresh))
                t2 = time.perf_counter()
                rows.append({**m, **r, "make_call_ms": (t1 - t0) * 1e3, "take_call_ms": (t2 - t1) * 1e3})
            keys = rows[0].keys()
            print(json.dumps({"mib": mib, "fresh": fresh, **{k: [round(x[k], 2) for x in rows] for k in keys}}))
            print(json.dumps({"mib": mib, "fresh": fresh, "drop_ms": ray.get(p.drop.remote())}))
    os._exit(0)


if __name__ == "__main__":
    main()
