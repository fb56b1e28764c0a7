"""Typed configuration sections, one per component.

Every knob of tidal lives in exactly one dataclass below. The CLI exposes each field as a flat
kebab-case flag (``rollout_batch_size`` -> ``--rollout-batch-size``), named like slime's where the
concept is the same. A field's metadata carries its help text and, where needed, its choices and
an explicit flag name. Components receive their own section, never the root: the trainer gets
``TrainerConfig`` and friends, the engine gets ``RolloutConfig``.

Defaults here are the *embedded default* preset: a tiny model on the built-in task, colocated on
the local machine. Fields whose default is ``None`` are resolved by ``tidal.config.validate``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def opt(default: Any, help: str, *, choices: tuple | None = None, flag: str | None = None, **kw: Any) -> Any:
    """A config field with CLI metadata (help text, choices, optional explicit flag name)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if flag is not None:
        meta["flag"] = flag
    meta.update(kw)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ClusterConfig:
    ray_address: str | None = opt(None, "Join an existing Ray cluster at this address instead of starting a local one.")
    device: str = opt("auto", "Where to run: cuda when a GPU is visible, else cpu.", choices=("auto", "cpu", "cuda"))
    colocate: bool = opt(True, "Trainer and rollout engines share the same devices and take turns on them.")
    actor_num_nodes: int = opt(1, "Nodes for the trainer.", min=1)
    actor_num_gpus_per_node: int = opt(1, "Trainer ranks per node (GPUs, or processes on CPU).", min=1)
    rollout_num_gpus: int | None = opt(
        None, "Devices for rollout engines in total (default: the trainer's when colocated, else 1).", min=1
    )
    rollout_num_gpus_per_engine: int = opt(1, "Devices per rollout engine (the embedded engine uses one).", min=1)
    num_cpus_per_actor: float = opt(1.0, "CPUs reserved per trainer rank in the placement group.", min=0)
    train_env_vars: dict = opt({}, "Extra environment variables for training processes, as a JSON object.")
    compile_cache_dir: str = opt(
        "~/.cache/tidal/compile",
        "Where the actors of a local cluster keep torch.compile's caches (inductor FX graphs, AOTAutograd, "
        "triton kernels) across runs, so a run after the first skips most compiling; empty: torch's own "
        "defaults (under /tmp).",
    )
    warm_up: bool | None = opt(
        None,
        "Compile and capture before the first rollout, on every actor at once: each engine runs one decode step "
        "at the first rollout's batch size (torch.compile, CUDA graph capture), the trainer a forward and backward "
        "of a small and a half-size dummy micro-batch (its compiled layers and log-prob kernels), gradients dropped. The "
        "first step then does not wait for one side's compiling after the other's. Default: on with CUDA when "
        "something compiles or captures and trainer and engines stay resident (no offload).",
    )
    warm_process: str = opt(
        "auto",
        "A local cluster's actors as forks of one process that imported torch and the model's code while Ray "
        "started (the imports leave the actors' start; on an H100 host the 0.5B preset's first step came 5 s "
        "sooner). auto: wherever the cluster starts here with embedded engines, CPU or GPU (not with "
        "--ray-address or server engines); on: the same, refused where it cannot apply; off: never. Actors whose "
        "environment must be set before they start (torch_memory_saver's preload hook) start as usual.",
        choices=("auto", "on", "off"),
    )


@dataclass
class ModelConfig:
    model: str = opt(
        "tiny", "A preset model name (tiny, tiny-qwen2, smollm2-135m) or a local Hugging Face model folder."
    )
    tokenizer: str | None = opt(None, "Tokenizer folder (default: the model's).")
    trust_remote_code: bool = opt(False, "Allow model code from the model folder.")
    init_on_device: bool | None = opt(
        None,
        "Draw a preset's random initial weights on the device it trains and decodes on (the device's generator: "
        "a fraction of a second for a 0.5B preset where the host takes tens of seconds; the same numbers on the "
        "same GPU model) when its fp32 copy is at most 1/8 of the device, else on the host; off: always on the "
        "host (the same numbers on any machine). Default: on with CUDA.",
    )


