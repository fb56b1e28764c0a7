"""``tidal explain``: the resolved configuration, where each value came from, and the memory plan.

Prints every field grouped by section with its source (default, preset, file, flag, or the rule that
derived it), the quantities the loop derives from them (optimizer steps per rollout, micro-batches,
gradient accumulation, samples per rank, weight-sync buckets), and a memory plan per trainer rank
and per engine: bytes of each state class on the device while active, on the device while paused,
and on the host while paused; and whether offloading is needed at all. Nothing is started, so a GPU
run can be planned on a laptop with ``--assume-gpus 8 --assume-gpu-memory 80GiB``.
"""

from __future__ import annotations

import json
import math

from tidal.config.agent_rules import longest_sample
from tidal.config.args import fields, parse
from tidal.config.environment import Environment, format_bytes, split_assumptions
from tidal.config.plan import MemoryPlan, ModelShape, build_plan, describe_combo, model_shape
from tidal.config.provenance import Provenance
from tidal.config.schema import TidalConfig
from tidal.config.validate import resolve


def _fmt(value, unit: str | None = None) -> str:
    if unit == "bytes" and isinstance(value, int):
        return format_bytes(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def derived_quantities(cfg: TidalConfig, shape: ModelShape) -> list[tuple[str, str, str]]:
    """(name, value, how) for the quantities the loop derives from a resolved config."""
    c, r, t, w = cfg.cluster, cfg.rollout, cfg.trainer, cfg.weight_sync
    ranks = c.actor_num_nodes * c.actor_num_gpus_per_node
    engines = c.rollout_num_gpus // c.rollout_num_gpus_per_engine
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    gbs = t.global_batch_size
    per_rank = gbs // ranks
    longest = longest_sample(cfg)
    per_micro = max(1, t.max_tokens_per_gpu // longest)
    micro = math.ceil(per_rank / per_micro)
    engine_b = 2 if c.device == "cuda" else 4
    sync_bytes = shape.params * engine_b
    buckets = max(1, math.ceil(sync_bytes / w.update_weight_buffer_size))
    out = [
        (
            "samples per rollout",
            str(samples),
            f"rollout-batch-size {r.rollout_batch_size} x n-samples-per-prompt {r.n_samples_per_prompt}",
        ),
        ("optimizer steps per rollout", str(samples // gbs), f"samples per rollout / global-batch-size {gbs}"),
        (
            "trainer ranks",
            str(ranks),
            f"actor-num-nodes {c.actor_num_nodes} x actor-num-gpus-per-node {c.actor_num_gpus_per_node}",
        ),
        ("samples per rank per step", str(per_rank), f"global-batch-size {gbs} / {ranks} rank(s)"),
        (
            "micro-batches per step (at most)",
            str(micro),
            f"{per_micro} full-length sample(s) of {longest} tokens fit max-tokens-per-gpu {t.max_tokens_per_gpu}; shorter samples pack tighter",
        ),
        ("gradient accumulation (at most)", str(micro), "micro-batches summed into each optimizer step"),
        (
            "rollout engines",
            str(engines),
            f"rollout-num-gpus {c.rollout_num_gpus} / rollout-num-gpus-per-engine {c.rollout_num_gpus_per_engine}",
        ),
        ("samples per engine per rollout", str(math.ceil(samples / engines)), "samples per rollout / engines"),
        (
            "weight-sync bytes per sync",
            format_bytes(sync_bytes),
            f"{_count(shape.params)} params x {engine_b} B ({'bf16' if engine_b == 2 else 'fp32'} engine dtype)",
        ),
        (
            "weight-sync buckets",
            str(buckets),
            f"bytes / update-weight-buffer-size {format_bytes(w.update_weight_buffer_size)} ({w.update_weight_mode} over {w.update_weight_transport})",
        ),
    ]
    if t.train_backend == "megatron":
        model_ranks = t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size
        out.append(
            (
                "megatron data-parallel ranks",
                str(max(1, ranks // model_ranks)),
                f"trainer ranks / (tensor {t.tensor_model_parallel_size} x pipeline {t.pipeline_model_parallel_size} "
                f"x context {t.context_parallel_size}); the rollout plan is shared among these",
            )
        )
    if shape.largest_tensor * engine_b > w.update_weight_buffer_size:
        out.append(
            (
                "largest tensor",
                format_bytes(shape.largest_tensor * engine_b),
                "exceeds a bucket: sent as a bucket of its own",
            )
        )
    return out


def _memory_table(cfg: TidalConfig, plan: MemoryPlan) -> list[str]:
    m = cfg.memory
    host_mode = m.offload_host_memory
    rows = [f"  {'':<22}{'active (device)':>18}{'paused (device)':>18}{'paused (host)':>18}"]

    def line(name: str, active: int, dev: int, host: int | str) -> str:
        host_s = host if isinstance(host, str) else format_bytes(host)
        return f"  {name:<22}{format_bytes(active):>18}{format_bytes(dev):>18}{host_s:>18}"

    rows.append(f"  trainer rank ({'offload-train' if m.offload_train else 'never paused'}):")
    for cls in ("weights", "optimizer", "grads", "activations"):
        active = plan.trainer[cls]
        if m.offload_train:
            backed = cls in ("weights", "optimizer")
            host: int | str = (f"disk {format_bytes(active)}" if host_mode == "disk" else active) if backed else 0
            rows.append(line(f"    {cls}", active, 0, host))
        else:
            rows.append(line(f"    {cls}", active, 0 if cls == "activations" else active, 0))
    rows.append(f"  engine ({'offload-rollout' if m.offload_rollout else 'never released'}):")
    for cls in [c for c in ("weights", "kv_cache", "prefix_cache", "sync_buffer") if c in plan.engine]:
        active = plan.engine[cls]
        kept = 0 if (m.offload_rollout or cls == "sync_buffer") else active
        rows.append(line(f"    {cls}", active, kept, 0))
    return rows


def _shown(info, value) -> str:
    """A field's value as ``tidal explain`` prints it; a key (``*_api_key``) only says that it is set."""
    if info.name.endswith("api_key") and value:
        return "(set, not shown)"
    return _fmt(value, info.unit)


def explain(cfg: TidalConfig, prov: Provenance, env: Environment | None = None) -> str:
    """The text of ``tidal explain`` for a resolved config (``env``: this machine when omitted)."""
    env = env or Environment.detect()
    shape = model_shape(cfg)
    plan = build_plan(cfg, shape, env)
    out = ["tidal explain: the resolved configuration (nothing is started)", ""]
    out.append(f"environment  {env.describe()}")
    out.append(
        f"model        {shape.name} ({shape.arch}): {_count(shape.params)} parameters, {shape.layers} layers, "
        f"hidden {shape.hidden}, {shape.kv_heads} KV heads x {shape.head_dim}, vocab {shape.vocab}"
    )
    section = None
    width = max(len(f.flag) for f in fields())
    shown = {f.name: _shown(f, getattr(getattr(cfg, f.section), f.name)) for f in fields()}
    value_width = min(40, max(len(v) for v in shown.values()))
    for info in fields():
        if info.section != section:
            section = info.section
            out += ["", f"[{section}]"]
        out.append(f"  {info.flag:<{width}}  {shown[info.name]:<{value_width}}  {prov.of(info.name)}")
    if prov.overridden:
        out += ["", "overridden by a rule (you set one value, the rule needed another):"]
        for name, (previous, src) in prov.overridden.items():
            out.append(f"  {name}: {previous!r} from {src} -> {prov.of(name)}")

    out += ["", "derived quantities"]
    for name, value, how in derived_quantities(cfg, shape):
        out.append(f"  {name:<34}{value:>12}   {how}")

    where = "GPU" if plan.device == "cuda" else "host (CPU run: devices are host memory)"
    out += [
        "",
        f"memory plan (estimate; per trainer rank and per engine; {plan.trainer_per_device} rank(s) and {plan.engines_per_device} engine(s) per {where})",
    ]
    out += _memory_table(cfg, plan)
    if cfg.weight_sync.update_weight_mode == "delta":
        out.append(
            f"  delta snapshot on the trainer's host: {format_bytes(plan.engine['weights'])} (engine weights as last sent)"
        )
    out.append(
        f"  budget: {format_bytes(plan.budget)} usable of {format_bytes(plan.capacity)} per {'GPU' if plan.device == 'cuda' else 'host'}"
    )
    for combo in plan.combos:
        label = {
            (False, False): "no offload",
            (False, True): "offload rollout",
            (True, False): "offload train",
            (True, True): "offload both",
        }[(combo.offload_train, combo.offload_rollout)]
        verdict = "fits" if combo.peak <= plan.budget else "does not fit"
        out.append(f"    {label:<16} {describe_combo(plan, combo)}: {verdict}")
    m = cfg.memory
    if not cfg.cluster.colocate:
        out.append("  offload: not applicable: trainer and engines have their own devices")
    elif not m.offload_train and not m.offload_rollout and plan.fits(False, False):
        out.append(
            "  offload: NOT NEEDED for this model on this device: trainer and engines fit side by side, so nothing is paused"
        )
    else:
        chosen = [n for n, v in (("train", m.offload_train), ("rollout", m.offload_rollout)) if v] or ["nothing"]
        reasons = "; ".join(f"{n}: {prov.of(n)}" for n in ("offload_train", "offload_rollout"))
        out.append(f"  offload: {' + '.join(chosen)} ({reasons})")
    if m.offload_train:
        host = plan.host_paused(True, m.offload_host_memory)
        out.append(
            f"  host memory while the trainer is paused: {format_bytes(host)} per node of {format_bytes(plan.host_budget)} usable"
        )
        out.append(f"  host policy: {m.offload_host_memory} ({prov.of('offload_host_memory')})")
    if m.record_memory_history:
        out.append(
            f"  allocator history: snapshots of the first {m.memory_snapshot_steps} steps in {m.memory_snapshot_dir}"
        )
    return "\n".join(out) + "\n"


def explain_argv(argv: list[str], env: Environment | None = None) -> str:
    """``tidal explain [flags]`` in one call: ``--assume-*`` flags, parse, resolve, explain."""
    env, rest = split_assumptions(list(argv), env)
    cfg, prov = parse(rest, prog="tidal explain")
    cfg = resolve(cfg, prov, env)
    return explain(cfg, prov, env)
