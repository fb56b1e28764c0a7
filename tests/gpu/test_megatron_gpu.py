"""The Megatron-core backend on one CUDA GPU (TP = PP = 1), next to the FSDP2 backend.

Run on the GPU host: ``pytest -m gpu -s tests/gpu/test_megatron_gpu.py`` (needs megatron-core; about
5 minutes). Prints the figures it measures (log-prob, entropy and gradient differences, step times,
memory).

1. the colocated loop with ``--train-backend megatron --offload`` learns the default task, syncing
   weights the engines agree with (``logprob_diff``; delta syncs, the first checked bit for bit) from
   the trainer's live weights (it pauses in two stages around each sync: optimizer state and gradient
   buffers first, the weights after the push), its process groups destroyed and rebuilt around every pause;
2. on identical weights and one batch (Qwen2.5-0.5B shape): log-probs and entropy, gradients of the
   same loss, and one training step's metrics against the FSDP2 backend (max and mean |diff|), and the
   step time of each on 64 samples of 32 + 256 tokens;
3. pause/resume through torch_memory_saver with the gradient buffers unbacked: device memory freed
   (and freed further by destroying the process groups), host RSS while paused (weights + optimizer
   backups only) next to FSDP2's, state bit-exact after resume, weights read from the backup while
   paused equal the live ones, the same forward/backward after the groups' rebuild, and the next
   step next to FSDP2's;
4. checkpoints (tiny-qwen2): written with and without the distributed optimizer (the first while
   paused, from the host backups), each loaded bit for bit by the other layout and by FSDP2; the HF
   export loads with transformers;
5. on a host with two GPUs only: TP = 2 and PP = 2 (tiny-qwen2) train like one GPU, through a
   pause/resume that destroys and rebuilds groups of two ranks.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time

import pytest

from tidal.config.schema import AlgorithmConfig, MemoryConfig, ModelConfig, TrainerConfig, WeightSyncConfig
from tidal.rollout.types import Sample

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'tidal[megatron]')")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = "qwen2.5-0.5b-shape"
GIB = 1024**3
# A few tensors of every kind the mapping touches: embedding, fused QKV (weight and Qwen2's bias),
# attention output, gated fc1 halves, fc2, norms.
PROBE = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.bias",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.3.mlp.gate_proj.weight",
    "model.layers.3.mlp.up_proj.weight",
    "model.layers.3.mlp.down_proj.weight",
    "model.layers.5.input_layernorm.weight",
    "model.norm.weight",
)


def _free_port() -> int:
    # Where the driver picks rank 0's rendezvous port: outside the kernel's ephemeral range, which Ray's
    # processes draw from while the ranks start (a port-0 pick collided with one: EADDRINUSE at init).
    from tidal.cluster.groups import _free_port as rendezvous_port

    return rendezvous_port()


def _start(ray, backend: str, *, model=SHAPE, offload=False, gpus=0.5, **trainer):
    from tidal.trainer.base import trainer_class

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the probes below run in the actors
    cls = ray.remote(num_gpus=gpus, num_cpus=1)(trainer_class(backend))
    kw = dict(lr=1e-5, lr_warmup_steps=1, max_tokens_per_gpu=8192, train_backend=backend)
    kw.update(trainer)
    actor = cls.remote(
        0,
        1,
        "127.0.0.1",
        _free_port(),
        model=ModelConfig(model=model),
        trainer=TrainerConfig(**kw),
        algorithm=AlgorithmConfig(),
        memory=MemoryConfig(
            offload_train=offload,
            disable_grad_buffers_cpu_backup=offload,
            memory_backend="tms",
            tms_hook_mode="torch",
            offload_host_memory="release",
        ),
        weight_sync=WeightSyncConfig(),
        device="cuda",
    )
    info = ray.get(actor.init.remote(), timeout=900)
    return actor, info


def _start_ranks(ray, world: int, *, model: str, **trainer) -> list:
    """``world`` ranks of one Megatron job, one GPU each (``trainer``: the parallel sizes), initialised together."""
    from tidal.trainer.base import trainer_class

    cls = ray.remote(num_gpus=1, num_cpus=1)(trainer_class("megatron"))
    kw = dict(lr=1e-5, lr_warmup_steps=1, max_tokens_per_gpu=8192, train_backend="megatron", **trainer)
    port = _free_port()
    ranks = [
        cls.remote(
            r,
            world,
            "127.0.0.1",
            port,
            model=ModelConfig(model=model),
            trainer=TrainerConfig(**kw),
            algorithm=AlgorithmConfig(),
            memory=MemoryConfig(
                offload_train=True, memory_backend="tms", tms_hook_mode="torch", offload_host_memory="release"
            ),
            weight_sync=WeightSyncConfig(),
            device="cuda",
        )
        for r in range(world)
    ]
    ray.get([a.init.remote() for a in ranks], timeout=900)
    return ranks


def _samples(seed: int, n: int = 16, prompt=(32, 200), response=(16, 128)) -> list[Sample]:
    rng = random.Random(seed)
    return [
        Sample(
            index=i,
            group=i // 4,
            prompt="",
            prompt_ids=[rng.randint(4, 48) for _ in range(rng.randint(*prompt))],
            response_ids=[rng.randint(4, 48) for _ in range(rng.randint(*response))],
            advantage=1.0 if i % 2 == 0 else -1.0,
        )
        for i in range(n)
    ]


# ---- probes, run inside the actors (``__ray_call__``) -------------------------------------------------
def _fsdp_probe(self, samples):
    """FSDP2: per-token log-probs and entropy of one micro-batch, and d(sum of response log-probs)/dW."""
    import torch

    from tidal.trainer.microbatch import MicroBatch
    from tidal.trainer.step import token_stats

    mb = MicroBatch(samples, list(range(len(samples))), self.pad_id, self.device)
    with torch.no_grad():
        lp, ent = token_stats(self.model, mb, entropy=True, compile=False)
    lp2, _ = token_stats(self.model, mb, compile=False)
    (lp2 * mb.mask).sum().backward()
    grads = {}
    for n, p in self.model.named_parameters():
        if n in PROBE:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[n] = g.float().cpu()
    self.optimizer.zero_grad(set_to_none=True)
    mask = mb.mask.cpu()
    return lp.float().cpu()[mask], ent.float().cpu()[mask], grads


def _megatron_probe(self, samples):
    """Megatron: the same, through its schedule; gradients from the DDP buffers, mapped to HF names."""
    import torch

    from tidal.trainer.megatron import mapping
    from tidal.trainer.megatron.model import stage_parameters
    from tidal.trainer.megatron.step import token_stats
    from tidal.trainer.megatron.trainer import schedule_call
    from tidal.trainer.microbatch import MicroBatch

    mb = MicroBatch(samples, list(range(len(samples))), self.pad_id, self.device)
    out = {}

    def stats(mb, logits, width):
        out["lp"], out["ent"] = token_stats(self, logits, mb, width, entropy=True)
        return logits.new_zeros(()), {}

    def loss(mb, logits, width):
        lp, _ = token_stats(self, logits, mb, width)
        return (lp * mb.mask).sum(), {}

    with torch.no_grad():
        schedule_call(self, self.ddp, [mb], stats, forward_only=True)
    # As a training step starts: after a step Megatron's optimizer leaves each param.grad aliasing its main_grad,
    # and a backward onto that would count every gradient twice.
    self.ddp.zero_grad_buffer()
    self.optimizer.zero_grad()
    schedule_call(self, self.ddp, [mb], loss, forward_only=False)
    grads = {}
    for e, p in stage_parameters(self.stage, self.arch, pp_rank=0, pp_size=1, te=self.te):
        for name, g in mapping.to_hf(e, [p.main_grad], self.arch):
            if name in PROBE:
                grads[name] = g.float().cpu()
    self.ddp.zero_grad_buffer()
    mask = mb.mask.cpu()
    return out["lp"].float().cpu()[mask], out["ent"].float().cpu()[mask], grads


def _weights(self, names):
    import torch

    return {n: t.float().clone() for n, t in self.iter_weights(torch.float32) if n in names}


def _diff(a, b) -> tuple[float, float]:
    d = (a - b).abs()
    return float(d.max()), float(d.mean())


def _rel(a, b) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


# ---- 1. the loop ----------------------------------------------------------------------------------------
def _train_cli(tmp_path, name: str, *args: str) -> list[dict]:
    out = tmp_path / name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "tidal.cli", "train", "--train-backend", "megatron", "--no-progress"]
    cmd += ["--output-dir", str(out), *args]
    t0 = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    print(f"\n{name}: {len(rows)} rollouts in {time.time() - t0:.0f} s")
    return rows


def test_megatron_loop_learns_the_default_task_with_offload(tmp_path):
    # Delta syncs (changed bytes only) of the HF-named weights, read live between the pause's two stages; the
    # first sync is checked bit for bit against engine weights randomised at the start.
    rows = _train_cli(
        tmp_path,
        "learn",
        "--num-rollout",
        "40",
        "--offload",
        "--update-weight-mode",
        "delta",
        "--check-weight-update-equal",
    )
    rewards = [r["reward_mean"] for r in rows]
    start, end = sum(rewards[:3]) / 3, max(sum(rewards[i - 2 : i + 1]) / 3 for i in range(2, len(rewards)))
    diffs = [r.get("logprob_diff", 0.0) for r in rows]
    pause = [r.get("pause_s", 0.0) for r in rows]
    resume = [r.get("resume_s", 0.0) for r in rows]
    print(f"reward start {start:.3f} -> best 3-step {end:.3f}; logprob_diff max {max(diffs):.4f}")
    print("rewards", " ".join(f"{x:.2f}" for x in rewards))
    print(f"trainer pause {sum(pause) / len(pause):.3f} s, resume {sum(resume) / len(resume):.3f} s (mean per step)")
    assert end - start >= 0.3, rewards
    assert max(diffs) < 0.05, diffs
    assert all(x > 0 for x in pause[1:]), "the trainer paused every step"
    assert all(r["sync/from_backup"] == 0 for r in rows), "a step's sync read host backups"


# ---- 2. next to FSDP2 on identical weights and batch -----------------------------------------------------
def test_megatron_matches_fsdp_on_the_same_weights_and_batch(ray_cluster):
    ray = ray_cluster
    fsdp, _ = _start(ray, "fsdp")
    meg, info = _start(ray, "megatron")
    print(f"\nmegatron init: {info}")
    w_f = ray.get(fsdp.__ray_call__.remote(_weights, PROBE))
    w_m = ray.get(meg.__ray_call__.remote(_weights, PROBE))
    assert sorted(w_f) == sorted(w_m) == sorted(PROBE)
    assert all(w_f[n].equal(w_m[n]) for n in PROBE), "the two backends start from different weights"
    batch = _samples(7, n=8)
    lp_f, ent_f, g_f = ray.get(fsdp.__ray_call__.remote(_fsdp_probe, batch))
    lp_m, ent_m, g_m = ray.get(meg.__ray_call__.remote(_megatron_probe, batch))
    lp_max, lp_mean = _diff(lp_m, lp_f)
    ent_max, ent_mean = _diff(ent_m, ent_f)
    print(f"log-probs |diff| max {lp_max:.4g} mean {lp_mean:.4g} (mean |lp| {float(lp_f.abs().mean()):.3g})")
    print(f"entropy   |diff| max {ent_max:.4g} mean {ent_mean:.4g} (mean {float(ent_f.mean()):.3g})")
    for n in PROBE:
        gmax, gmean = _diff(g_m[n], g_f[n])
        print(f"grad {n}: |diff| max {gmax:.3g} mean {gmean:.3g}, rel {_rel(g_m[n], g_f[n]):.3g}")
    assert lp_mean < 0.02 and ent_mean < 0.02, (lp_mean, ent_mean)
    assert all(_rel(g_m[n], g_f[n]) < 0.1 for n in PROBE)

    step = _samples(3, n=16)
    m_f = ray.get(fsdp.train.remote(step, 0))
    m_m = ray.get(meg.train.remote(step, 0))
    for k in ("loss", "pg_loss", "entropy", "grad_norm", "tokens", "response_tokens"):
        print(f"step metric {k}: fsdp {m_f[k]:.6g} megatron {m_m[k]:.6g}")
    assert m_f["tokens"] == m_m["tokens"] and m_f["response_tokens"] == m_m["response_tokens"]
    assert abs(m_m["entropy"] - m_f["entropy"]) < 0.02 * max(1.0, abs(m_f["entropy"]))
    assert abs(m_m["grad_norm"] - m_f["grad_norm"]) < 0.1 * m_f["grad_norm"]

    long = _samples(11, n=64, prompt=(32, 32), response=(256, 256))
    for name, actor in (("fsdp", fsdp), ("megatron", meg)):
        ray.get(actor.train.remote(long, 1))  # warm-up (kernels, allocator)
        t = ray.get(actor.train.remote(long, 2))["train_s"]
        print(f"0.5B step time, 64 x (32 + 256) tokens: {name} {t:.2f} s ({64 * 288 / t:.0f} tokens/s)")
    ray.kill(fsdp)
    ray.kill(meg)


# ---- 3. pause/resume with unbacked gradient buffers -------------------------------------------------------
def _pools(self) -> list[str]:
    """Where device memory sits before a pause: per allocator pool, reserved and allocated (a backed-up pool's
    cached free blocks are backed up too), with the memory backend's pool ids where it names them."""
    import torch

    names = {}
    try:
        from tidal.memory.tms import _torch_mode_impl

        impl = _torch_mode_impl(self.memory._tms)
        names = {tuple(pool.id): str(key) for key, pool in getattr(impl, "_mem_pools", {}).items()}
    except Exception:  # noqa: BLE001 - figures only
        pass
    per: dict = {}
    try:
        segments = torch.cuda.memory._snapshot()["segments"]
    except Exception as e:  # noqa: BLE001 - figures only
        return [f"no allocator snapshot ({type(e).__name__}: {e})"]
    for seg in segments:
        pid = tuple(seg.get("segment_pool_id", (0, 0)))
        active = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        total, used = per.get(pid, (0, 0))
        per[pid] = (total + seg["total_size"], used + active)
    return [f"{names.get(k, k)}: reserved {t / GIB:.2f} GiB, allocated {u / GIB:.2f} GiB" for k, (t, u) in per.items()]


