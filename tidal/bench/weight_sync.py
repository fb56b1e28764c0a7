"""Benchmark of weight sync: every (mode, transport) on a model preset, next to the copy limit.

    python -m tidal.bench.weight_sync                      # CPU: every pair on the tiny preset
    python -m tidal.bench.weight_sync --model qwen2.5-0.5b-shape --modes full,delta --transports tensor

Prints one JSON line per (mode, transport, model): mode, transport, bytes_total, bytes_sent,
density, seconds, gbps, phase seconds, limit_gbps and bitwise_equal; the disk transport adds
``write_s`` (file writing, partly overlapped with encoding), ``pull_s`` (engines patching their
local checkpoint) and ``load_s`` (engines reloading it), the two parts of its ``apply_s``. ``limit_gbps`` is measured in
the same run on the same buffer size: a plain memcpy on CPU, a device-to-device copy for colocated
GPU syncs whose source is on the device, and a pinned host-to-device copy when the source is the
trainer's host backup (our case: the trainer feeds host tensors).

The delta case is a real RL update: the trainer-side actor runs a few GRPO-like steps (AdamW on a
policy-gradient loss over sampled tokens with group-normalised rewards), then syncs against the
weights the engines held before the update. Sizes and speeds are what this host gives; nothing
is asserted.

``SyncSource`` is the trainer side used here and in the tests: a real model with an fp32 master
copy and AdamW, feeding ``strategy.sync`` a stream of host tensors in the engine dtype.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import tempfile
import time

import torch

from tidal.config.schema import WeightSyncConfig
from tidal.dtypes import default_dtype_name, dtype_of


class SyncSource:
    """The trainer's side of a sync, as a Ray actor: model + AdamW + the weight-sync strategy."""

    def __init__(
        self,
        model: str,
        cfg: WeightSyncConfig,
        engines: list,
        *,
        device: str = "cpu",
        colocated: bool = True,
        seed: int = 1234,
        engine_dtype: str = "float32",
        lr: float = 1e-5,
    ):
        from tidal.model.load import build_model, resolve_model
        from tidal.weight_sync import make_strategy

        torch.set_num_threads(max(1, min(os.cpu_count() or 1, 16)))
        self.device = device
        self.spec = resolve_model(model)
        self.model = build_model(
            self.spec, dtype=torch.float32, seed=seed, device="cuda" if device == "cuda" else "cpu"
        )
        self.engine_dtype = dtype_of(engine_dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.engines = engines
        self.strategy = make_strategy(cfg, engines, device=device, colocated=colocated, base_dir=self.spec.path)
        self.version = 0
        self._host: dict[str, torch.Tensor] | None = None

    def connect(self) -> None:
        self.strategy.connect()

    def reconfigure(self, cfg: WeightSyncConfig, colocated: bool = True) -> None:
        """A fresh strategy (new transport or mode) over the same engines; versions restart at 1."""
        from tidal.weight_sync import make_strategy

        self.strategy.close()
        self.strategy = make_strategy(
            cfg, self.engines, device=self.device, colocated=colocated, base_dir=self.spec.path
        )
        self.version = 0

    def pause(self) -> int:
        """Keep a host copy of the weights in the master dtype (fp32, pinned on CUDA), as a paused
        trainer's host backup holds them; later syncs read only this copy, never device memory.

        Returns its bytes (the source bytes a sync from the backup reads).
        """
        self._host = {}
        for name, p in self.model.named_parameters():
            h = torch.empty(p.shape, dtype=p.dtype, pin_memory=torch.cuda.is_available())
            h.copy_(p.detach())
            self._host[name] = h
        return sum(t.numel() * t.element_size() for t in self._host.values())

    def resume(self) -> None:
        """Back to reading the live weights (drop the host backup)."""
        self._host = None

    @torch.no_grad()
    def poison_device_weights(self) -> None:
        """Overwrite the device copy with NaN, as paused device memory holds garbage: a sync must not read it."""
        for p in self.model.parameters():
            p.fill_(float("nan"))

    def named_tensors(self):
        """The stream the trainer feeds ``strategy.sync`` (which casts to the engine dtype): the host
        backup while paused; else the live tensors when the strategy packs on the device, or host
        copies in the engine dtype."""
        from tidal.weight_sync.stream import to_host

        if self._host is not None:
            yield from self._host.items()
            return
        on_device = self.strategy.wants_device
        for name, p in self.model.named_parameters():
            yield name, p.detach() if on_device else to_host(p.detach(), self.engine_dtype)

    def rl_steps(self, steps: int = 3, groups: int = 4, group_size: int = 4, seq_len: int = 32, seed: int = 0) -> float:
        """GRPO-like updates: sample responses, reward them, normalise per group, policy-gradient step."""
        self._host = None
        gen = torch.Generator(device="cpu").manual_seed(seed)
        dev = next(self.model.parameters()).device
        vocab = self.model.config.vocab_size
        loss_val = 0.0
        for _ in range(steps):
            prompts = torch.randint(0, vocab, (groups, 8), generator=gen).repeat_interleave(group_size, 0).to(dev)
            with torch.no_grad():
                logits = self.model(prompts).logits[:, -1].float()
                tokens = torch.multinomial(torch.softmax(logits, -1), seq_len, replacement=True, generator=None)
            ids = torch.cat([prompts, tokens], 1)
            # Reward: fraction of even tokens (any verifiable function of the response will do).
            reward = (tokens % 2 == 0).float().mean(1)
            r = reward.view(groups, group_size)
            adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1, 1)
            out = self.model(ids).logits[:, prompts.shape[1] - 1 : -1].float()
            logp = torch.log_softmax(out, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            loss = -(adv * logp).mean()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            loss_val = float(loss.detach())
        return loss_val

    def sync(self) -> dict:
        self.version += 1
        report = self.strategy.sync(self.named_tensors(), self.version, self.engine_dtype)
        st = self.strategy
        extra = (
            {"sync/write_s": st.last_write_s, "sync/pull_s": st.last_pull_s, "sync/load_s": st.last_load_s}
            if hasattr(st, "last_write_s")
            else {}
        )
        return {**report.metrics(), **extra, "version": self.version}

    def checksums(self) -> dict[str, str]:
        from tidal.weight_sync.checksum import tensor_checksum

        return {name: tensor_checksum(t.to(device="cpu", dtype=self.engine_dtype)) for name, t in self.named_tensors()}

    def checksums_of_nan(self) -> dict[str, str]:
        """Checksums of NaN-filled tensors shaped like the weights (what a read of poisoned device memory gives)."""
        from tidal.weight_sync.checksum import tensor_checksum

        return {
            name: tensor_checksum(torch.full(p.shape, float("nan"), dtype=self.engine_dtype))
            for name, p in self.model.named_parameters()
        }

    def param_bytes(self) -> int:
        return sum(p.numel() for p in self.model.parameters()) * self.engine_dtype.itemsize

    def inject_fault(self, bucket: int = 0, attempts: tuple[int, ...] = (0,)) -> None:
        """Test seam: flip one byte of bucket ``bucket`` on the listed send attempts, after its checksum was taken."""

        def hook(index, attempt, buf):
            if index != bucket or attempt not in attempts:
                return
            if isinstance(buf, str):  # disk: a shard file path
                with open(buf, "r+b") as f:
                    f.seek(-1, os.SEEK_END)
                    b = f.read(1)
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([b[0] ^ 0xFF]))
                return
            buf[buf.numel() // 2 if hasattr(buf, "numel") else len(buf) // 2] ^= 0xFF

        self.strategy.fault_hook = hook

    def clear_fault(self) -> None:
        self.strategy.fault_hook = None

    def close(self) -> None:
        self.strategy.close()


# ---------------------------------------------------------------------------------------------- limits


def memcpy_gbps(nbytes: int, device: str = "cpu", source: str = "host") -> float:
    """The copy limit of one sync's bytes, measured here: memcpy (CPU), pinned H2D, or D2D."""
    n = max(nbytes, 64 << 20)  # large enough that the figure is a bandwidth, not a call overhead
    if device == "cuda":
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        src = torch.empty(n, dtype=torch.uint8, pin_memory=True) if source == "host" else torch.empty_like(dst)
        for _ in range(2):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reps = 5
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return n * reps / (time.perf_counter() - t0) / 1e9
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        dst.copy_(src)
    return n * reps / (time.perf_counter() - t0) / 1e9


def start_actors(ray, model: str, *, device: str, engines_n: int, engine_dtype: str, lr: float = 1e-6):
    """One trainer-side source and ``engines_n`` engine actors, shared by every case of a model."""
    from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig
    from tidal.rollout.actor import EngineActor

    cfg = WeightSyncConfig(update_weight_transport="tensor")
    gpu = 1 / (engines_n + 1) if device == "cuda" else 0
    cpus = max(1.0, (os.cpu_count() or 2) / (engines_n + 1)) if device == "cuda" else 0.5
    engine_cls = ray.remote(EngineActor).options(num_cpus=cpus, num_gpus=gpu)
    engines = [
        engine_cls.remote(
            i,
            model=ModelConfig(model=model),
            rollout=RolloutConfig(),
            memory=MemoryConfig(),
            weight_sync=cfg,
            device=device,
        )
        for i in range(engines_n)
    ]
    ray.get([e.init.remote() for e in engines])
    source = (
        ray.remote(SyncSource)
        .options(num_cpus=cpus, num_gpus=gpu)
        .remote(model, cfg, engines, device=device, engine_dtype=engine_dtype, lr=lr)
    )
    return source, engines


def run_case(
    ray,
    source,
    engines,
    model: str,
    mode: str,
    transport: str,
    *,
    device: str,
    buffer: int,
    rl_steps: int,
    disk_dir: str,
    source_kind: str = "backup",
) -> dict:
    from tidal.weight_sync.verify import compare_checksums

    cfg = WeightSyncConfig(
        update_weight_mode=mode,
        update_weight_transport=transport,
        update_weight_buffer_size=buffer,
        update_weight_disk_dir=os.path.join(disk_dir, f"{mode}-{transport}"),
        update_weight_local_checkpoint_dir=os.path.join(disk_dir, f"{mode}-{transport}-local"),
    )
    ray.get(source.reconfigure.remote(cfg, colocated=transport == "tensor"))
    ray.get(source.connect.remote())
    ray.get([e.randomize_weights.remote(7) for e in engines])
    paused = source_kind == "backup"
    src_bytes = 0
    ray.get(source.resume.remote())
    if paused:  # the sync reads the host backup (fp32), as from a paused trainer
        src_bytes = ray.get(source.pause.remote())
    first = ray.get(source.sync.remote())
    if mode == "delta":
        # A real RL update, then a delta against what the engines held before it.
        ray.get(source.rl_steps.remote(rl_steps))
        if paused:
            ray.get(source.pause.remote())
        rep = ray.get(source.sync.remote())
    else:
        rep = ray.get(source.sync.remote())  # warm: the first sync also pays one-time costs
    # The limit for the source: copying the backup's bytes host -> device once (pinned H2D), or
    # copying the engine-dtype bytes device to device (live trainer on a GPU), or a memcpy (CPU).
    where = "host" if paused or device != "cuda" else "device"
    limit = memcpy_gbps(min(buffer, ray.get(source.param_bytes.remote())), device=device, source=where)
    limit_s = (src_bytes if paused and device == "cuda" else rep["sync/bytes_total"]) / (limit * 1e9)
    trainer = ray.get(source.checksums.remote())
    equal = all(not compare_checksums(trainer, c) for c in ray.get([e.weight_checksums.remote() for e in engines]))
    return {
        "model": model,
        "mode": mode,
        "transport": transport,
        "source": source_kind,
        "engines": len(engines),
        "bytes_total": rep["sync/bytes_total"],
        "bytes_sent": rep["sync/bytes_sent"],
        "density": round(rep["sync/density"], 6),
        "seconds": round(rep["sync/seconds"], 4),
        "gather_s": round(rep["sync/gather_s"], 4),
        "encode_s": round(rep["sync/encode_s"], 4),
        "send_s": round(rep["sync/send_s"], 4),
        "apply_s": round(rep["sync/apply_s"], 4),
        **{k: round(rep[f"sync/{k}"], 4) for k in ("write_s", "pull_s", "load_s") if f"sync/{k}" in rep},
        "gbps": round(rep["sync/gbps"], 3),
        "limit_gbps": round(limit, 3),
        "source_bytes": src_bytes or rep["sync/bytes_total"],
        "limit_s": round(limit_s, 4),
        "vs_limit": round(rep["sync/seconds"] / limit_s, 2) if limit_s else None,
        "first_sync_s": round(first["sync/seconds"], 4),
        "retried": rep["sync/retried"],
        "bitwise_equal": equal,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="presets, comma-separated (default: tiny on CPU, qwen2.5-0.5b-shape on GPU)"
    )
    p.add_argument("--modes", default="full,delta")
    p.add_argument("--transports", default=None, help="default: tensor,broadcast,disk on CPU; tensor,disk on GPU")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument(
        "--sources",
        default="backup",
        help="backup (a paused trainer's fp32 host backup) and/or device (a live GPU trainer), comma-separated",
    )
    p.add_argument("--buffer-size", type=int, default=512 * 1024**2)
    p.add_argument("--rl-steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of the RL steps (GRPO runs use ~1e-6)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--disk-dir", default=None, help="where the disk transport writes (default: the temp dir)")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    models = args.model or ("qwen2.5-0.5b-shape" if args.device == "cuda" else "tiny")
    transports = args.transports or ("tensor,broadcast,disk" if args.device == "cpu" else "tensor,disk")
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    disk_dir = tempfile.mkdtemp(prefix="tidal-bench-ws-", dir=args.disk_dir)
    engine_dtype = default_dtype_name(args.device)
    try:
        for model in models.split(","):
            source, engines = start_actors(
                ray, model, device=args.device, engines_n=args.engines, engine_dtype=engine_dtype, lr=args.lr
            )
            for mode, transport, kind in itertools.product(
                args.modes.split(","), transports.split(","), args.sources.split(",")
            ):
                if kind == "device" and (args.device != "cuda" or transport == "disk"):
                    continue  # a live device source differs from the backup only where packing is on the GPU
                row = run_case(
                    ray,
                    source,
                    engines,
                    model,
                    mode,
                    transport,
                    device=args.device,
                    buffer=args.buffer_size,
                    rl_steps=args.rl_steps,
                    disk_dir=disk_dir,
                    source_kind=kind,
                )
                print(json.dumps(row), flush=True)
            for a in [source, *engines]:
                ray.kill(a)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
        ray.shutdown()


if __name__ == "__main__":
    main()