@dataclass
class TrainerConfig:
    train_backend: str = opt(
        "fsdp",
        "Training backend: fsdp (PyTorch FSDP2) or megatron (Megatron-core: tensor and pipeline parallel; "
        "CUDA only, pip install 'tidal[megatron]').",
        choices=("fsdp", "megatron"),
    )
    tensor_model_parallel_size: int = opt(
        1, "Megatron: ranks that split each layer's heads, MLP and vocabulary (tensor parallelism).", min=1
    )
    pipeline_model_parallel_size: int = opt(1, "Megatron: pipeline stages the layers are split into.", min=1)
    context_parallel_size: int = opt(
        1, "Megatron: ranks that split each sequence (only 1: micro-batches are padded rectangles).", min=1
    )
    sequence_parallel: bool = opt(
        False, "Megatron: split norms' and dropouts' activations along the sequence over the tensor-parallel ranks."
    )
    use_distributed_optimizer: bool = opt(
        False, "Megatron: shard the optimizer state over data-parallel ranks (ZeRO-1; reduce-scatter of grads)."
    )
    use_nccl_ub: bool = opt(
        False, "Megatron: register the gradient buffers as NCCL user buffers (not with --offload-train)."
    )
    transformer_impl: str | None = opt(
        None,
        "Megatron: the layer spec, Transformer Engine's or Megatron's local (plain PyTorch) one "
        "(derived: transformer_engine when transformer_engine is installed, else local).",
        choices=("local", "transformer_engine"),
    )
    lr: float = opt(3e-3, "Peak learning rate of AdamW.", min=0)
    min_lr: float = opt(0.0, "Learning rate at the end of decay (constant after warmup when equal to lr).", min=0)
    lr_warmup_steps: int = opt(2, "Optimizer steps of linear warmup.", min=0)
    lr_decay_style: str = opt(
        "constant", "Learning-rate schedule after warmup.", choices=("constant", "cosine", "linear")
    )
    weight_decay: float = opt(0.0, "AdamW weight decay.", min=0)
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.99, "AdamW beta2.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.", min=0)
    clip_grad: float = opt(1.0, "Clip the global gradient norm to this value (0 disables).", min=0)
    global_batch_size: int | None = opt(None, "Samples per optimizer step (default: one step per rollout).", min=1)
    max_tokens_per_gpu: int = opt(4096, "Token budget of one micro-batch per rank; samples are packed up to it.", min=1)
    recompute_logprobs: bool = opt(
        False,
        "Recompute old log-probs in a separate no-grad pass even when a rollout is one optimizer step "
        "(there they equal the training pass's own, detached, and the pass is skipped).",
    )
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    compile_logprobs: bool = opt(
        True, "torch.compile the log-prob/entropy chunk kernels (CUDA with triton; off: the eager kernels)."
    )
    compile_layers: bool = opt(
        False,
        "torch.compile the forward of every decoder layer (policy, reference, critic) before sharding: fused "
        "norms, rotary and activations in forward and backward (CUDA with triton; the first step compiles, "
        "later runs read --compile-cache-dir).",
    )
    trained_logits_only: bool | None = opt(
        None,
        "Run the LM head and the log-prob kernels only at the positions the loss trains on (the policy's "
        "response tokens), not at prompt, environment or pad positions; default: on with CUDA, off on CPU.",
    )
    adamw_impl: str = opt(
        "auto",
        "AdamW's kernels: fused (one kernel per step for every tensor) or foreach (one kernel per operation over "
        "all tensors); auto: fused on CUDA, foreach on CPU.",
        choices=("auto", "fused", "foreach"),
    )
    dist_timeout_min: int = opt(30, "Timeout of the trainer's process-group collectives, in minutes.", min=1)
    param_dtype: str = opt(
        "auto", "Compute dtype of parameters: fp32 on CPU, bf16 on GPU when auto.", choices=("auto", "fp32", "bf16")
    )
    seed: int = opt(1234, "Random seed for model init, data order and sampling.")


ESTIMATORS = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "gspo",
    "cispo",
    "ppo",
)