def _adopted(self) -> tuple[int, int, int]:
    """Optimizer state tensors, how many the trainer moved into its OPTIMIZER region after the first step, bytes."""
    from tidal.trainer.megatron.memory import optimizer_tensors

    state = self._optimizer_tensors() if hasattr(self, "_optimizer_tensors") else optimizer_tensors(self.optimizer)
    held = [t for t in state if self.optimizer_home.holds(t)]
    return len(state), len(held), sum(t.untyped_storage().nbytes() for t in held)


def _pause_cycle(ray, backend: str) -> dict:
    actor, info = _start(ray, backend, offload=True, gpus=1)
    m = ray.get(actor.train.remote(_samples(0), 0))
    assert all(math.isfinite(m[k]) for k in ("loss", "pg_loss", "entropy", "grad_norm"))
    n_state, n_adopted, adopted_bytes = ray.get(actor.__ray_call__.remote(_adopted))
    print(
        f"\n{backend}: optimizer state moved into its region after the first step: {n_adopted} of {n_state} tensors, "
        f"{adopted_bytes / GIB:.2f} GiB"
    )
    assert n_state > 0 and n_adopted == n_state
    probe = _megatron_probe if backend == "megatron" else _fsdp_probe
    batch = _samples(7, n=8)
    lp0, _, g0 = ray.get(actor.__ray_call__.remote(probe, batch))
    print(f"{backend} pools after a step:", "; ".join(ray.get(actor.__ray_call__.remote(_pools))))
    state = ray.get(actor.state_checksums.remote())
    live = ray.get(actor.weight_checksums.remote("bfloat16"))
    p = ray.get(actor.pause.remote()).metrics
    paused_weights = ray.get(actor.weight_checksums.remote("bfloat16"))
    r = ray.get(actor.resume.remote()).metrics
    after = ray.get(actor.state_checksums.remote())
    lp1, _, g1 = ray.get(actor.__ray_call__.remote(probe, batch))  # through the rebuilt groups
    m2 = ray.get(actor.train.remote(_samples(1), 1))
    ray.kill(actor)
    pre = "memory/trainer_pause/"
    figures = {
        "backend": backend,
        "weights_backup": p[pre + "weights/backup_bytes"],
        "optimizer_backup": p[pre + "optimizer/backup_bytes"],
        "grads_bytes": p[pre + "grads/bytes"],
        "grads_backup": p[pre + "grads/backup_bytes"],
        "rss_before": p[pre + "host_rss_before"],
        "rss_after": p[pre + "host_rss_after"],
        "device_before": p[pre + "device_used_before"],
        "device_after": p[pre + "device_used_after"],
        "pause_s": p[pre + "total_s"],
        "resume_s": r["memory/trainer_resume/total_s"],
        "groups_released": p.get(pre + "groups_released", 0),
        "groups_freed": p.get(pre + "groups_freed_bytes", 0),
        "groups_rebuilt": r.get("memory/trainer_resume/groups_rebuilt", 0),
        "lp_diff": float((lp1 - lp0).abs().max()),
        "grad_rel": max(_rel(g1[n], g0[n]) for n in g0),
        "next_step": m2,
    }
    figures["rss_growth"] = figures["rss_after"] - figures["rss_before"]
    figures["backups"] = figures["weights_backup"] + figures["optimizer_backup"]
    print(
        f"{backend}: pause {figures['pause_s']:.2f} s, resume {figures['resume_s']:.2f} s; device "
        f"{figures['device_before'] / GIB:.2f} -> {figures['device_after'] / GIB:.2f} GiB; host RSS while paused "
        f"+{figures['rss_growth'] / GIB:.2f} GiB for backups {figures['backups'] / GIB:.2f} GiB "
        f"(weights {figures['weights_backup'] / GIB:.2f} + optimizer {figures['optimizer_backup'] / GIB:.2f}); "
        f"grads {figures['grads_bytes'] / GIB:.2f} GiB, backed up {figures['grads_backup'] / GIB:.2f} GiB; "
        f"process groups destroyed {figures['groups_released']} (device -{figures['groups_freed'] / 2**20:.1f} MiB), "
        f"rebuilt {figures['groups_rebuilt']}; after resume: log-probs max |diff| {figures['lp_diff']:.3g}, "
        f"grads rel {figures['grad_rel']:.3g}"
    )
    assert after == state, "state after resume differs"
    assert paused_weights == live, "weights read from the backup differ from the live ones"
    assert figures["lp_diff"] < 1e-3 and figures["grad_rel"] < 1e-3, figures
    assert math.isfinite(m2["loss"]) and math.isfinite(m2["grad_norm"])
    return figures


