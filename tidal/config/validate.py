"""The one validation pass: resolve every derived field and reject every combination that cannot work.

``resolve(cfg, prov, env)`` runs on the driver before Ray starts. It applies the rules below in
order; each rule either fills fields (and records in ``prov`` which rule derived them) or raises
``ConfigError`` with one line naming the flags and the fix. Rules are plain functions over the
config, so each is tested on its own with a table of inputs (tests/unit/test_config_rules.py), and
``docs/configuration.md`` lists them from ``RULES``. The device, model, engine and cluster rules are
written here; the others live with their section (``memory_rules``, ``algorithm_rules``,
``trainer_rules``, ``agent_rules``, ``megatron_rules``, ``run_rules``) and are registered here in order.

The slime rules are kept where tidal has the same concept (``--offload`` expands, colocate turns
offload on, a critic forces ``--offload-train`` (here: when colocated),
``--debug-rollout-only`` turns colocation and offload off, disk transport needs a folder). Where
tidal differs it says so: colocation turns offload on only when the memory plan says it is needed,
delta sync also works over tensor and broadcast transports, and ``nccl`` is read as ``broadcast``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from tidal.config import (
    agent_rules,
    algorithm_rules,
    async_rules,
    megatron_rules,
    memory_rules,
    run_rules,
    trainer_rules,
)
from tidal.config.args import coerce, fields, flag_of
from tidal.config.environment import Environment
from tidal.config.plan import MemoryPlan, ModelShape, build_plan, model_shape
from tidal.config.provenance import Provenance
from tidal.config.schema import (
    TidalConfig,
    decode_attention_default,
    init_on_device_default,
    rollout_compile_default,
    rollout_compile_options_default,
    sampler_noise_default,
    trained_logits_only_default,
)
from tidal.dtypes import default_dtype_name, short_name
from tidal.errors import ConfigError, UserError


@dataclass
class Context:
    cfg: TidalConfig
    prov: Provenance
    env: Environment
    _shape: ModelShape | None = None

    def shape(self) -> ModelShape:
        if self._shape is None:
            try:
                self._shape = model_shape(self.cfg)
            except UserError as exc:
                raise ConfigError(str(exc)) from None
        return self._shape

    def plan(self) -> MemoryPlan:
        return build_plan(self.cfg, self.shape(), self.env)

    def section_of(self, name: str):
        for section in dataclasses.fields(self.cfg):
            obj = getattr(self.cfg, section.name)
            if hasattr(obj, name):
                return obj
        raise KeyError(name)

    def get(self, name: str):
        return getattr(self.section_of(name), name)

    def derive(self, name: str, value, rule: str, why: str) -> None:
        """Set a field and record which rule chose the value."""
        obj = self.section_of(name)
        previous = getattr(obj, name)
        setattr(obj, name, value)
        self.prov.derive(name, rule, why, previous=previous)

    def explicit(self, name: str) -> bool:
        return self.prov.explicit(name)


@dataclass(frozen=True)
class Rule:
    id: str
    summary: str  # one line for the rules table of docs/configuration.md
    fn: Callable[[Context], None]


RULES: list[Rule] = []


def rule(id: str, summary: str) -> Callable[[Callable[[Context], None]], Callable[[Context], None]]:
    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        RULES.append(Rule(id, summary, fn))
        return fn

    return register


def rule_by_id(id: str) -> Rule:
    return next(r for r in RULES if r.id == id)


def _f(name: str) -> str:
    return flag_of(name)


# ---------------------------------------------------------------------------------------------------
# Rules, in the order they run. Earlier rules may feed later ones (device before memory backend,
# cluster sizes before the memory plan, the memory plan before the offload decision).


@rule("values", "Every value has its field's type, is one of its choices and at least its minimum.")
def _values(ctx: Context) -> None:
    # Flags and files were checked as they were read; this catches configs built in code.
    for info in fields():
        value = ctx.get(info.name)
        checked = coerce(info, value, info.flag)
        if checked != value or type(checked) is not type(value):
            setattr(ctx.section_of(info.name), info.name, checked)


@rule(
    "debug-rollout-only",
    "`--debug-rollout-only` starts no trainer and turns colocate, offload-train and offload-rollout off (nothing trains, "
    "nothing shares devices); `--save`/`--load` need a trainer and are refused with it.",
)
def _debug_rollout_only(ctx: Context) -> None:
    if not ctx.cfg.rollout.debug_rollout_only:
        return
    for name in ("save", "load"):
        if ctx.get(name):
            raise ConfigError(
                f"--debug-rollout-only starts no trainer, so {_f(name)} has nothing to {name}; drop one of the two"
            )
    why = "--debug-rollout-only: no trainer shares the devices"
    ctx.derive("colocate", False, "debug-rollout-only", why)
    for name in ("offload", "offload_train", "offload_rollout"):
        ctx.derive(name, False, "debug-rollout-only", why)


@rule("device", "`--device auto` is cuda when a GPU is visible, else cpu; `--device cuda` needs a GPU.")
def _device(ctx: Context) -> None:
    c = ctx.cfg.cluster
    if c.device == "auto":
        ctx.derive(
            "device",
            "cuda" if ctx.env.cuda_available else "cpu",
            "device",
            "auto: " + ("a GPU is visible" if ctx.env.cuda_available else "no GPU visible"),
        )
    elif c.device == "cuda" and not ctx.env.cuda_available:
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu (or auto), or run on a GPU host")


@rule(
    "rollout-compile",
    "`--rollout-compile` defaults to on with CUDA and off on CPU (where decode steps are not captured).",
)
def _rollout_compile(ctx: Context) -> None:
    if ctx.cfg.rollout.rollout_compile is None:
        on = rollout_compile_default(ctx.cfg.cluster.device)
        ctx.derive("rollout_compile", on, "rollout-compile", f"default on {ctx.cfg.cluster.device}")


@rule(
    "compile-options",
    "`--rollout-compile-options` defaults to combo kernels with CUDA and to nothing on CPU; its values are JSON "
    "scalars, and options need the compiled step (`--rollout-compile`).",
)
def _rollout_compile_options(ctx: Context) -> None:
    r = ctx.cfg.rollout
    if r.rollout_compile_options is None:
        opts = rollout_compile_options_default(ctx.cfg.cluster.device) if r.rollout_compile else {}
        ctx.derive("rollout_compile_options", opts, "compile-options", f"default on {ctx.cfg.cluster.device}")
        return
    for key, value in r.rollout_compile_options.items():
        if not isinstance(value, (bool, int, float, str)):
            raise ConfigError(
                f'--rollout-compile-options: {key} is {value!r}; give each option a JSON scalar (true, 4, "name")'
            )
    if r.rollout_compile_options and not r.rollout_compile:
        raise ConfigError(
            "--rollout-compile-options sets the compiled decode step's inductor options, and the step is not "
            "compiled; turn --rollout-compile on or drop --rollout-compile-options"
        )


@rule(
    "trained-logits",
    "`--trained-logits-only` defaults to on with CUDA and off on CPU (where the default run keeps its numbers).",
)
def _trained_logits(ctx: Context) -> None:
    if ctx.cfg.trainer.trained_logits_only is None:
        on = trained_logits_only_default(ctx.cfg.cluster.device)
        ctx.derive("trained_logits_only", on, "trained-logits", f"default on {ctx.cfg.cluster.device}")


@rule(
    "decode-attention",
    "`--rollout-decode-attention auto` is flex with CUDA and sdpa on CPU; flex is a kernel of the fast decode "
    "path: it needs `--rollout-fast-decode`.",
)
def _decode_attention(ctx: Context) -> None:
    r = ctx.cfg.rollout
    if r.rollout_decode_attention == "auto":
        kernel = decode_attention_default(ctx.cfg.cluster.device) if r.rollout_fast_decode else "sdpa"
        ctx.derive("rollout_decode_attention", kernel, "decode-attention", f"auto on {ctx.cfg.cluster.device}")
    elif r.rollout_decode_attention == "flex" and not r.rollout_fast_decode:
        raise ConfigError(
            "--rollout-decode-attention flex needs --rollout-fast-decode (transformers generate has its own "
            "attention); turn fast decode on or drop --rollout-decode-attention"
        )


@rule("fused-kv-write", "`--rollout-fused-kv-write` is a variant of the fused step: it needs `--rollout-fused-decode`.")
def _fused_kv_write(ctx: Context) -> None:
    r = ctx.cfg.rollout
    if r.rollout_fused_kv_write and not r.rollout_fused_decode:
        raise ConfigError(
            "--rollout-fused-kv-write has the fused decode step write the KV cache, and the fused step is off; "
            "add --rollout-fused-decode or drop --rollout-fused-kv-write"
        )


@rule(
    "sampler-noise",
    "`--rollout-sampler-noise auto` is blocks with CUDA and buffer on CPU (whose default run keeps its draws); "
    "drawn draws inside the compiled sampler: it needs the compiled step.",
)
def _sampler_noise(ctx: Context) -> None:
    r = ctx.cfg.rollout
    device = ctx.cfg.cluster.device
    if r.rollout_sampler_noise == "auto":
        ctx.derive("rollout_sampler_noise", sampler_noise_default(device), "sampler-noise", f"auto on {device}")
    elif r.rollout_sampler_noise == "drawn" and not r.rollout_compile:
        raise ConfigError(
            "--rollout-sampler-noise drawn draws inside the compiled sampler, and the decode step is not compiled; "
            "turn --rollout-compile on or choose --rollout-sampler-noise blocks or buffer"
        )


@rule(
    "init-on-device",
    "`--init-on-device` defaults to on with CUDA and off on CPU (where the host is the device).",
)
def _init_on_device(ctx: Context) -> None:
    if ctx.cfg.model.init_on_device is None:
        on = init_on_device_default(ctx.cfg.cluster.device)
        ctx.derive("init_on_device", on, "init-on-device", f"default on {ctx.cfg.cluster.device}")


@rule("param-dtype", "`--param-dtype auto` is fp32 on CPU and bf16 on CUDA.")
def _param_dtype(ctx: Context) -> None:
    if ctx.cfg.trainer.param_dtype == "auto":
        dtype = short_name(default_dtype_name(ctx.cfg.cluster.device))
        ctx.derive("param_dtype", dtype, "param-dtype", f"auto on {ctx.cfg.cluster.device}")


@rule(
    "memory-backend",
    "`--memory-backend auto` is tms on CUDA when torch_memory_saver is importable, else portable; tms needs both.",
)
def _memory_backend(ctx: Context) -> None:
    m, dev = ctx.cfg.memory, ctx.cfg.cluster.device
    if m.memory_backend == "auto":
        use_tms = dev == "cuda" and ctx.env.tms_available
        why = (
            "CUDA and torch_memory_saver available"
            if use_tms
            else ("no CUDA" if dev != "cuda" else "torch_memory_saver not installed")
        )
        ctx.derive("memory_backend", "tms" if use_tms else "portable", "memory-backend", why)
    elif m.memory_backend == "tms":
        if dev != "cuda":
            raise ConfigError(
                "--memory-backend tms needs --device cuda; use --memory-backend portable (or auto) on CPU"
            )
        if not ctx.env.tms_available:
            raise ConfigError(
                "--memory-backend tms: torch_memory_saver is not installed; pip install 'tidal[gpu]' or use --memory-backend portable"
            )


@rule(
    "offload-shorthand",
    "`--offload` sets offload-train and offload-rollout (an explicit opposite `--no-offload-*` is a conflict).",
)
def _offload_shorthand(ctx: Context) -> None:
    m = ctx.cfg.memory
    if m.offload is None:
        return
    for name in ("offload_train", "offload_rollout"):
        value = getattr(m, name)
        if value is None:
            ctx.derive(name, m.offload, "offload-shorthand", f"{'--offload' if m.offload else '--no-offload'}")
        elif value != m.offload:
            raise ConfigError(
                f"{'--offload' if m.offload else '--no-offload'} conflicts with {'--' if value else '--no-'}{name.replace('_', '-')}; keep one"
            )


rule(
    "critic",
    "`--use-critic` follows from `--advantage-estimator ppo` (a critic with another estimator, or ppo without one, is "
    "an error); `--critic-lr` defaults to `--lr`; `--value-clip`, `--critic-lr`, `--lambd` need the critic, `--gamma` "
    "ppo or reinforce_plus_plus; gamma and lambd lie in [0, 1].",
)(algorithm_rules.critic)


@rule(
    "critic-offload",
    "Colocated, a critic forces offload-train on: policy and critic take turns on the devices with the engines.",
)
def _critic_offload(ctx: Context) -> None:
    a, c = ctx.cfg.algorithm, ctx.cfg.cluster
    if a.use_critic and c.colocate and ctx.cfg.memory.offload_train is not True:
        ctx.derive("offload_train", True, "critic-offload", "--use-critic: actor and critic time-share the devices")


@rule("model", "`--model` names a preset or a local Hugging Face folder with a config.json.")
def _model(ctx: Context) -> None:
    ctx.shape()


@rule(
    "engine",
    "`--rollout-engine sglang` talks to servers over SGLang's HTTP protocol: `--rollout-external-engine-addrs` "
    "(host:port, one engine each; sets `--rollout-num-gpus`) or servers tidal starts (`--sglang-server`); "
    "delta syncs only over disk (`/pull_weights`), no custom generate function; `--sglang-*` pass-through flags need `--sglang-server sglang`.",
)
def _engine(ctx: Context) -> None:
    r, c = ctx.cfg.rollout, ctx.cfg.cluster
    addrs = [a.strip() for item in r.rollout_external_engine_addrs for a in str(item).split(",") if a.strip()]
    if addrs != list(r.rollout_external_engine_addrs):
        r.rollout_external_engine_addrs = addrs
    if r.rollout_engine != "sglang":
        for name, value in (("rollout_external_engine_addrs", addrs), ("sglang_server_args", r.sglang_server_args)):
            if value:
                raise ConfigError(f"{_f(name)} is for HTTP engines; add --rollout-engine sglang or drop it")
        return
    for addr in addrs:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"--rollout-external-engine-addrs {addr}: not host:port; pass e.g. 127.0.0.1:30000 for each server"
            )
    if len(set(addrs)) != len(addrs):
        raise ConfigError(f"--rollout-external-engine-addrs {','.join(addrs)}: an address is listed twice")
    if r.custom_generate_function_path:
        raise ConfigError(
            "--custom-generate-function-path runs inside the embedded engine; use --rollout-engine embedded or drop it"
        )
    w = ctx.cfg.weight_sync
    transport = w.update_weight_transport or ("tensor" if c.colocate else "broadcast")  # as the transport rule picks
    if w.update_weight_mode != "full" and transport != "disk":
        raise ConfigError(
            f"--update-weight-mode delta over {transport}: SGLang's tensor and distributed updates carry full tensors; "
            "use --update-weight-mode full, or delta over disk (servers /pull_weights it)"
        )
    if r.sglang_server_args and (addrs or r.sglang_server != "sglang"):
        raise ConfigError(
            f"--sglang-* flags ({' '.join(r.sglang_server_args)}) go to the SGLang server tidal starts; "
            "add --sglang-server sglang without --rollout-external-engine-addrs, or drop them"
        )
    if addrs:
        if ctx.explicit("rollout_num_gpus") and c.rollout_num_gpus != len(addrs):
            raise ConfigError(
                f"--rollout-num-gpus {c.rollout_num_gpus} but {len(addrs)} --rollout-external-engine-addrs; drop --rollout-num-gpus (one engine per address)"
            )
        ctx.derive("rollout_num_gpus", len(addrs), "engine", "one engine per external address")


rule(
    "async",
    "`--async one-step|full` turns offload off (an explicit offload flag is refused) and, unless `--colocate` is given, "
    "places engines on their own devices when there are spare ones (on one GPU both stay resident, and the trainer gets "
    "`CUDA_MPS_CLIENT_PRIORITY=1` unless either side's env vars set one); it derives "
    "`--use-tis` unless a correction is chosen; `--async-buffer-size` defaults to rollout-batch-size x "
    "max(1, max-staleness); `--partial-rollout` needs `--async full` and single generate calls (embedded or HTTP engines; a custom generate function is paused inside the `generate_default` it calls), not a multi-turn environment; `--over-sampling-batch-size` defaults to rollout-batch-size under `--async` (unset: the synchronous loop's one round), and is at least rollout-batch-size without `--dynamic-sampling`.",
)(async_rules.async_mode)


@rule(
    "cluster",
    "Trainer ranks = nodes x ranks per node; `--rollout-num-gpus` defaults to the trainer ranks when colocated, else 1; "
    "the embedded engine uses one device per engine; GPU counts must fit the devices.",
)
def _cluster(ctx: Context) -> None:
    c, env = ctx.cfg.cluster, ctx.env
    ranks = c.actor_num_nodes * c.actor_num_gpus_per_node
    if c.actor_num_nodes > 1 and c.ray_address is None:
        raise ConfigError(
            f"--actor-num-nodes {c.actor_num_nodes}: more than one node needs an existing Ray cluster; pass --ray-address"
        )
    if c.rollout_num_gpus is None:
        value, why = (
            (ranks, "colocated: engines use the trainer's devices")
            if c.colocate
            else (1, "not colocated: one engine device")
        )
        ctx.derive("rollout_num_gpus", value, "cluster", why)
    if c.rollout_num_gpus_per_engine != 1:
        raise ConfigError(
            f"--rollout-num-gpus-per-engine {c.rollout_num_gpus_per_engine}: the embedded engine runs on one device; set it to 1 and raise --rollout-num-gpus for more engines"
        )
    if c.colocate and c.rollout_num_gpus > ranks and not ctx.cfg.rollout.rollout_external_engine_addrs:
        raise ConfigError(
            f"--rollout-num-gpus {c.rollout_num_gpus} exceeds the trainer's {ranks} device(s) under --colocate; lower it, or use --no-colocate for separate engine devices"
        )
    if c.device == "cuda" and c.ray_address is None:
        external = bool(ctx.cfg.rollout.rollout_external_engine_addrs)  # servers outside tidal use no local GPU here
        need = c.actor_num_gpus_per_node if c.colocate or external else c.actor_num_gpus_per_node + c.rollout_num_gpus
        if need > env.device_count:
            what = "trainer" if c.colocate else "trainer + rollout"
            raise ConfigError(
                f"{what} need {need} GPUs but {env.device_count} are visible; lower --actor-num-gpus-per-node/--rollout-num-gpus or pass --ray-address of a larger cluster"
            )


rule(
    "megatron",
    "`--train-backend megatron` needs CUDA and megatron-core; its parallel flags (`--tensor-model-parallel-size`, "
    "`--pipeline-model-parallel-size`, `--context-parallel-size` (only 1), `--sequence-parallel` (needs TP > 1), "
    "`--use-distributed-optimizer`, `--use-nccl-ub`, `--transformer-impl`) need it; TP x PP divides the trainer ranks, "
    "TP the key-value heads and MLP width, PP the layers; no critic. `--transformer-impl` is derived: transformer_engine "
    "when it is installed, else local.",
)(megatron_rules.megatron)

rule(
    "offload-needs-colocate",
    "Explicit offload-train / offload-rollout need `--colocate` (separate devices have nothing to make room for); "
    "without colocation both resolve to off.",
)(memory_rules.offload_needs_colocate)

rule(
    "offload-needed",
    "Colocated: an offload flag left unset is on only when the memory plan needs it (cheapest that fits: none, rollout, "
    "train, both); explicit flags win. The plan must fit with the chosen flags.",
)(memory_rules.offload_needed)

rule(
    "host-memory",
    "`--offload-host-memory` defaults to retain (pinned backups kept between pauses: no re-pinning per step) when the "
    "trainer's backups per node take at most half of the usable host memory, else release; on CPU, release (the device "
    "is the host). `disk` needs `--offload-disk-dir`; with offload-train the backups per node must fit in host memory.",
)(memory_rules.host_memory)

rule(
    "resume-early",
    "`--train-resume-early` (with `--offload-train` only): by default `weights` on GPU where the memory plan fits the "
    "trainer's weights beside the generate phase, else off (always off on CPU); `all` is opt-in. On GPU the memory "
    "plan must fit what an asked-for value brings back beside the generate phase: all needs the trainer's weights, "
    "gradients and optimizer state to fit beside it, weights its weights.",
)(memory_rules.resume_early)

rule(
    "grad-buffers",
    "`--disable-grad-buffers-cpu-backup` follows from `--offload-train` (slime PR #1924: a paused trainer's gradient "
    "buffers have no host backup, every step zeroes them); `--use-nccl-ub` with `--offload-train` is refused.",
)(megatron_rules.grad_buffers)

rule(
    "train-env-vars",
    "`--train-env-vars` and `--rollout-env-vars` are JSON objects of strings; under tms it cannot enable expandable segments, and NCCL user buffers "
    "cannot be combined with `--offload-train` (its grad buffers are paused without backup).",
)(memory_rules.train_env_vars)

rule(
    "transport",
    "`--update-weight-transport` defaults to tensor when colocated, else broadcast; `nccl` (slime's name) means broadcast; "
    "tensor needs `--colocate`; disk needs `--update-weight-disk-dir`.",
)(memory_rules.transport)

rule(
    "delta",
    "`--update-weight-mode delta` works over every transport; over disk it needs `--update-weight-local-checkpoint-dir` "
    "and writes slime's stream, which is zstd-compressed and checksummed (no `--update-weight-compression none`, "
    "no `--update-weight-checksum none`); that folder is only used by delta over disk.",
)(memory_rules.delta)


rule(
    "batch",
    "`--global-batch-size` defaults to rollout-batch-size x n-samples-per-prompt (one step per rollout); it must divide "
    "that product and be a multiple of the trainer ranks; a full-length sample must fit `--max-tokens-per-gpu`.",
)(trainer_rules.batch)


rule("eps-clip-high", "`--eps-clip-high` defaults to `--eps-clip` (symmetric clipping).")(algorithm_rules.eps_clip_high)

rule(
    "tis",
    "`--tis-clip`, `--tis-clip-low`, `--tis-mode`, `--tis-level`, `--custom-tis-function-path` need `--use-tis`; the "
    "bounds must not be inverted and, for masking, must contain 1; `--use-tis` excludes `--use-rollout-logprobs`.",
)(algorithm_rules.tis)

rule(
    "overlong",
    "`--overlong-buffer-len` must be below `--rollout-max-response-len`; `--overlong-penalty-factor` needs a buffer.",
)(algorithm_rules.overlong)


rule("kl", "A KL weight (`--kl-loss-coef` > 0) needs `--use-kl-loss` (it would be ignored).")(algorithm_rules.kl)

rule("lr", "`--min-lr` cannot exceed `--lr`.")(trainer_rules.lr)

rule(
    "checkpoint",
    "`--save-interval` and `--keep-checkpoints` need `--save`. `--load DIR` must exist and hold a checkpoint (a folder "
    "of `iter_*` or one of them), except when it is the `--save` folder: then a missing or empty folder starts fresh.",
)(run_rules.checkpoint)

rule(
    "data",
    "`--prompt-data` must be an existing .jsonl or .parquet file; plug-in paths are `module:function` or `file.py:function`; "
    "`--task mental-math` needs a model with a chat template (not a preset's character tokenizer).",
)(run_rules.data)

rule(
    "multi-turn",
    "`--env-path` is `module:Class` or `file.py:Class`; the multi-turn flags need an environment (`--env-path` or a "
    "multi-turn `--task`), which excludes a custom generate function; a turn must fit `--max-trajectory-tokens`; "
    "`--task calculator` needs a chat model; `--rollout-prefix-cache-mb` defaults to 1024 with an environment, else 0.",
)(agent_rules.multi_turn)

rule(
    "output-dir",
    "`--output-dir` defaults to runs/<YYYYmmdd-HHMMSS>-<model>. A folder that holds an earlier run's steps "
    "(metrics.jsonl) is refused unless `--load` continues a run; its rows from the resumed rollout on are dropped.",
)(run_rules.output_dir)

rule(
    "warm-up",
    "`--warm-up` defaults to on with CUDA where the decode step or the trainer compiles or captures and no side is "
    "offloaded (the warm-ups run on every actor at once, before the first rollout); off on CPU and with offload.",
)(run_rules.warm_up)

rule(
    "warm-process",
    "`--warm-process on` needs a cluster started here and embedded engines: with `--ray-address` or "
    "`--rollout-engine sglang` it is refused (the default, auto, starts a warm process wherever it applies).",
)(run_rules.warm_process)

rule(
    "profile-rollouts",
    "`--profile-rollouts` takes ids of this run's rollouts (0 to `--num-rollout` - 1), in the synchronous loop only "
    "(refused with `--async`).",
)(run_rules.profile_rollouts)

rule(
    "memory-history",
    "`--record-memory-history` needs CUDA; its snapshots go to `--memory-snapshot-dir` (default <output-dir>/memory-snapshots), "
    "which is only used with it.",
)(run_rules.memory_history)


def resolve(cfg: TidalConfig, prov: Provenance | None = None, env: Environment | None = None) -> TidalConfig:
    """Apply every rule to a copy of ``cfg``; returns the resolved config (no field left to derive).

    ``prov`` is updated in place with the rule that derived each value. ``env`` defaults to this
    machine (``Environment.detect()``); pass one to plan for other hardware or in tests.
    """
    ctx = Context(copy.deepcopy(cfg), prov if prov is not None else Provenance(), env or Environment.detect())
    for r in RULES:
        r.fn(ctx)
    return ctx.cfg


def unresolved_fields(cfg: TidalConfig) -> list[str]:
    """Fields that still hold a value resolution replaces (None where a rule derives one, or "auto")."""
    derived = {
        "device", "param_dtype", "memory_backend", "rollout_num_gpus", "offload_train", "offload_rollout",
        "update_weight_transport", "global_batch_size", "eps_clip_high", "output_dir",
        "rollout_compile", "use_critic", "offload_host_memory", "rollout_prefix_cache_mb",
        "disable_grad_buffers_cpu_backup", "init_on_device", "rollout_decode_attention", "trained_logits_only",
        "rollout_sampler_noise",
        "warm_up",
    }  # fmt: skip
    out = []
    for info in fields():
        if info.name in derived:
            value = getattr(getattr(cfg, info.section), info.name)
            if value is None or value == "auto" or value == "nccl":
                out.append(info.name)
    return out


__all__ = ["RULES", "Rule", "resolve", "rule_by_id", "unresolved_fields"]