@dataclass
class AlgorithmConfig:
    advantage_estimator: str = opt(
        "grpo",
        "How advantages are computed and which policy loss trains on them (docs/algorithms.md); ppo trains a critic.",
        choices=ESTIMATORS,
    )
    grpo_std_normalization: bool = opt(True, "Divide group-centred rewards by the group std (off = Dr.GRPO mean-only).")
    eps_clip: float = opt(0.2, "PPO clip range below 1.", min=0)
    eps_clip_high: float | None = opt(
        None, "PPO clip range above 1 (default: eps-clip); a larger one is DAPO's clip-higher.", min=0
    )
    use_kl_loss: bool = opt(False, "Add a KL penalty to a frozen reference model.")
    kl_loss_coef: float = opt(0.0, "Weight of the KL penalty.", min=0)
    kl_loss_type: str = opt("k3", "KL estimator.", choices=("k1", "k2", "k3"))
    entropy_coef: float = opt(0.0, "Weight of the entropy bonus (the entropy is always reported).")
    loss_agg_mode: str = opt(
        "token-mean", "How token losses are averaged.", choices=("token-mean", "seq-mean-token-mean")
    )
    dynamic_sampling: bool = opt(False, "Drop groups whose rewards all equal (zero advantage) before training.")
    gamma: float = opt(1.0, "Discount of token rewards (ppo's GAE and reinforce_plus_plus returns).", min=0)
    lambd: float = opt(1.0, "GAE lambda of ppo (1: Monte-Carlo returns minus the value).", min=0)
    overlong_buffer_len: int = opt(
        0,
        "DAPO soft overlong penalty: the last N tokens before --rollout-max-response-len cost reward linearly (0: off).",
        min=0,
    )
    overlong_penalty_factor: float = opt(1.0, "Reward lost by a response of the full length under the penalty.", min=0)
    use_rollout_logprobs: bool = opt(
        False, "The engine's log-probs are the old policy of the PPO ratio (no trainer recompute of old log-probs)."
    )
    use_tis: bool = opt(
        False, "Correct for the engine's sampling policy: weight (or mask) each token by pi_old / pi_engine."
    )
    tis_clip: float = opt(
        2.0, "Upper bound C of the importance ratio (truncate: clip to C; mask: drop above C).", min=0
    )
    tis_clip_low: float = opt(
        0.0, "Lower bound of the importance ratio (truncate: clip up to it; mask: drop below it).", min=0
    )
    tis_mode: str = opt(
        "truncate",
        "truncate the ratio to its bounds (TIS) or mask tokens outside them (IcePop).",
        choices=("truncate", "mask"),
    )
    tis_level: str = opt(
        "token",
        "Ratio per token, or per response (its geometric mean, applied to every token).",
        choices=("token", "sequence"),
    )
    custom_tis_function_path: str | None = opt(
        None, "module:function replacing the built-in correction (see tidal.algos.correction.apply_correction)."
    )
    use_critic: bool | None = opt(
        None, "Train a value model next to the policy; follows from --advantage-estimator ppo (default)."
    )
    value_clip: float = opt(0.2, "Clip range of the value loss around the values the advantages used.", min=0)
    critic_lr: float | None = opt(None, "Learning rate of the critic's AdamW (default: --lr).", min=0)