def test_megatron_pause_resume_with_unbacked_grad_buffers_next_to_fsdp(ray_cluster):
    ray = ray_cluster
    meg = _pause_cycle(ray, "megatron")
    fsdp = _pause_cycle(ray, "fsdp")
    # Megatron keeps its gradient buffers between steps (paused without backup); FSDP2 drops its grads.
    assert meg["grads_bytes"] > 0 and meg["grads_backup"] == 0, meg
    assert fsdp["grads_backup"] == 0, fsdp
    for f in (meg, fsdp):
        assert f["device_before"] - f["device_after"] >= 0.9 * (f["backups"] + f["grads_bytes"]), f
    # Megatron's communicators go before the pause and come back after it (one rank each here).
    assert meg["groups_released"] > 0 and meg["groups_rebuilt"] == 1 and meg["groups_freed"] >= 0, meg
    print(
        f"host RSS growth while paused: megatron {meg['rss_growth'] / GIB:.2f} GiB, fsdp {fsdp['rss_growth'] / GIB:.2f} GiB "
        f"(backups {meg['backups'] / GIB:.2f} GiB each; grad buffers not backed up: megatron "
        f"{meg['grads_bytes'] / GIB:.2f} GiB, fsdp {fsdp['grads_bytes'] / GIB:.2f} GiB)"
    )
    # Host memory while paused holds the backups only: no gradient buffers, no optimizer-step temporaries.
    for f in (meg, fsdp):
        assert f["rss_growth"] <= 1.1 * f["backups"] + 256 * 1024**2, f
    a, b = meg["next_step"], fsdp["next_step"]  # the step after the resume (Megatron's through rebuilt groups)
    for k in ("loss", "entropy", "grad_norm"):
        print(f"step after resume {k}: megatron {a[k]:.6g} fsdp {b[k]:.6g}")
    assert a["tokens"] == b["tokens"]
    assert abs(a["entropy"] - b["entropy"]) < 0.02 * max(1.0, abs(b["entropy"]))
    assert abs(a["grad_norm"] - b["grad_norm"]) < 0.1 * b["grad_norm"]


