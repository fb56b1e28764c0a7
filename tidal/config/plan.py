"""Model shape and the memory plan per rank: what each state class costs, on device and on host.

The plan decides whether offloading is needed at all. Offload costs time (the trainer's backed-up
state crosses PCIe twice per step, and dominates small-model steps), so tidal only pauses what
must make room. The figures are estimates from the model's config (counted from its numbers for
Llama/Qwen2/Qwen3, ``tidal.model.shape``; other families built on the ``meta`` device, no weights
allocated) and the batch settings; their assumptions are printed by ``tidal explain``:

    trainer, per rank    fp32 master weights, fp32 grads, fp32 AdamW m and v, sharded over the
                         trainer ranks (FSDP2); activations of one micro-batch of
                         ``--max-tokens-per-gpu`` tokens in the compute dtype (calibrated on Qwen2)
                         plus the fp32 log-softmax over the vocabulary and its gradients; with
                         PPO's critic (``--advantage-estimator ppo``) the weights, grads and AdamW
                         state twice (the critic is the policy's backbone with a one-output head;
                         its activations come after the policy's are freed and are smaller)
    engine, per engine   a full copy of the weights in the engine dtype (fp32 on CPU, bf16 on
                         GPU); a KV cache holding every sample of its share of the rollout at full
                         length; one sync bucket while weights arrive
    reserve, per device  2 GiB + 8% on GPU (CUDA context, NCCL buffers, allocator slack); on CPU
                         the "device" is host memory and a quarter is kept for Ray and the OS

Phases of a colocated step and what is resident on a device in each (t, r = offload train/rollout):

    generate   engine weights + KV (+ trainer weights, grads, optimizer unless t)
    train      trainer weights, grads, optimizer, activations (+ engine weights + KV unless r)

The cheapest choice that fits is taken: nothing, then rollout only (engine memory is discarded,
not copied: the next sync rewrites it), then train only, then both.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from tidal.config.agent_rules import longest_sample, prefix_cache_bytes
from tidal.config.environment import Environment, format_bytes
from tidal.model.shape import ModelShape

GIB = 1024**3


@functools.lru_cache(maxsize=16)
def _shape(model: str, tokenizer: str | None, trust_remote_code: bool) -> ModelShape:
    from tidal.model.load import resolve_model

    spec = resolve_model(model, tokenizer, trust_remote_code)
    counted = _counted(spec)
    return counted if counted is not None else _meta_shape(spec)


def _counted(spec):
    """The shape by arithmetic (``tidal.model.shape``) when the family is one it knows, else None."""
    from tidal.model.shape import count_decoder

    if spec.trust_remote_code:
        return None  # the folder's own code may build anything
    config = spec.config_dict()
    return count_decoder(str(config.get("model_type")), config, spec.name)


def _meta_shape(spec) -> ModelShape:
    """Any architecture: build it on the ``meta`` device (no memory) and count."""
    import torch
    from transformers import AutoModelForCausalLM

    from tidal.model.load import model_config

    config = model_config(spec)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config, trust_remote_code=spec.trust_remote_code)
    params = list(net.parameters())  # named_parameters/parameters yield tied tensors once
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    dims = dict(
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
        vocab=text.vocab_size,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
    )
    return ModelShape.of_tensors(spec.name, type(net).__name__, [p.numel() for p in params], **dims)


def model_shape(cfg) -> ModelShape:
    """Shape of ``cfg.model.model`` from its config alone (cached; a 7B model takes a few seconds)."""
    m = cfg.model
    return _shape(m.model, m.tokenizer, m.trust_remote_code)


@dataclass
class Combo:
    offload_train: bool
    offload_rollout: bool
    generate_bytes: int
    train_bytes: int

    @property
    def peak(self) -> int:
        return max(self.generate_bytes, self.train_bytes)


@dataclass
class MemoryPlan:
    """Bytes per state class for one trainer rank and one engine, and the device budget they share."""

    device: str
    colocated: bool
    trainer: dict[str, int]  # state class -> bytes on device while active
    engine: dict[str, int]
    trainer_per_device: int  # trainer ranks sharing one budget (1 on GPU; ranks per node on CPU)
    engines_per_device: int
    budget: int  # usable bytes per device (host on CPU)
    capacity: int  # total bytes per device before the reserve
    host_budget: int  # usable host bytes per node
    trainer_ranks_per_node: int
    combos: list[Combo] = field(default_factory=list)

    @property
    def trainer_static(self) -> int:
        return sum(v for k, v in self.trainer.items() if k != "activations")

    @property
    def trainer_peak(self) -> int:
        return sum(self.trainer.values())

    @property
    def engine_static(self) -> int:
        # Stored prefixes stay until the next sync's flush, through training when not released.
        return self.engine["weights"] + self.engine["kv_cache"] + self.engine.get("prefix_cache", 0)

    @property
    def engine_peak(self) -> int:
        return sum(self.engine.values())

    def combo(self, offload_train: bool, offload_rollout: bool) -> Combo:
        t, e = self.trainer_per_device, self.engines_per_device
        if not self.colocated:
            return Combo(offload_train, offload_rollout, e * self.engine_peak, t * self.trainer_peak)
        generate = e * self.engine_peak + (0 if offload_train else t * self.trainer_static)
        train = t * self.trainer_peak + (0 if offload_rollout else e * self.engine_static)
        return Combo(offload_train, offload_rollout, generate, train)

    def fits(self, offload_train: bool, offload_rollout: bool) -> bool:
        return self.combo(offload_train, offload_rollout).peak <= self.budget

    def host_paused(self, offload_train: bool, host_mode: str) -> int:
        """Host bytes per node holding the trainer's backups while it is paused (0 when spilled to disk)."""
        if not offload_train or host_mode == "disk":
            return 0
        backed_up = self.trainer["weights"] + self.trainer["optimizer"]  # grads and activations: discarded
        return self.trainer_ranks_per_node * backed_up