@dataclass
class RolloutConfig:
    num_rollout: int = opt(60, "Rollout-train iterations to run.", min=1)
    rollout_batch_size: int = opt(32, "Prompts per rollout.", min=1)
    n_samples_per_prompt: int = opt(8, "Responses sampled per prompt (the GRPO group size).", min=1)
    rollout_max_response_len: int = opt(1, "Maximum new tokens per response.", min=1)
    rollout_max_prompt_len: int = opt(512, "Prompts longer than this (in tokens) are rejected.", min=1)
    rollout_temperature: float = opt(1.0, "Sampling temperature.", min=0)
    rollout_top_p: float = opt(1.0, "Nucleus sampling threshold.", min=0)
    rollout_top_k: int = opt(0, "Top-k sampling (0 disables).", min=0)
    rollout_stop: list = opt([], "Stop strings; generation of a sample ends at the first one.")
    rollout_seed: int = opt(42, "Seed of the engines' sampling.")
    custom_generate_function_path: str | None = opt(None, "module:function replacing the engine's generate step.")
    env_path: str | None = opt(
        None, "module:Class of the environment answering each policy turn (multi-turn rollouts; docs/multi-turn.md)."
    )
    max_turns: int = opt(4, "Policy turns per trajectory at most (multi-turn).", min=1)
    max_trajectory_tokens: int = opt(
        1024, "Response tokens per trajectory at most, policy and environment together (multi-turn).", min=1
    )
    env_timeout: float = opt(60.0, "Seconds one environment call (reset or step) may take (multi-turn).", min=0.001)
    agent_reward: str = opt(
        "env",
        "A trajectory's reward: the environment's step rewards, the reward function over the whole trajectory, or both.",
        choices=("env", "rm", "sum"),
    )
    rollout_engine: str = opt(
        "embedded",
        "embedded: the policy inside each engine actor; sglang: engines are servers speaking SGLang's HTTP protocol.",
        choices=("embedded", "sglang"),
    )
    rollout_external_engine_addrs: list = opt(
        [], "host:port of servers started outside tidal (with --rollout-engine sglang), space or comma separated."
    )
    sglang_server: str = opt(
        "tidal",
        "Server tidal starts per engine when no external addresses are given: tidal serve, or sglang.launch_server.",
        choices=("tidal", "sglang"),
    )
    sglang_server_args: list = opt(
        [], "Extra flags for started servers; every unknown --sglang-X flag is passed on as --X (as slime does)."
    )
    rollout_engine_api_key: str | None = opt(None, "API key sent to the engine servers (Authorization: Bearer).")
    engine_start_timeout: float = opt(600.0, "Seconds a started server may take to answer /health.", min=1)
    engine_health_timeout: float = opt(
        30.0,
        "Seconds an engine may take to answer its health probe (/health; an embedded engine's health()) "
        "while generating, before it counts as dead (hung) and is restarted.",
        min=1,
    )
    rollout_env_vars: dict = opt(
        {},
        "Extra environment variables for the engine processes, as a JSON object (e.g. CUDA MPS's "
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE or CUDA_MPS_CLIENT_PRIORITY for an engine sharing one GPU with the trainer).",
    )
    max_engine_restarts: int = opt(3, "Engine restarts (or reconnects) a run survives before it stops.", min=0)
    eval_interval: int = opt(0, "Evaluate greedy accuracy on held-out prompts every N rollouts (0 disables).", min=0)
    debug_rollout_only: bool = opt(False, "Only generate; never train (turns colocate and offload off).")
    rollout_fast_decode: bool = opt(
        True, "Static KV cache, on-device sampling and CUDA graphs; off uses transformers generate."
    )
    rollout_mem_fraction: float = opt(
        0.45, "Device memory the engine may hold at its peak (weights + KV cache + workspace); CPU uses 1 GiB.", min=0
    )
    rollout_cuda_graphs: bool = opt(True, "Capture decode steps in CUDA graphs (CUDA only).")
    rollout_max_batch: int = opt(512, "Rows an engine decodes together; more are generated in waves.", min=1)
    rollout_kv_block: int = opt(256, "Attention-length step of the decode graphs (tokens).", min=1)
    rollout_compile: bool | None = opt(
        None, "torch.compile the decode step (attention stays eager); default: on with CUDA, off on CPU."
    )
    rollout_compile_options: dict | None = opt(
        None,
        "Inductor options for every graph the compiled decode step builds (torch.compile's options, a JSON object "
        "of names and JSON scalars, e.g. '{\"combo_kernels\": false}'); default: combo kernels on with CUDA (the "
        "step's small independent kernels launched as one), nothing on CPU.",
    )
    rollout_sampler_noise: str = opt(
        "auto",
        "The fast decode path's noise for unfiltered sampling: buffer (an fp32 [rows, vocab] tensor drawn, then "
        "read by the sampler), drawn (inside the compiled sampler's kernel, nothing written) or blocks (two exact "
        "stages, a block of 32-256 words by its mass, then a word of it: rows x (vocab/block + block) draws; "
        "compiled or not). drawn and blocks make other draws than buffer's for the same seed; auto: blocks with "
        "CUDA, buffer on CPU.",
        choices=("auto", "buffer", "drawn", "blocks"),
    )
    rollout_fused_decode: bool = opt(
        False,
        "Decode steps with one stacked q/k/v matmul and one gate/up matmul per layer, compiled (with "
        "--rollout-compile) in three pieces between the attention calls (Llama/Qwen2/Qwen3; the stacked weights "
        "are refreshed from the model at every generate and are kv_cache memory).",
    )
    rollout_fused_kv_write: bool = opt(
        False,
        "With --rollout-fused-decode: each piece of the fused step writes the next layer's keys and values into "
        "the KV cache itself (one in-place write the compiler fuses with the rotary embedding), in the decode "
        "steps and the prefill, and the attention call only reads them, instead of two copies a layer.",
    )
    rollout_decode_attention: str = opt(
        "auto",
        "Decode-step attention kernel: sdpa (SDPA over the KV length rounded up to --rollout-kv-block, additive "
        "mask) or flex (FlexAttention's decoding kernel with a per-row block mask: each row reads only the "
        "64-token blocks it has written; one CUDA graph per batch bucket); auto: flex with CUDA, sdpa on CPU.",
        choices=("auto", "sdpa", "flex"),
    )
    rollout_prefix_cache_mb: int | None = opt(
        None,
        "Prompt KV the fast decode path keeps between calls, reused when a request extends an earlier one "
        "(multi-turn); default: 1024 with an environment, else 0 (off).",
        min=0,
    )
    # Asynchronous training (tidal.driver_async, docs/async.md).
    async_mode: str = opt(
        "off",
        "Overlap generation with training: one-step generates rollout k+1 while rollout k trains (one version "
        "behind); full keeps the engines generating into a bounded buffer.",
        choices=("off", "one-step", "full"),
        flag="--async",
    )
    max_staleness: int = opt(
        1, "--async full: a sample more than N weight versions behind the trainer is dropped (and counted).", min=0
    )
    async_buffer_size: int | None = opt(
        None,
        "--async full: prompt groups generated ahead of the trainer, in flight or buffered "
        "(default: rollout-batch-size x max-staleness, at least one batch).",
        min=1,
    )
    partial_rollout: bool = opt(
        False,
        "--async full: requests in flight at a weight update are paused and continued on the new weights, each "
        "token's weight version recorded.",
    )
    over_sampling_batch_size: int | None = opt(
        None,
        "Prompts drawn per generation round (default: one round of rollout-batch-size); the first rollout-batch-size "
        "groups kept are trained, and with --dynamic-sampling rounds continue until that many are kept (slime's "
        "semantics).",
        min=1,
    )