def test_megatron_checkpoint_loads_in_both_layouts_and_fsdp_and_exports(ray_cluster, tmp_path):
    """Checkpoints written by the Megatron backend (tidal's format, by HF names), one without the distributed
    optimizer (written while paused, from the host backups) and one with it: each loads bit for bit into the
    other layout and into the FSDP2 backend; the HF export loads with transformers."""
    ray = ray_cluster
    out = str(tmp_path / "hf")
    # A small model: the point is the format and the layouts (the 0.5B shape is in the tests above).
    plain, _ = _start(ray, "megatron", model="tiny-qwen2", gpus=0.3, offload=True)
    dist_opt, _ = _start(ray, "megatron", model="tiny-qwen2", gpus=0.3, use_distributed_optimizer=True)
    fsdp, _ = _start(ray, "fsdp", model="tiny-qwen2", gpus=0.3)
    states = {}
    for name, actor, seed in (("plain", plain, 0), ("distributed", dist_opt, 1)):
        ray.get(actor.train.remote(_samples(seed), 0))
        states[name] = ray.get(actor.state_checksums.remote())
        assert any(k.startswith("optim/") for k in states[name])
        if name == "plain":
            ray.get(actor.pause.remote())
        ray.get(actor.save.remote(str(tmp_path / name), {"rollout_id": 0}))
        if name == "plain":
            ray.get(actor.resume.remote())
    assert states["plain"] != states["distributed"]
    moved = ray.get(dist_opt.__ray_call__.remote(lambda self: self.weights_rehomed))
    n_state, n_adopted, _ = ray.get(dist_opt.__ray_call__.remote(_adopted))
    print(
        f"\ndistributed optimizer: parameter buffers moved into WEIGHTS {moved / 2**20:.1f} MiB; "
        f"optimizer state adopted {n_adopted} of {n_state}"
    )
    assert moved > 0 and n_state > 0 and n_adopted == n_state
    for name, loader in (("plain", dist_opt), ("distributed", plain), ("plain", fsdp), ("distributed", fsdp)):
        ray.get(loader.load.remote(str(tmp_path / name)))
        loaded = ray.get(loader.state_checksums.remote())
        assert loaded == states[name], (name, sorted(set(loaded) ^ set(states[name]))[:5])
    ray.get(plain.export.remote(out))  # holds the distributed optimizer's checkpoint now
    for actor in (plain, dist_opt, fsdp):
        ray.kill(actor)
    print(
        f"checkpoints of {len(states['plain'])} tensors (written while paused; with the distributed optimizer) "
        "load bit for bit into the other layout and into fsdp"
    )

    from transformers import AutoModelForCausalLM

    from tidal.weight_sync.checksum import tensor_checksum

    model = AutoModelForCausalLM.from_pretrained(out)
    got = {n: tensor_checksum(p.detach()) for n, p in model.named_parameters()}
    assert {k: states["distributed"][k] for k in got} == got


