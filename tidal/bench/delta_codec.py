"""Benchmark of the delta codec alone: encode and apply GB/s on a bf16 model's bytes, next to memcpy.

    python -m tidal.bench.delta_codec                       # 1 GiB, Qwen2.5-0.5B tensor sizes, all cores
    python -m tidal.bench.delta_codec --mib 256 --threads 2 --encoding xor

The buffer is a model's worth of bf16 tensors (Qwen2.5-0.5B sizes: the 272 MB embedding, then 24
layers of attention and MLP weights, biases and norms, repeated or cut to ``--mib``). Old weights are
``N(0, 0.02)`` fp32 rounded to bf16; the update is an Adam-like step of the same size on every
weight in the direction of a random sign, applied to the fp32 master and rounded to bf16 again, with
the step size found by bisection so that ``--density`` of the bytes change. That reproduces a real
update: ``--density tiny-rl`` runs 3 GRPO-like AdamW steps (lr 1e-6, ``SyncSource.rl_steps``) on the
tiny preset and uses the density they give (3.2 %: 99 % of the changed bytes are bf16 low bytes, 23 %
of 8-byte words change, as in the Qwen2.5-0.5B-shape update of ``tidal bench weight-sync``).

Encode is ``DeltaState``'s path: every tensor submitted to the pool chunk by chunk, with the xxh3-128
checksum of every chunk, results taken in order; the snapshot is reset to the old bytes (untimed)
before each repetition. Apply is the receiver's path: ``apply_many`` over all tensors at once into a
copy of the old bytes, returning each tensor's checksum. GB/s count the bytes of the full tensors.
Each repetition's result is checked bitwise against the new bytes and the checksums against the
encoder's. ``memcpy_gbps`` is ``np.copyto`` of the whole buffer in the same run, on one thread and
chunked over the same pool. Prints one JSON line; nothing is asserted.

``--format disk`` measures the disk path instead, in slime's stream format, on the same buffers:
the old bytes are the engines' base checkpoint (version 0, one safetensors file); encode + write is
``DiskStrategy.write`` of the new weights as version 1 (diff, one zstd frame per tensor, checksum,
shard files fsynced: ``write_s`` is the file writing within it), apply is ``pull`` of version 1
into a host-local copy of the base (decode, verify, patch in place). It reports the bytes on disk
against the full bytes and checks the patched copy bitwise against the new bytes. Its limits,
measured in the same run: memcpy, and zstd alone on the same diffs (``zstd_compress_gbps``,
``zstd_decompress_gbps``: level 1, one frame per tensor, tensors over the same number of threads);
``*_cpu_s`` are the process's CPU seconds (meaningful on a shared host, where wall time is not).
With ``--format both`` the tidal row also writes its encoded entries to one fsynced file and reads
them back (``file_write_s``, ``file_read_s``): tidal's layout through a disk, next to slime's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

# Qwen2.5-0.5B: hidden 896, intermediate 4864, 24 layers, 14 query heads and 2 key/value heads of 64, vocab 151936.
_HIDDEN, _INTER, _KV, _VOCAB, _LAYERS = 896, 4864, 128, 151936, 24
_LAYER = [
    _HIDDEN,  # input norm
    _HIDDEN * _HIDDEN,  # q
    _HIDDEN,
    _KV * _HIDDEN,  # k
    _KV,
    _KV * _HIDDEN,  # v
    _KV,
    _HIDDEN * _HIDDEN,  # o
    _HIDDEN,  # post-attention norm
    _INTER * _HIDDEN,  # gate
    _INTER * _HIDDEN,  # up
    _HIDDEN * _INTER,  # down
]


def layout(total_bytes: int) -> list[int]:
    """Element counts of bf16 tensors shaped like Qwen2.5-0.5B's, in order, adding up to about ``total_bytes``."""
    sizes, used = [], 0
    if _VOCAB * _HIDDEN * 2 <= total_bytes:
        sizes.append(_VOCAB * _HIDDEN)
        used = _VOCAB * _HIDDEN * 2
    while True:
        for n in _LAYER:
            if used + 2 * n > total_bytes:
                return sizes or [total_bytes // 2]
            sizes.append(n)
            used += 2 * n


def _bf16_pair(master: torch.Tensor, direction: torch.Tensor, step: float) -> tuple[torch.Tensor, torch.Tensor]:
    return master.to(torch.bfloat16), (master - step * direction).to(torch.bfloat16)


def calibrate(density: float, seed: int = 0) -> float:
    """The Adam-like step size (relative to nothing: weights are N(0, 0.02)) that changes ``density`` of bf16 bytes."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(1 << 20, generator=g) * 0.02
    direction = torch.randint(0, 2, master.shape, generator=g).float().mul_(2).sub_(1)
    lo, hi = 0.0, 1e-3
    for _ in range(40):
        mid = (lo + hi) / 2
        old, new = _bf16_pair(master, direction, mid)
        got = float((old.view(torch.uint8) != new.view(torch.uint8)).float().mean())
        lo, hi = (mid, hi) if got < density else (lo, mid)
    return (lo + hi) / 2


def tiny_rl_density(steps: int = 3) -> float:
    """Byte density of a real update: ``steps`` GRPO-like AdamW steps (lr 1e-6) on the tiny preset, bf16."""
    import types

    from tidal.bench.weight_sync import SyncSource
    from tidal.model.load import build_model, resolve_model

    model = build_model(resolve_model("tiny"), dtype=torch.float32, seed=1234)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0)
    before = [p.detach().to(torch.bfloat16).reshape(-1).view(torch.uint8).clone() for p in model.parameters()]
    SyncSource.rl_steps(types.SimpleNamespace(model=model, opt=opt, _host=None), steps)
    changed = total = 0
    for b, p in zip(before, model.parameters()):
        a = p.detach().to(torch.bfloat16).reshape(-1).view(torch.uint8)
        changed += int((a != b).sum())
        total += a.numel()
    return changed / total


def make_model(total_bytes: int, density: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """(old bytes, new bytes, [(offset, nbytes)] of each tensor): one contiguous buffer each, tensors 64-byte aligned."""
    sizes = layout(total_bytes)
    spans, off = [], 0
    for n in sizes:
        spans.append((off, 2 * n))
        off += -(-2 * n // 64) * 64
    old = np.zeros(off, dtype=np.uint8)
    new = np.zeros(off, dtype=np.uint8)
    step = calibrate(density, seed)
    g = torch.Generator().manual_seed(seed + 1)
    piece = 1 << 24  # elements generated at a time, to bound the fp32 temporaries
    for a, nbytes in spans:
        n = nbytes // 2
        o16 = torch.from_numpy(old[a : a + nbytes]).view(torch.bfloat16)
        n16 = torch.from_numpy(new[a : a + nbytes]).view(torch.bfloat16)
        for s in range(0, n, piece):
            e = min(n, s + piece)
            master = torch.randn(e - s, generator=g) * 0.02
            direction = torch.randint(0, 2, (e - s,), generator=g).float().mul_(2).sub_(1)
            o, nw = _bf16_pair(master, direction, step)
            o16[s:e] = o
            n16[s:e] = nw
    return old, new, spans


def memcpy_gbps(src: np.ndarray, threads: int, reps: int = 3) -> dict[str, float]:
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    out = {}
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    out["1"] = src.size * reps / (time.perf_counter() - t0) / 1e9
    step = 4 << 20
    with ThreadPoolExecutor(threads) as ex:
        t0 = time.perf_counter()
        for _ in range(reps):
            list(ex.map(lambda a: np.copyto(dst[a : a + step], src[a : a + step]), range(0, src.size, step)))
        out[str(threads)] = src.size * reps / (time.perf_counter() - t0) / 1e9
    return out


def set_threads(codec, threads: int) -> None:
    if hasattr(codec, "set_threads"):
        codec.set_threads(threads)
    else:  # an older copy of the codec, for A/B runs
        codec._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tidal-delta")


def run(args, disk: bool = False) -> dict:
    codec = importlib.import_module(args.codec)
    if args.chunk_mib:
        codec.CHUNK = int(args.chunk_mib * 1024**2)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    density = tiny_rl_density() if args.density == "tiny-rl" else float(args.density)
    t0 = time.perf_counter()
    cached = os.path.join(args.cache, f"delta-codec-{args.mib}-{density:.6f}-{args.seed}.npz") if args.cache else None
    if cached and os.path.exists(cached):
        with np.load(cached) as z:
            old, new, spans = z["old"], z["new"], [tuple(map(int, s)) for s in z["spans"]]
    else:
        old, new, spans = make_model(args.mib * 1024**2, density, args.seed)
        if cached:
            os.makedirs(args.cache, exist_ok=True)
            np.savez(cached, old=old, new=new, spans=np.array(spans, dtype=np.int64))
    build_s = time.perf_counter() - t0
    total = sum(n for _, n in spans)
    real_density = float(np.count_nonzero(old != new)) / old.size
    set_threads(codec, threads)
    limit = memcpy_gbps(old, threads)
    if disk:
        return {
            **run_disk(args, old, new, spans, threads, real_density),
            "memcpy_gbps": {k: round(v, 2) for k, v in limit.items()},
        }
    snap = np.empty_like(old)
    target = np.empty_like(old)
    enc_s, app_s, file_s = [], [], []
    file_dir = (args.disk_dir or tempfile.gettempdir()) if args.format == "both" else None
    sent = changed = 0
    equal = True
    for _ in range(args.reps):
        np.copyto(snap, old)
        t0 = time.perf_counter()
        jobs = [
            codec.submit_encode(new[a : a + n], snap[a : a + n], args.encoding, args.compression, "xxh3-128")
            for a, n in spans
        ]
        results = [j.result() for j in jobs]
        enc_s.append(time.perf_counter() - t0)
        equal &= bool(np.array_equal(snap, new))
        changed = sum(r[0] for r in results)
        sent = sum(len(p) for r in results for p in r[2])
        blobs = [b"".join(r[2]) for r in results if r[0]]
        if file_dir:
            blobs, wr, rd = _file_roundtrip(file_dir, blobs)
            file_s.append((wr, rd))
        items = [
            (target[a : a + n], b, r[1], codec.CHUNK)
            for (a, n), r, b in zip(spans, [r for r in results if r[0]], blobs)
        ]
        np.copyto(target, old)
        t0 = time.perf_counter()
        sums = codec.apply_many(items, args.encoding, args.compression, "xxh3-128")
        app_s.append(time.perf_counter() - t0)
        equal &= bool(np.array_equal(target, new))
        equal &= sums == [r[3] for r in results if r[0]]
    return {
        "bench": "delta_codec",
        "codec": args.codec,
        "encoding": args.encoding,
        "compression": args.compression,
        "threads": threads,
        "chunk_mib": codec.CHUNK / 1024**2,
        "tensors": len(spans),
        "bytes_total": total,
        "bytes_sent": sent,
        "sent_fraction": round(sent / total, 5),
        "density": round(real_density, 5),
        "changed_bytes": changed,
        "encode_gbps": round(total / statistics.median(enc_s) / 1e9, 3),
        "apply_gbps": round(total / statistics.median(app_s) / 1e9, 3),
        "encode_s": [round(s, 4) for s in enc_s],
        "apply_s": [round(s, 4) for s in app_s],
        "memcpy_gbps": {k: round(v, 2) for k, v in limit.items()},
        **_file_figures(file_s, total, enc_s, app_s),
        "bitwise_equal": equal,
        "build_s": round(build_s, 1),
    }


def _file_roundtrip(folder: str, blobs: list[bytes]) -> tuple[list[memoryview], float, float]:
    """The encoded entries written to one file (fsynced) and read back, as a disk transport would:
    (the entries read back, write seconds, read seconds)."""
    fd, path = tempfile.mkstemp(prefix="tidal-bench-codec-", dir=folder)
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            for b in blobs:
                f.write(b)
            f.flush()
            os.fsync(f.fileno())
        wr = time.perf_counter() - t0
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            data = memoryview(f.read())
        rd = time.perf_counter() - t0
    finally:
        os.remove(path)
    out, pos = [], 0
    for b in blobs:
        out.append(data[pos : pos + len(b)])
        pos += len(b)
    return out, wr, rd


def _file_figures(file_s: list, total: int, enc_s: list, app_s: list) -> dict:
    """tidal's layout through a file: encode + write and read + apply, comparable with the disk stream's."""
    if not file_s:
        return {}
    wr, rd = (statistics.median(f[i] for f in file_s) for i in range(2))
    enc, app = statistics.median(enc_s), statistics.median(app_s)
    return {
        "file_write_s": round(wr, 4),
        "file_read_s": round(rd, 4),
        "encode_write_gbps": round(total / (enc + wr) / 1e9, 3),
        "read_apply_gbps": round(total / (rd + app) / 1e9, 3),
    }


def run_disk(args, old: np.ndarray, new: np.ndarray, spans: list, threads: int, density: float) -> dict:
    """The disk stream (slime's format): write version 1 against the base, then pull it on a host."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    from tidal.config.schema import WeightSyncConfig
    from tidal.weight_sync import delta
    from tidal.weight_sync.disk import DiskStrategy
    from tidal.weight_sync.local_checkpoint import pull

    delta.set_threads(threads)

    def tensors(buf):
        return [(f"t{i:04d}", torch.from_numpy(buf[a : a + n]).view(torch.bfloat16)) for i, (a, n) in enumerate(spans)]

    root = tempfile.mkdtemp(prefix="tidal-bench-disk-", dir=args.disk_dir)
    try:
        base = os.path.join(root, "base")
        os.makedirs(base)
        save_file(dict(tensors(old)), os.path.join(base, "model.safetensors"))
        cfg = WeightSyncConfig(
            update_weight_mode="delta",
            update_weight_transport="disk",
            update_weight_disk_dir=os.path.join(root, "disk"),
            update_weight_local_checkpoint_dir=os.path.join(root, "local"),
            update_weight_delta_encoding=args.encoding,
            update_weight_checksum=args.checksum,
        )
        rows = []
        for _ in range(args.reps):
            s = DiskStrategy(cfg, [], base_dir=base)
            s.write(tensors(old), 1)  # first sync: seeds the snapshot from the base, publishes nothing
            pull(cfg.update_weight_local_checkpoint_dir, s.disk_dir, 0, base_dir=base)  # version 0 on the host
            t0, c0 = time.perf_counter(), time.process_time()
            folder = s.write(tensors(new), 2)
            write_total, write_cpu = time.perf_counter() - t0, time.process_time() - c0
            on_disk = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
            t0, c0 = time.perf_counter(), time.process_time()
            pull(cfg.update_weight_local_checkpoint_dir, s.disk_dir, 1, base_dir=base)
            apply_s, apply_cpu = time.perf_counter() - t0, time.process_time() - c0
            with open(os.path.join(cfg.update_weight_local_checkpoint_dir, "model.safetensors"), "rb") as f:
                (n,) = np.frombuffer(f.read(8), "<u8")
                f.seek(8 + int(n))
                equal = bool(np.array_equal(np.frombuffer(f.read(), np.uint8), _packed(new, spans)))
            rows.append(
                (
                    write_total - s.last_blocked_s,
                    s.last_blocked_s,
                    apply_s,
                    write_cpu,
                    apply_cpu,
                    s.last_write_s,
                    on_disk,
                    equal,
                )
            )
            shutil.rmtree(s.disk_dir)
        total = sum(n for _, n in spans)
        enc, wr, app, enc_cpu, app_cpu, wr_all = (statistics.median(r[i] for r in rows) for i in range(6))
        return {
            "bench": "delta_codec",
            "format": "disk (slime)",
            "encoding": args.encoding,
            "checksum": args.checksum,
            "threads": threads,
            "tensors": len(spans),
            "bytes_total": total,
            "bytes_on_disk": rows[-1][6],
            "disk_fraction": round(rows[-1][6] / total, 5),
            "density": round(density, 5),
            "encode_s": round(enc, 4),
            "write_s": round(wr, 4),
            "write_background_s": round(wr_all, 4),
            "apply_s": round(app, 4),
            "encode_gbps": round(total / enc / 1e9, 3),
            "encode_write_gbps": round(total / (enc + wr) / 1e9, 3),
            "apply_gbps": round(total / app / 1e9, 3),
            "encode_write_cpu_s": round(enc_cpu, 4),
            "apply_cpu_s": round(app_cpu, 4),
            **zstd_limit(old, new, spans, args.encoding, threads),
            "bitwise_equal": all(r[7] for r in rows),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def zstd_limit(old: np.ndarray, new: np.ndarray, spans: list, encoding: str, threads: int) -> dict[str, float]:
    """zstd alone on the same diffs (level 1, one-shot, one frame per tensor, the tensors over a pool of
    ``threads``): the compression and decompression speed the disk stream's encode and apply work
    against, in GB/s of full tensor bytes like theirs."""
    import zstandard

    from tidal.weight_sync import disk_format as fmt

    total = sum(n for _, n in spans)
    diffs = [d for d in (fmt.diff(new[a : a + n], old[a : a + n], encoding)[1] for a, n in spans) if d is not None]
    local = __import__("threading").local()

    def compress(d):
        c = local.__dict__.setdefault("c", zstandard.ZstdCompressor(level=1))
        return c.compress(d)

    def decompress(f):
        return local.__dict__.setdefault("d", zstandard.ZstdDecompressor()).decompress(f)

    with ThreadPoolExecutor(threads) as ex:
        t0 = time.perf_counter()
        frames = list(ex.map(compress, diffs))
        comp = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(ex.map(decompress, frames))
        decomp = time.perf_counter() - t0
    return {"zstd_compress_gbps": round(total / comp / 1e9, 3), "zstd_decompress_gbps": round(total / decomp / 1e9, 3)}


def _packed(buf: np.ndarray, spans: list) -> np.ndarray:
    """The tensors' bytes back to back (safetensors stores them unpadded, in name order = span order here)."""
    return np.concatenate([buf[a : a + n] for a, n in spans])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="model size in MiB (default 1024)")
    p.add_argument("--threads", type=int, default=None, help="pool threads (default: one per core)")
    p.add_argument("--density", default="0.031", help="fraction of bytes changed, or tiny-rl (measured)")
    p.add_argument("--encoding", default="overwrite", choices=("overwrite", "xor"))
    p.add_argument("--compression", default="zstd", choices=("zstd", "none"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk-mib", type=float, default=None, help="override the codec's chunk size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=None, help="folder to keep the generated buffers in between runs")
    p.add_argument("--codec", default="tidal.weight_sync.delta", help="codec module (A/B runs against a copy)")
    p.add_argument("--format", default="tidal", choices=("tidal", "disk", "both"), help="in-memory codec, disk stream")
    p.add_argument("--checksum", default="xxh3-128", choices=("xxh3-128", "blake3", "adler32"), help="disk format")
    p.add_argument("--disk-dir", default=None, help="folder for the disk format's files (default: the temp dir)")
    args = p.parse_args(argv)
    if args.format in ("tidal", "both"):
        print(json.dumps(run(args)), flush=True)
    if args.format in ("disk", "both"):
        print(json.dumps(run(args, disk=True)), flush=True)


if __name__ == "__main__":
    main()