def init_on_device_default(device: str) -> bool:
    """``--init-on-device`` when unset: on with CUDA (the host is then the slow place to draw weights)."""
    return device == "cuda"


def decode_attention_default(device: str) -> str:
    """``--rollout-decode-attention auto``: flex with CUDA (compiled kernel), sdpa elsewhere (flex runs its
    eager reference there)."""
    return "flex" if device == "cuda" else "sdpa"


def sampler_noise_default(device: str) -> str:
    """``--rollout-sampler-noise auto``: blocks with CUDA (the sampler's noise a step: rows x (V/B + B) draws
    instead of rows x V); buffer on CPU, which keeps its default run's draws."""
    return "blocks" if device == "cuda" else "buffer"


def trained_logits_only_default(device: str) -> bool:
    """``--trained-logits-only`` when unset: on with CUDA; off on CPU, which keeps its default run's numbers."""
    return device == "cuda"


def rollout_compile_options_default(device: str) -> dict:
    """``--rollout-compile-options`` when unset: combo kernels with CUDA (the decode step's independent small
    kernels, e.g. the rotary embedding of the queries and of the keys, launched together: in the 0.5B preset's
    loop on an H100 the decode steps took 0.597 s a rollout against 0.660 s and the step 1.66 s against 1.73 s,
    the same log-probs, for ~1 s more of a cold first compile), nothing elsewhere (inductor's C++ backend has no
    combo kernels)."""
    return {"combo_kernels": True} if device == "cuda" else {}