# ---- 5. tensor and pipeline parallelism on two GPUs (needs a host with two) ------------------------------
def test_megatron_tp2_and_pp2_on_two_gpus_train_like_one(ray_cluster):
    """TP = 2, then PP = 2, over two GPUs (NCCL), with a pause/resume between two rollouts (groups of two ranks
    destroyed and rebuilt): the same tokens, losses, entropy and gradient norm as one GPU, within bf16 noise."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ray = ray_cluster
    results = {}
    for name, world, sizes in (
        ("tp1", 1, {}),
        ("tp2", 2, {"tensor_model_parallel_size": 2}),
        ("pp2", 2, {"pipeline_model_parallel_size": 2}),
    ):
        ranks = _start_ranks(ray, world, model="tiny-qwen2", global_batch_size=8, **sizes)
        rows = []
        for i in range(2):
            if i:
                ray.get([a.resume.remote() for a in ranks])
            rows.append(ray.get([a.train.remote(_samples(i), i) for a in ranks])[0])
            pause = ray.get([a.pause.remote() for a in ranks])[0].metrics
        results[name] = rows
        print(
            f"\n{name}: "
            + "; ".join(
                f"loss {m['loss']:.6g} entropy {m['entropy']:.6g} grad_norm {m['grad_norm']:.6g}"
                f" train {m['train_s']:.2f} s"
                for m in rows
            )
            + f"; groups destroyed {pause.get('memory/trainer_pause/groups_released')}"
        )
        for a in ranks:
            ray.kill(a)
    for name in ("tp2", "pp2"):
        for got, one in zip(results[name], results["tp1"]):
            assert got["tokens"] == one["tokens"] and got["optimizer_steps"] == one["optimizer_steps"], name
            assert abs(got["entropy"] - one["entropy"]) < 0.01 * max(1.0, abs(one["entropy"])), (name, got, one)
            assert abs(got["loss"] - one["loss"]) < 0.01 * max(0.1, abs(one["loss"])), (name, got, one)
            assert abs(got["grad_norm"] - one["grad_norm"]) < 0.05 * one["grad_norm"], (name, got, one)