def _budget(device: str, env: Environment) -> tuple[int, int]:
    if device == "cuda":
        cap = env.device_memory
        return cap, max(0, int(cap - 2 * GIB - 0.08 * cap))
    cap = env.host_memory
    return cap, int(cap * 0.75)


def build_plan(cfg, shape: ModelShape, env: Environment) -> MemoryPlan:
    """The memory plan of a config whose cluster, batch and device fields are already resolved."""
    c, r, t = cfg.cluster, cfg.rollout, cfg.trainer
    device = c.device
    ranks = c.actor_num_nodes * c.actor_num_gpus_per_node
    engines = max(1, (c.rollout_num_gpus or 1) // c.rollout_num_gpus_per_engine)
    P = shape.params
    compute_b = 2 if t.param_dtype == "bf16" else 4
    engine_b = 2 if device == "cuda" else 4

    tokens = t.max_tokens_per_gpu
    # Bytes saved for backward per token and layer, measured on Qwen2 with sdpa under bf16 autocast
    # (saved-tensor hooks): about 15*hidden + 4*intermediate elements of the compute dtype. Compiled
    # layers (CUDA) save fewer: the 0.5B shape's trainer peaked at 56.2 GiB for 32k-token micro-batches
    # on the H200, about 20k elements per token and layer besides the logits; 10*hidden +
    # 2.5*intermediate (21.1k there) keeps a margin.
    if t.compile_layers and device == "cuda":
        layer = (20 * shape.hidden + 5 * shape.intermediate) * compute_b // 2
    else:
        layer = (15 * shape.hidden + 4 * shape.intermediate) * compute_b
    if t.gradient_checkpointing:
        per_token = shape.layers * shape.hidden * 4 + layer  # fp32 layer inputs + one layer recomputed
    else:
        per_token = shape.layers * layer
    # Logits: the compute-dtype logits saved for backward and their gradient (the chunked log-prob
    # kernels never hold a whole fp32 softmax), plus two chunks of scratch (tidal.algos.logprobs).
    activations = tokens * per_token + tokens * shape.vocab * 2 * compute_b + (1 << 30)
    if device == "cuda" and ranks == 1:
        # One CUDA rank keeps every layer's gathered compute copy from its forward to its backward
        # (tidal.trainer.actor's one_rank_fsdp); its fp32 gradients are the size of the grads class.
        activations += P * compute_b
    models = 2 if cfg.algorithm.use_critic else 1  # the policy, and PPO's critic of the same size
    trainer = {
        "weights": math.ceil(models * P * 4 / ranks),
        "grads": math.ceil(models * P * 4 / ranks),
        "optimizer": math.ceil(models * P * 8 / ranks),
        "activations": activations,
    }
    samples_per_engine = math.ceil(r.rollout_batch_size * r.n_samples_per_prompt / engines)
    seq = longest_sample(cfg)  # a whole trajectory with an environment
    kv = samples_per_engine * seq * shape.layers * 2 * shape.kv_heads * shape.head_dim * engine_b
    engine = {
        "weights": P * engine_b,
        "kv_cache": kv,
        "sync_buffer": min(cfg.weight_sync.update_weight_buffer_size, P * engine_b),
    }
    if prefix_cache_bytes(cfg):  # multi-turn: prompt KV stored between turns, at most this much
        engine["prefix_cache"] = min(prefix_cache_bytes(cfg), kv)
    capacity, budget = _budget(device, env)
    if device == "cuda":
        trainer_per_device, engines_per_device = 1, 1
    else:
        # On CPU every rank and engine of a node shares the host's memory.
        trainer_per_device = c.actor_num_gpus_per_node
        engines_per_device = max(1, math.ceil(engines / c.actor_num_nodes))
    plan = MemoryPlan(
        device=device,
        colocated=c.colocate,
        trainer=trainer,
        engine=engine,
        trainer_per_device=trainer_per_device,
        engines_per_device=engines_per_device,
        budget=budget,
        capacity=capacity,
        host_budget=int(env.host_memory * 0.8),
        trainer_ranks_per_node=c.actor_num_gpus_per_node,
    )
    plan.combos = [plan.combo(a, b) for a, b in ((False, False), (False, True), (True, False), (True, True))]
    return plan


def choose_offload(
    plan: MemoryPlan, offload_train: bool | None, offload_rollout: bool | None
) -> tuple[bool, bool, bool]:
    """Cheapest (offload_train, offload_rollout) consistent with explicit choices; third: whether it fits."""
    order = ((False, False), (False, True), (True, False), (True, True))
    allowed = [
        (a, b)
        for a, b in order
        if (offload_train is None or a == offload_train) and (offload_rollout is None or b == offload_rollout)
    ]
    for a, b in allowed:
        if plan.fits(a, b):
            return a, b, True
    a, b = allowed[-1]
    return a, b, False


def describe_combo(plan: MemoryPlan, combo: Combo) -> str:
    return (
        f"generate {format_bytes(combo.generate_bytes)}, train {format_bytes(combo.train_bytes)} "
        f"of {format_bytes(plan.budget)} usable per {'GPU' if plan.device == 'cuda' else 'host'}"
    )