def rollout_compile_default(device: str) -> bool:
    """``--rollout-compile`` when unset: on with CUDA, off elsewhere (where decode steps are not captured)."""
    return device == "cuda"


@dataclass
class DataConfig:
    task: str = opt(
        "digit-sum",
        "Built-in task when no --prompt-data is given (guess and calculator are multi-turn).",
        choices=("digit-sum", "arith", "mental-math", "guess", "calculator"),
    )
    prompt_data: str | None = opt(None, "Prompts as JSONL or Parquet.")
    input_key: str = opt("prompt", "Field of a row that holds the prompt (text or chat messages).")
    label_key: str = opt("label", "Field of a row that holds the reference answer.")
    apply_chat_template: bool = opt(True, "Wrap prompts in the tokenizer's chat template when it has one.")
    rm_type: str = opt("exact", "Built-in reward function.", choices=("exact", "math", "format"))
    custom_rm_path: str | None = opt(None, "module:function computing a reward from (prompt, response, label).")
    rollout_shuffle: bool = opt(True, "Shuffle prompts each epoch.")


@dataclass
class MemoryConfig:
    offload: bool | None = opt(None, "Shorthand: sets both --offload-train and --offload-rollout.")
    offload_train: bool | None = opt(None, "Pause trainer device memory while engines generate.")
    offload_rollout: bool | None = opt(None, "Release engine weights and KV cache while the trainer trains.")
    disable_grad_buffers_cpu_backup: bool | None = opt(
        None,
        "Megatron: gradient buffers live in a torch_memory_saver region without host backup "
        "(derived: on exactly when --offload-train is; they are zeroed before every step).",
    )
    memory_backend: str = opt(
        "auto", "Pause/resume implementation: tms on CUDA, portable elsewhere.", choices=("auto", "tms", "portable")
    )
    tms_hook_mode: str = opt("torch", "How torch_memory_saver hooks allocations.", choices=("torch", "preload"))
    offload_host_memory: str | None = opt(
        None,
        "Host backup lifetime: release after resume, retain pinned (fastest), or spill to disk "
        "(default: retain when the host has room for the backups, else release).",
        choices=("release", "retain", "disk"),
    )
    offload_disk_dir: str | None = opt(None, "Directory for --offload-host-memory disk.")
    train_resume_early: str | None = opt(
        None,
        "With --offload-train: what of the paused trainer comes back while the engines generate (its copy from the "
        "host beside the decoding): all, its weights, or nothing until the generate ends (default: weights on GPU where "
        "the memory plan fits them beside the generate phase, else off; an asked-for value must fit there on GPU). With "
        "weights or all the sync keeps the weights where this would bring them back (not before an evaluation, a "
        "checkpoint or the end).",
        choices=("off", "weights", "all"),
    )
    check_memory_plan: bool = opt(
        True, "Refuse to start when the estimated memory plan does not fit the devices (see `tidal explain`)."
    )
    record_memory_history: bool = opt(False, "Record the CUDA allocator history and write snapshots.")
    memory_snapshot_dir: str | None = opt(
        None, "Where --record-memory-history writes snapshots (default: <output-dir>/memory-snapshots)."
    )
    memory_snapshot_steps: int = opt(2, "Steps recorded before the snapshot is written.", min=1)


@dataclass
class WeightSyncConfig:
    update_weight_mode: str = opt(
        "full", "Ship all weights each sync, or only changed bytes.", choices=("full", "delta")
    )
    update_weight_transport: str | None = opt(
        None,
        "tensor (colocated, in process), broadcast (process group), or disk.",
        choices=("tensor", "broadcast", "nccl", "disk"),
    )
    update_weight_buffer_size: int = opt(
        512 * 1024**2, "Bucket size in bytes (suffixes accepted: 512MiB, 1GiB).", min=1, unit="bytes"
    )
    update_weight_disk_dir: str | None = opt(None, "Directory for disk transport.")
    update_weight_disk_keep_files: bool = opt(False, "Keep each version's folder after engines loaded it.")
    update_weight_delta_encoding: str = opt("overwrite", "Delta encoding.", choices=("xor", "overwrite"))
    update_weight_compression: str = opt("zstd", "Delta payload compression.", choices=("zstd", "none"))
    update_weight_checksum: str = opt(
        "xxh3-128",
        "Checksum of each new tensor (blake3 needs the blake3 extra).",
        choices=("xxh3-128", "blake3", "adler32", "none"),
    )
    update_weight_local_checkpoint_dir: str | None = opt(None, "Per-host folder where delta-over-disk is applied.")
    check_weight_update_equal: bool = opt(
        False, "Randomise engine weights at start and compare bit for bit after the first sync."
    )


@dataclass
class CheckpointConfig:
    save: str | None = opt(None, "Directory for trainer checkpoints.")
    save_interval: int = opt(0, "Save every N rollouts (0: only at the end when --save is set).", min=0)
    load: str | None = opt(
        None,
        "Resume from the newest intact checkpoint in this directory (or from one iter_* folder); the same folder as "
        "--save with no checkpoint yet starts fresh.",
    )
    keep_checkpoints: int = opt(
        0, "Keep the newest N checkpoints under --save; older ones go once a new one is complete (0 keeps all).", min=0
    )


@dataclass
class LoggingConfig:
    output_dir: str | None = opt(None, "Run directory (default: runs/<time>-<model>).")
    use_tensorboard: bool = opt(False, "Also write TensorBoard events into the run directory.")
    progress: bool = opt(True, "Show a live progress display.")
    log_samples: int = opt(4, "Samples per rollout written to samples.jsonl in the run directory (0: none).", min=0)
    show_samples: bool = opt(False, "Print one sample per rollout on the console (prompt, response, label, reward).")
    log_level: str = opt("info", "Log verbosity.", choices=("debug", "info", "warning", "error"))
    profile_rollouts: list = opt(
        [],
        "Rollout ids whose generate (each embedded engine's first call of the rollout) and train (trainer rank 0) "
        "run under torch.profiler: a kernel summary and a Chrome trace of each in <output-dir>/profiles/.",
    )


@dataclass
class ServeConfig:
    """``tidal serve``: the embedded engine as an HTTP server speaking SGLang's protocol (docs/engines.md)."""

    serve_host: str = opt("127.0.0.1", "Address tidal serve binds (0.0.0.0: every interface).", flag="--host")
    serve_port: int = opt(30000, "Port tidal serve listens on (0: a free one, printed at start).", min=0, flag="--port")
    serve_api_key: str | None = opt(
        None,
        "Key every tidal serve request must send as 'Authorization: Bearer KEY' (or set TIDAL_SERVE_API_KEY).",
        flag="--api-key",
    )
    served_model_name: str | None = opt(None, "Model name in /v1/models and OpenAI replies (default: --model).")
    serve_batch_wait_ms: float = opt(
        50.0,
        "tidal serve starts an engine step once --rollout-max-batch rows are queued or no request came for this long.",
        min=0,
    )


SECTIONS: dict[str, type] = {
    "cluster": ClusterConfig,
    "model": ModelConfig,
    "trainer": TrainerConfig,
    "algorithm": AlgorithmConfig,
    "rollout": RolloutConfig,
    "data": DataConfig,
    "memory": MemoryConfig,
    "weight_sync": WeightSyncConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "serve": ServeConfig,
}


@dataclass
class TidalConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def field_index() -> dict[str, tuple[str, dataclasses.Field]]:
    """Map each flat field name to (section name, dataclass field). Field names are unique across sections."""
    index: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.name in index:
                raise RuntimeError(f"config field {f.name} defined in both {index[f.name][0]} and {section}")
            index[f.name] = (section, f)
    return index
