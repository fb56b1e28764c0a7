"""Every resolution rule of ``tidal.config.resolve``, one table-driven test per rule.

Each case is command-line flags and a machine (a made-up ``Environment``, so GPU rules run on a CPU
machine); it asserts either the resolved fields or the error message. In the spirit of slime's
tests/test_megatron_argument_validation.py, including the cases that file is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from tidal.config import Environment, explain, parse, resolve
from tidal.config.validate import RULES, Context, rule_by_id, unresolved_fields
from tidal.errors import ConfigError

GIB = 1024**3
CPU = Environment(cuda_available=False, host_memory=16 * GIB, cpu_count=2)
GPU1 = Environment(
    cuda_available=True, device_count=1, device_memory=80 * GIB, host_memory=256 * GIB, tms_available=True
)
GPU8 = Environment(
    cuda_available=True, device_count=8, device_memory=80 * GIB, host_memory=1024 * GIB, tms_available=True
)
GPU8_NO_TMS = Environment(cuda_available=True, device_count=8, device_memory=80 * GIB, host_memory=1024 * GIB)
TINY_GPU = ["--model", "tiny", "--device", "cuda"]


def run(argv, env=CPU):
    cfg, prov = parse(argv)
    return resolve(cfg, prov, env), prov


def field(cfg, name):
    for section in vars(cfg).values():
        if hasattr(section, name):
            return getattr(section, name)
    raise KeyError(name)


def check(argv, env, expect):
    """``expect``: dict of resolved fields, or an error substring."""
    if isinstance(expect, str):
        with pytest.raises(ConfigError) as exc:
            run(argv, env)
        msg = str(exc.value)
        assert expect in msg, msg
        assert "\n" not in msg, "errors are one line"
        return None
    cfg, prov = run(argv, env)
    for name, value in expect.items():
        assert field(cfg, name) == value, (name, field(cfg, name), value)
    return prov


def test_every_rule_has_a_test_here():
    tested = {name[len("test_rule_") :].replace("_", "-") for name in globals() if name.startswith("test_rule_")}
    missing = {r.id for r in RULES} - tested
    assert not missing, f"rules without a test_rule_<id> test: {sorted(missing)}"


def test_default_on_cpu_resolves_to_the_embedded_run():
    cfg, prov = run([])
    assert (cfg.cluster.device, cfg.cluster.colocate, cfg.cluster.rollout_num_gpus) == ("cpu", True, 1)
    assert cfg.cluster.actor_num_nodes * cfg.cluster.actor_num_gpus_per_node == 1
    assert cfg.weight_sync.update_weight_transport == "tensor"
    assert (cfg.memory.offload_train, cfg.memory.offload_rollout, cfg.memory.memory_backend) == (
        False,
        False,
        "portable",
    )
    assert "not needed" in prov.of("offload_train").detail
    assert unresolved_fields(parse([])[0])  # before: device auto, transport unset, ...
    assert unresolved_fields(cfg) == []


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--rollout-batch-size", "0"], "--rollout-batch-size: must be at least 1, got 0"),
        (["--lr", "-1"], "--lr: must be at least 0"),
        (["--actor-num-gpus-per-node", "0"], "--actor-num-gpus-per-node: must be at least 1"),
    ],
)
def test_rule_values(argv, expect):
    check(argv, CPU, expect)


def test_rule_values_catches_configs_built_in_code():
    cfg, prov = parse([])
    cfg.rollout.n_samples_per_prompt = 0
    with pytest.raises(ConfigError, match="--n-samples-per-prompt: must be at least 1"):
        resolve(cfg, prov, CPU)
    cfg.rollout.n_samples_per_prompt = 4
    cfg.cluster.device = "tpu"
    with pytest.raises(ConfigError, match="--device: 'tpu' is not a choice"):
        resolve(cfg, prov, CPU)


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--debug-rollout-only"], {"colocate": False, "offload_train": False, "offload_rollout": False}),
        (["--debug-rollout-only", "--offload"], {"colocate": False, "offload_train": False, "offload_rollout": False}),
        (["--debug-rollout-only", "--offload-train", "--colocate"], {"colocate": False, "offload_train": False}),
        (["--debug-rollout-only", "--global-batch-size", "7"], "does not divide"),
        (["--debug-rollout-only", "--save", "/tmp/ck"], "--debug-rollout-only starts no trainer, so --save"),
        (["--debug-rollout-only", "--load", "/tmp/ck"], "--debug-rollout-only starts no trainer, so --load"),
    ],
)
def test_rule_debug_rollout_only(argv, expect):
    prov = check(argv, CPU, expect)
    if prov is not None and "--colocate" in argv:
        assert "colocate" in prov.overridden  # an explicit value changed by a rule is reported


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        ([], CPU, {"device": "cpu"}),
        (TINY_GPU[:2], GPU1, {"device": "cuda"}),
        (["--device", "cpu"], GPU1, {"device": "cpu"}),
        (["--device", "cuda"], CPU, "--device cuda: no CUDA device is visible; use --device cpu"),
    ],
)
def test_rule_device(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        ([], CPU, {"rollout_compile": False}),
        (TINY_GPU, GPU1, {"rollout_compile": True}),
        (TINY_GPU + ["--no-rollout-compile"], GPU1, {"rollout_compile": False}),
        (["--rollout-compile"], CPU, {"rollout_compile": True}),
    ],
)
def test_rule_rollout_compile(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        ([], CPU, {"trained_logits_only": False}),
        (TINY_GPU, GPU1, {"trained_logits_only": True}),
        (TINY_GPU + ["--no-trained-logits-only"], GPU1, {"trained_logits_only": False}),
        (["--trained-logits-only"], CPU, {"trained_logits_only": True}),
    ],
)
def test_rule_trained_logits(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        ([], CPU, {"warm_up": False}),
        (TINY_GPU, GPU1, {"warm_up": True}),
        (TINY_GPU + ["--offload"], GPU1, {"warm_up": False}),
        (
            TINY_GPU + ["--no-rollout-compile", "--no-rollout-cuda-graphs", "--no-compile-logprobs"],
            GPU1,
            {"warm_up": False},
        ),
        (TINY_GPU + ["--no-rollout-compile", "--no-rollout-cuda-graphs"], GPU1, {"warm_up": True}),
        (TINY_GPU + ["--no-warm-up"], GPU1, {"warm_up": False}),
        (TINY_GPU + ["--debug-rollout-only"], GPU8, {"warm_up": False}),
        (["--warm-up"], CPU, {"warm_up": True}),
    ],
)
def test_rule_warm_up(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        ([], CPU, {"init_on_device": False}),
        (TINY_GPU, GPU1, {"init_on_device": True}),
        (TINY_GPU + ["--no-init-on-device"], GPU1, {"init_on_device": False}),
        (["--init-on-device"], CPU, {"init_on_device": True}),
    ],
)
def test_rule_init_on_device(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        ([], CPU, {"rollout_decode_attention": "sdpa"}),
        (TINY_GPU, GPU1, {"rollout_decode_attention": "flex"}),
        (TINY_GPU + ["--no-rollout-fast-decode"], GPU1, {"rollout_decode_attention": "sdpa"}),
        (TINY_GPU + ["--rollout-decode-attention", "sdpa"], GPU1, {"rollout_decode_attention": "sdpa"}),
        (["--rollout-decode-attention", "flex"], CPU, {"rollout_decode_attention": "flex"}),
        (["--rollout-decode-attention", "flex", "--no-rollout-fast-decode"], CPU, "needs --rollout-fast-decode"),
        (["--rollout-decode-attention", "flash"], CPU, "flash"),
    ],
)
def test_rule_decode_attention(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        ([], CPU, {"rollout_sampler_noise": "buffer"}),
        (TINY_GPU, GPU1, {"rollout_sampler_noise": "blocks"}),
        (TINY_GPU + ["--rollout-sampler-noise", "buffer"], GPU1, {"rollout_sampler_noise": "buffer"}),
        (TINY_GPU + ["--rollout-sampler-noise", "drawn"], GPU1, {"rollout_sampler_noise": "drawn"}),
        (["--rollout-sampler-noise", "blocks"], CPU, {"rollout_sampler_noise": "blocks"}),
        (["--rollout-sampler-noise", "drawn"], CPU, "drawn draws inside the compiled sampler"),
        (TINY_GPU + ["--rollout-sampler-noise", "drawn", "--no-rollout-compile"], GPU1, "turn --rollout-compile on"),
        (["--rollout-sampler-noise", "gumbel"], CPU, "gumbel"),
    ],
)
def test_rule_sampler_noise(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        ([], CPU, {"param_dtype": "fp32"}),
        (TINY_GPU, GPU1, {"param_dtype": "bf16"}),
        (TINY_GPU + ["--param-dtype", "fp32"], GPU1, {"param_dtype": "fp32"}),
        (["--param-dtype", "bf16"], CPU, {"param_dtype": "bf16"}),
    ],
)
def test_rule_param_dtype(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        ([], CPU, {"memory_backend": "portable"}),
        (TINY_GPU, GPU1, {"memory_backend": "tms"}),
        (TINY_GPU, GPU8_NO_TMS, {"memory_backend": "portable"}),
        (TINY_GPU + ["--memory-backend", "portable"], GPU1, {"memory_backend": "portable"}),
        (["--memory-backend", "tms"], CPU, "--memory-backend tms needs --device cuda"),
        (TINY_GPU + ["--memory-backend", "tms"], GPU8_NO_TMS, "torch_memory_saver is not installed"),
    ],
)
def test_rule_memory_backend(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--offload"], {"offload_train": True, "offload_rollout": True}),
        (["--no-offload"], {"offload_train": False, "offload_rollout": False}),
        (["--offload", "--offload-train"], {"offload_train": True, "offload_rollout": True}),
        (["--offload", "--no-offload-train"], "--offload conflicts with --no-offload-train"),
        (["--no-offload", "--offload-rollout"], "--no-offload conflicts with --offload-rollout"),
    ],
)
def test_rule_offload_shorthand(argv, expect):
    check(argv, CPU, expect)


@pytest.mark.parametrize(
    "offload_train, expect",
    [(None, True), (False, True), (True, True)],  # slime: critic + --no-offload-train => True
)
def test_rule_critic_offload(offload_train, expect):
    cfg, prov = parse([] if offload_train is None else ["--offload-train" if offload_train else "--no-offload-train"])
    cfg.algorithm.use_critic = True
    ctx = Context(cfg, prov, CPU)
    rule_by_id("critic-offload").fn(ctx)
    assert cfg.memory.offload_train is expect
    assert prov.of("offload_train").kind == ("flag" if offload_train else "derived")
    if offload_train is False:
        assert prov.overridden["offload_train"][0] is False


@pytest.mark.parametrize(
    "argv, expect",
    [
        ([], {"use_critic": False, "critic_lr": None}),
        (["--advantage-estimator", "ppo"], {"use_critic": True, "critic_lr": 3e-3, "offload_train": True}),
        (["--advantage-estimator", "ppo", "--use-critic", "--critic-lr", "1e-4"], {"critic_lr": 1e-4}),
        (["--advantage-estimator", "ppo", "--no-colocate"], {"use_critic": True, "offload_train": False}),
        (["--advantage-estimator", "ppo", "--gamma", "0.9", "--lambd", "0.95", "--value-clip", "0.5"], {"lambd": 0.95}),
        (["--advantage-estimator", "reinforce_plus_plus", "--gamma", "0.99"], {"gamma": 0.99}),
        (["--use-critic"], "--use-critic: --advantage-estimator grpo has no value baseline"),
        (["--advantage-estimator", "rloo", "--use-critic"], "--advantage-estimator rloo has no value baseline"),
        (["--advantage-estimator", "ppo", "--no-use-critic"], "ppo needs its critic"),
        (["--value-clip", "0.1"], "--value-clip has no effect without a critic"),
        (["--critic-lr", "0.1"], "--critic-lr has no effect without a critic"),
        (["--lambd", "0.9"], "--lambd has no effect without a critic"),
        (["--gamma", "0.9"], "--gamma has no effect with --advantage-estimator grpo"),
        (["--advantage-estimator", "ppo", "--gamma", "1.5"], "--gamma 1.5: must be within [0, 1]"),
        (["--advantage-estimator", "ppo", "--lambd", "2"], "--lambd 2.0: must be within [0, 1]"),
    ],
)
def test_rule_critic(argv, expect):
    check(argv, CPU, expect)


def test_memory_plan_counts_the_critic():
    from tidal.config.plan import build_plan, model_shape

    grpo, _ = run(["--model", "qwen2.5-0.5b-shape", "--device", "cuda"], GPU1)
    ppo, _ = run(["--model", "qwen2.5-0.5b-shape", "--device", "cuda", "--advantage-estimator", "ppo"], GPU1)
    a, b = build_plan(grpo, model_shape(grpo), GPU1), build_plan(ppo, model_shape(ppo), GPU1)
    for key in ("weights", "grads", "optimizer"):
        assert b.trainer[key] == 2 * a.trainer[key], key
    assert b.trainer["activations"] == a.trainer["activations"]


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--use-tis"], {"tis_clip": 2.0, "tis_clip_low": 0.0, "tis_mode": "truncate", "tis_level": "token"}),
        (["--use-tis", "--tis-mode", "mask", "--tis-clip-low", "0.5", "--tis-clip", "5"], {"tis_clip": 5.0}),
        (["--use-tis", "--tis-level", "sequence", "--custom-tis-function-path", "my_pkg.mis:weights"], {}),
        (["--use-rollout-logprobs"], {"use_rollout_logprobs": True}),
        (["--tis-clip", "3"], "--tis-clip has no effect without --use-tis"),
        (["--tis-mode", "mask"], "--tis-mode has no effect without --use-tis"),
        (["--custom-tis-function-path", "a:b"], "--custom-tis-function-path has no effect without --use-tis"),
        (
            ["--use-tis", "--tis-clip-low", "3"],
            "--tis-clip-low 3.0 is above --tis-clip 2.0: the ratio bounds are inverted",
        ),
        (["--use-tis", "--tis-clip", "0"], "--tis-clip 0 weights every token by 0"),
        (
            ["--use-tis", "--tis-mode", "mask", "--tis-clip", "0.8"],
            "drops even tokens on which engine and trainer agree",
        ),
        (["--use-tis", "--use-rollout-logprobs"], "--use-tis with --use-rollout-logprobs"),
        (["--use-tis", "--custom-tis-function-path", "nocolon"], "expected module:function"),
    ],
)
def test_rule_tis(argv, expect):
    check(argv, CPU, expect)


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--rollout-max-response-len", "8", "--overlong-buffer-len", "4"], {"overlong_buffer_len": 4}),
        (
            ["--rollout-max-response-len", "8", "--overlong-buffer-len", "4", "--overlong-penalty-factor", "0.5"],
            {"overlong_penalty_factor": 0.5},
        ),
        (["--overlong-buffer-len", "1"], "--overlong-buffer-len 1 must be below --rollout-max-response-len 1"),
        (["--overlong-penalty-factor", "0.5"], "--overlong-penalty-factor has no effect without --overlong-buffer-len"),
    ],
)
def test_rule_overlong(argv, expect):
    check(argv, CPU, expect)


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        ([], CPU, {"rollout_num_gpus": 1}),
        (["--actor-num-gpus-per-node", "2", "--global-batch-size", "64"], CPU, {"rollout_num_gpus": 2}),
        (["--no-colocate"], CPU, {"rollout_num_gpus": 1}),
        (["--no-colocate", "--rollout-num-gpus", "3"], CPU, {"rollout_num_gpus": 3}),
        (
            ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "3"],
            CPU,
            "--rollout-num-gpus 3 exceeds the trainer's 2 device(s)",
        ),
        (["--rollout-num-gpus-per-engine", "2"], CPU, "the embedded engine runs on one device"),
        (["--actor-num-nodes", "2"], CPU, "more than one node needs an existing Ray cluster; pass --ray-address"),
        (TINY_GPU + ["--actor-num-gpus-per-node", "8"], GPU8, {"rollout_num_gpus": 8}),
        (TINY_GPU + ["--actor-num-gpus-per-node", "2"], GPU1, "trainer need 2 GPUs but 1 are visible"),
        (
            TINY_GPU + ["--no-colocate", "--actor-num-gpus-per-node", "8"],
            GPU8,
            "trainer + rollout need 9 GPUs but 8 are visible",
        ),
        (
            TINY_GPU + ["--no-colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4"],
            GPU8,
            {"rollout_num_gpus": 4},
        ),
    ],
)
def test_rule_cluster(argv, env, expect):
    check(argv, env, expect)


SG = ["--rollout-engine", "sglang"]


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        ([], CPU, {"rollout_engine": "embedded", "rollout_external_engine_addrs": []}),
        (SG, CPU, {"sglang_server": "tidal", "rollout_num_gpus": 1}),
        (
            SG + ["--rollout-external-engine-addrs", "127.0.0.1:30000,127.0.0.1:30001"],
            CPU,
            {"rollout_external_engine_addrs": ["127.0.0.1:30000", "127.0.0.1:30001"], "rollout_num_gpus": 2},
        ),
        (SG + ["--rollout-external-engine-addrs", "h1:1", "h2:2", "h3:3"], CPU, {"rollout_num_gpus": 3}),
        # External servers take no local GPU: 8 trainer GPUs + 2 external engines fit 8 GPUs.
        (
            TINY_GPU
            + SG
            + ["--no-colocate", "--actor-num-gpus-per-node", "8", "--rollout-external-engine-addrs", "a:1,b:2"],
            GPU8,
            {"rollout_num_gpus": 2},
        ),
        (["--rollout-external-engine-addrs", "h:1"], CPU, "is for HTTP engines; add --rollout-engine sglang"),
        (["--sglang-mem-fraction-static", "0.7"], CPU, "--sglang-server-args is for HTTP engines"),
        (SG + ["--rollout-external-engine-addrs", "nohost"], CPU, "nohost: not host:port"),
        (SG + ["--rollout-external-engine-addrs", "h:99999"], CPU, "h:99999: not host:port"),
        (SG + ["--rollout-external-engine-addrs", "h:1,h:1"], CPU, "an address is listed twice"),
        (SG + ["--rollout-external-engine-addrs", "h:1", "--rollout-num-gpus", "2"], CPU, "one engine per address"),
        (SG + ["--update-weight-mode", "delta"], CPU, "delta over tensor: SGLang's tensor and distributed updates"),
        (
            SG
            + [
                "--no-colocate",
                "--update-weight-mode",
                "delta",
                "--update-weight-transport",
                "disk",
                "--update-weight-disk-dir",
                "d",
                "--update-weight-local-checkpoint-dir",
                "l",
            ],
            CPU,
            {"update_weight_mode": "delta"},
        ),
        (SG + ["--custom-generate-function-path", "m:f"], CPU, "runs inside the embedded engine"),
        (SG + ["--sglang-tp-size", "2"], CPU, "add --sglang-server sglang without --rollout-external-engine-addrs"),
        (SG + ["--sglang-server", "sglang", "--sglang-tp-size", "2"], CPU, {"sglang_server_args": ["--tp-size", "2"]}),
    ],
)
def test_rule_engine(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--no-colocate"], {"offload_train": False, "offload_rollout": False}),
        (["--no-colocate", "--offload-train"], "--offload-train needs --colocate"),
        (["--no-colocate", "--offload"], "--offload-train needs --colocate"),
        (["--no-colocate", "--offload-rollout"], "--offload-rollout needs --colocate"),
    ],
)
def test_rule_offload_needs_colocate(argv, expect):
    check(argv, CPU, expect)


SEVEN_B = ["--preset", "qwen2.5-7b-8gpu"]


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        # Tiny model on CPU: fits, so colocation does not turn offload on.
        ([], CPU, {"offload_train": False, "offload_rollout": False}),
        # Explicit flags win even when nothing needs the room (how CI tests pausing on CPU).
        (["--offload-train"], CPU, {"offload_train": True, "offload_rollout": False}),
        (["--offload-rollout"], CPU, {"offload_train": False, "offload_rollout": True}),
        # slime's missing case: colocate + --no-offload-train stays False.
        (["--no-offload-train"], CPU, {"offload_train": False}),
        # 7B on 8 x 80 GiB: side by side does not fit; releasing the engines is enough.
        (SEVEN_B, GPU8, {"offload_train": False, "offload_rollout": True}),
        # ... unless the user keeps the engines resident: then the trainer must pause.
        (SEVEN_B + ["--no-offload-rollout"], GPU8, "memory plan does not fit with offload-train"),
        # On 141 GiB GPUs everything fits.
        (
            SEVEN_B,
            Environment(True, 8, 141 * GIB, 2048 * GIB, tms_available=True),
            {"offload_train": False, "offload_rollout": False},
        ),
        # On 40 GiB GPUs nothing fits: a clear error, unless the check is turned off.
        (
            SEVEN_B,
            Environment(True, 8, 40 * GIB, 1024 * GIB, tms_available=True),
            "memory plan does not fit with offload-train on, offload-rollout on",
        ),
        (
            SEVEN_B + ["--no-check-memory-plan"],
            Environment(True, 8, 40 * GIB, 1024 * GIB, tms_available=True),
            {"offload_train": True, "offload_rollout": True},
        ),
        # More samples per engine: the KV cache also forces the trainer off the device while generating.
        (
            SEVEN_B + ["--rollout-max-response-len", "7000", "--max-tokens-per-gpu", "8192"],
            GPU8,
            {"offload_train": True, "offload_rollout": True},
        ),
    ],
)
def test_rule_offload_needed(argv, env, expect):
    prov = check(argv, env, expect)
    if prov is not None and not any("offload-train" in a for a in argv):
        assert prov.of("offload_train").detail.startswith("offload-needed: ")


def test_train_grads_backup_is_removed():
    with pytest.raises(ConfigError, match="--train-grads-backup was removed in tidal 0.1.0: it changed nothing"):
        parse(["--train-grads-backup"])


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        (["--offload-host-memory", "disk"], CPU, "--offload-host-memory disk needs --offload-disk-dir"),
        (["--offload-disk-dir", "/tmp/x"], CPU, "--offload-disk-dir is only used with --offload-host-memory disk"),
        (["--offload-host-memory", "disk", "--offload-disk-dir", "/tmp/x"], CPU, {"offload_host_memory": "disk"}),
        (SEVEN_B + ["--offload"], GPU8, {"offload_train": True}),
        (
            SEVEN_B + ["--offload"],
            Environment(True, 8, 80 * GIB, 64 * GIB, tms_available=True),
            "of host memory per node",
        ),
        (
            SEVEN_B + ["--offload", "--offload-host-memory", "disk", "--offload-disk-dir", "/nvme"],
            Environment(True, 8, 80 * GIB, 64 * GIB, tms_available=True),
            {"offload_train": True},
        ),
    ],
)
def test_rule_host_memory(argv, env, expect):
    check(argv, env, expect)


HALF_0P5B = ["--preset", "qwen2.5-0.5b-1gpu", "--offload"]


@pytest.mark.parametrize(
    "argv, env, policy, why",
    [
        # The H200 case: 6 GiB of backups on a host with 100+ GiB free keeps them pinned.
        (HALF_0P5B, GPU1, "retain", "room to keep them pinned"),
        # 7B on 8 GPUs: ~85 GiB of backups per node; 1 TiB host: retain; 160 GiB host: more than half, release.
        (SEVEN_B + ["--offload"], GPU8, "retain", "room to keep them pinned"),
        (SEVEN_B + ["--offload"], Environment(True, 8, 80 * GIB, 160 * GIB, tms_available=True), "release", "too much"),
        # An explicit flag wins over the plan.
        (HALF_0P5B + ["--offload-host-memory", "release"], GPU1, "release", None),
        ([], CPU, "release", "CPU: the device is the host"),
        (TINY_GPU, GPU1, "retain", "the trainer never pauses"),
    ],
)
def test_rule_host_policy_is_retain_when_the_host_has_room(argv, env, policy, why):
    cfg, prov = run(argv, env)
    assert cfg.memory.offload_host_memory == policy
    source = prov.of("offload_host_memory")
    if why is None:
        assert source.kind == "flag"
    else:
        assert source.detail.startswith("host-memory: ") and why in source.detail, source
    if "--offload" in argv:
        assert f"host policy: {policy}" in explain(cfg, prov, env)


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        (["--train-env-vars", '{"OMP_NUM_THREADS": "1"}'], CPU, {"train_env_vars": {"OMP_NUM_THREADS": "1"}}),
        (
            ["--train-env-vars", '{"OMP_NUM_THREADS": 1}'],
            CPU,
            "--train-env-vars: value of OMP_NUM_THREADS must be a string",
        ),
        (["--train-env-vars", "[1]"], CPU, "--train-env-vars: expected a dict"),
        (
            ["--rollout-env-vars", '{"CUDA_MPS_CLIENT_PRIORITY": "1"}'],
            CPU,
            {"rollout_env_vars": {"CUDA_MPS_CLIENT_PRIORITY": "1"}},
        ),
        (
            ["--rollout-env-vars", '{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": 40}'],
            CPU,
            "--rollout-env-vars: value of CUDA_MPS_ACTIVE_THREAD_PERCENTAGE must be a string",
        ),
        (["--train-env-vars", "{bad"], CPU, "--train-env-vars: expected a JSON object"),
        (
            TINY_GPU + ["--train-env-vars", '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}'],
            GPU1,
            "expandable_segments",
        ),
        (
            TINY_GPU
            + [
                "--memory-backend",
                "portable",
                "--train-env-vars",
                '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}',
            ],
            GPU1,
            {"memory_backend": "portable"},
        ),
        (
            TINY_GPU
            + ["--offload-train", "--train-env-vars", '{"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"}'],
            GPU1,
            "NCCL user buffers",
        ),
    ],
)
def test_rule_train_env_vars(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, expect",
    [
        ([], {"update_weight_transport": "tensor"}),
        (["--no-colocate"], {"update_weight_transport": "broadcast"}),
        (["--update-weight-transport", "nccl"], {"update_weight_transport": "broadcast"}),
        (["--colocate", "--update-weight-transport", "broadcast"], {"update_weight_transport": "broadcast"}),
        (["--no-colocate", "--update-weight-transport", "tensor"], "--update-weight-transport tensor needs --colocate"),
        (["--update-weight-transport", "disk"], "--update-weight-transport disk needs --update-weight-disk-dir"),
        (
            ["--update-weight-transport", "disk", "--update-weight-disk-dir", "/tmp/w"],
            {"update_weight_transport": "disk"},
        ),
        (
            ["--update-weight-disk-dir", "/tmp/w"],
            "--update-weight-disk-dir is only used with --update-weight-transport disk",
        ),
    ],
)
def test_rule_transport(argv, expect):
    check(argv, CPU, expect)


_DELTA_DISK = [
    "--update-weight-mode",
    "delta",
    "--update-weight-transport",
    "disk",
    "--update-weight-disk-dir",
    "/tmp/w",
    "--update-weight-local-checkpoint-dir",
    "/tmp/l",
]


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--update-weight-mode", "delta"], {"update_weight_mode": "delta", "update_weight_transport": "tensor"}),
        (["--update-weight-mode", "delta", "--no-colocate"], {"update_weight_transport": "broadcast"}),
        (
            [
                "--update-weight-mode",
                "delta",
                "--update-weight-transport",
                "disk",
                "--update-weight-disk-dir",
                "/tmp/w",
            ],
            "needs --update-weight-local-checkpoint-dir",
        ),
        (
            [
                "--update-weight-mode",
                "delta",
                "--update-weight-transport",
                "disk",
                "--update-weight-disk-dir",
                "/tmp/w",
                "--update-weight-local-checkpoint-dir",
                "/tmp/l",
            ],
            {"update_weight_local_checkpoint_dir": "/tmp/l"},
        ),
        (
            ["--update-weight-local-checkpoint-dir", "/tmp/l"],
            "only used with --update-weight-mode delta --update-weight-transport disk",
        ),
        (
            [*_DELTA_DISK, "--update-weight-compression", "none"],
            "--update-weight-compression none: delta over disk writes slime's stream, which is always zstd",
        ),
        ([*_DELTA_DISK, "--update-weight-checksum", "none"], "use xxh3-128, blake3 or adler32"),
        ([*_DELTA_DISK, "--update-weight-checksum", "blake3"], {"update_weight_checksum": "blake3"}),
        (
            ["--update-weight-mode", "delta", "--update-weight-compression", "none"],
            {"update_weight_compression": "none"},
        ),
    ],
)
def test_rule_delta(argv, expect):
    check(argv, CPU, expect)


@pytest.mark.parametrize(
    "argv, expect",
    [
        ([], {"global_batch_size": 256}),
        (["--rollout-batch-size", "4", "--n-samples-per-prompt", "2"], {"global_batch_size": 8}),
        (["--global-batch-size", "64"], {"global_batch_size": 64}),
        (["--global-batch-size", "100"], "--global-batch-size 100 does not divide the 256 samples of a rollout"),
        (
            ["--actor-num-gpus-per-node", "2", "--rollout-batch-size", "3", "--n-samples-per-prompt", "1"],
            "--global-batch-size 3 is not a multiple of the 2 trainer ranks",
        ),
        (["--actor-num-gpus-per-node", "2", "--global-batch-size", "128"], {"global_batch_size": 128}),
        (
            ["--max-tokens-per-gpu", "100"],
            "--max-tokens-per-gpu 100 is below the longest sample (512 prompt + 1 response tokens)",
        ),
    ],
)
def test_rule_batch(argv, expect):
    check(argv, CPU, expect)


def test_rule_batch_suggests_a_divisor_that_works():
    with pytest.raises(ConfigError, match="use a divisor such as 128"):
        run(["--global-batch-size", "100", "--actor-num-gpus-per-node", "2"])


@pytest.mark.parametrize(
    "argv, expect",
    [
        ([], {"eps_clip_high": 0.2}),
        (["--eps-clip", "0.1"], {"eps_clip_high": 0.1}),
        (["--eps-clip-high", "0.28"], {"eps_clip_high": 0.28, "eps_clip": 0.2}),
    ],
)
def test_rule_eps_clip_high(argv, expect):
    check(argv, CPU, expect)


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--kl-loss-coef", "0.01"], "--kl-loss-coef 0.01 has no effect without --use-kl-loss"),
        (["--kl-loss-coef", "0.01", "--use-kl-loss"], {"kl_loss_coef": 0.01, "use_kl_loss": True}),
    ],
)
def test_rule_kl(argv, expect):
    check(argv, CPU, expect)


@pytest.mark.parametrize(
    "argv, expect",
    [(["--min-lr", "1", "--lr", "0.1"], "--min-lr 1.0 is above --lr 0.1"), (["--min-lr", "0.001"], {"min_lr": 0.001})],
)
def test_rule_lr(argv, expect):
    check(argv, CPU, expect)


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--save-interval", "5"], "--save-interval 5 needs --save DIR"),
        (["--save-interval", "5", "--save", "/tmp/ck"], {"save_interval": 5}),
    ],
)
def test_rule_checkpoint(argv, expect):
    check(argv, CPU, expect)


def test_rule_load_needs_a_checkpoint_except_as_the_save_folder(tmp_path):
    missing, empty, ck = tmp_path / "missing", tmp_path / "empty", tmp_path / "ck"
    empty.mkdir()
    (ck / "iter_0000003").mkdir(parents=True)
    (ck / "iter_0000003" / "meta.json").write_text("{}")
    check(["--load", str(missing)], CPU, f"--load {missing}: no such directory")
    check(["--load", str(empty)], CPU, f"--load {empty}: holds no checkpoint")
    # The auto-resume idiom: --load equal to --save with nothing there yet is a fresh start.
    check(["--load", str(missing), "--save", str(missing)], CPU, {"load": str(missing)})
    check(["--load", str(empty), "--save", str(empty) + "/"], CPU, {"load": str(empty)})
    check(["--load", str(ck)], CPU, {"load": str(ck)})
    check(["--load", str(ck / "iter_0000003")], CPU, {"load": str(ck / "iter_0000003")})
    check(["--keep-checkpoints", "2"], CPU, "--keep-checkpoints 2 needs --save DIR")


def test_rule_data(tmp_path):
    rows = tmp_path / "prompts.jsonl"
    rows.write_text('{"prompt": "1+1=", "label": "2"}\n')
    check(["--prompt-data", str(rows)], CPU, {"prompt_data": str(rows)})
    check(["--prompt-data", str(tmp_path / "none.jsonl")], CPU, "no such file")
    check(["--prompt-data", str(tmp_path / "p.csv")], CPU, "expected a .jsonl or .parquet file")
    check(["--custom-rm-path", "my_rewards.score"], CPU, "--custom-rm-path my_rewards.score: expected module:function")
    check(["--custom-rm-path", "my_pkg.rewards:score"], CPU, {"custom_rm_path": "my_pkg.rewards:score"})
    check(
        ["--custom-generate-function-path", "gen"], CPU, "--custom-generate-function-path gen: expected module:function"
    )
    # mental-math's chat questions need a chat model: the tiny presets' character tokenizer cannot read them.
    for preset in ("tiny", "tiny-qwen2"):
        check(
            ["--model", preset, "--task", "mental-math"],
            CPU,
            f"--task mental-math asks chat questions in words; --model {preset}",
        )
    check(["--task", "mental-math", "--prompt-data", str(rows)], CPU, {"task": "mental-math"})
    check(["--task", "arith"], CPU, {"task": "arith"})


def test_rule_model(tmp_path):
    big_host = Environment(cuda_available=False, host_memory=64 * GIB, cpu_count=2)
    check(["--model", "qwen2.5-0.5b-shape"], big_host, {"model": "qwen2.5-0.5b-shape"})
    check(["--model", str(tmp_path / "missing")], CPU, "no such folder or preset")
    check(["--model", str(tmp_path)], CPU, "folder has no config.json")


def test_rule_fused_kv_write():
    check(["--rollout-fused-decode", "--rollout-fused-kv-write"], CPU, {"rollout_fused_kv_write": True})
    check(["--rollout-fused-kv-write"], CPU, "--rollout-fused-kv-write has the fused decode step write the KV cache")
    check(["--preset", "qwen2.5-0.5b-1gpu"], GPU1, {"rollout_fused_decode": True, "rollout_fused_kv_write": True})


def test_rule_output_dir():
    cfg, prov = run([])
    assert os.path.dirname(cfg.logging.output_dir) == "runs"
    assert cfg.logging.output_dir.endswith("-tiny") and len(os.path.basename(cfg.logging.output_dir)) == len(
        "20260101-120000-tiny"
    )
    assert prov.of("output_dir").kind == "derived"
    check(["--output-dir", "/tmp/run1"], CPU, {"output_dir": "/tmp/run1"})


def test_rule_output_dir_that_holds_a_run(tmp_path):
    """A folder with an earlier run's steps takes a new run only as a continuation (--load)."""
    out, ck = tmp_path / "run", tmp_path / "ck"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # started, no step finished: nothing to mix with
    check(["--output-dir", str(out)], CPU, {"output_dir": str(out)})
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    check(["--output-dir", str(out)], CPU, f"--output-dir {out} already holds a run's steps (metrics.jsonl)")
    (ck / "iter_0000000").mkdir(parents=True)
    (ck / "iter_0000000" / "meta.json").write_text("{}")
    check(["--output-dir", str(out), "--load", str(ck)], CPU, {"output_dir": str(out), "load": str(ck)})


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        (["--profile-rollouts", "0", "3", "--num-rollout", "4"], CPU, {"profile_rollouts": ["0", "3"]}),
        (["--profile-rollouts", "4", "--num-rollout", "4"], CPU, "this run's rollouts are 0-3 (--num-rollout 4)"),
        (["--profile-rollouts", "two"], CPU, "--profile-rollouts 'two': not a rollout id"),
        (["--profile-rollouts", "-1"], CPU, "not a rollout id"),
        (["--profile-rollouts", "1", "--async", "one-step"], CPU, "not --async one-step's"),
    ],
)
def test_rule_profile_rollouts(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        (["--record-memory-history"], CPU, "--record-memory-history needs CUDA"),
        (
            TINY_GPU + ["--record-memory-history", "--output-dir", "/tmp/r"],
            GPU1,
            {"memory_snapshot_dir": "/tmp/r/memory-snapshots"},
        ),
        (
            TINY_GPU + ["--record-memory-history", "--memory-snapshot-dir", "/tmp/s"],
            GPU1,
            {"memory_snapshot_dir": "/tmp/s"},
        ),
        (["--memory-snapshot-dir", "/tmp/s"], CPU, "--memory-snapshot-dir is only used with --record-memory-history"),
    ],
)
def test_rule_memory_history(argv, env, expect):
    check(argv, env, expect)


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        ([], CPU, {"warm_process": "auto"}),
        (TINY_GPU + ["--warm-process", "on"], GPU1, {"warm_process": "on"}),
        (["--warm-process", "off"], CPU, {"warm_process": "off"}),
        (["--warm-process", "on", "--ray-address", "10.0.0.1:6379"], CPU, "--ray-address"),
        (
            ["--warm-process", "on", "--rollout-engine", "sglang", "--rollout-external-engine-addrs", "h:1"],
            CPU,
            "sglang",
        ),
    ],
)
def test_rule_warm_process(argv, env, expect):
    check(argv, env, expect)


def test_warm_process_modules_on_any_host_only_when_asked():
    """A GPU host prestarts no preloaded workers (each costs a Ray import), but ``--warm-process on`` gives its
    warm process the same modules a small CPU host's gets."""
    from tidal.cluster.ray_cluster import prestart_modules

    assert prestart_modules("qwen2", actors=2, trainer=True, num_gpus=1) == []
    mods = prestart_modules("qwen2", actors=2, trainer=True, num_gpus=1, any_host=True)
    assert mods[:2] == ["torch", "transformers.models.qwen2.modeling_qwen2"] and "tidal.trainer.actor" in mods


@pytest.mark.parametrize("flag, warm", [("auto", True), ("on", True), ("off", False)])
def test_a_gpu_run_plans_a_warm_process_unless_off(flag, warm):
    """``--warm-process auto`` (the default) forks a local GPU cluster's actors from a warm process, as ``on``
    does; ``off`` starts none. Ray's prestarted workers preload nothing there either way."""
    from tidal.session import Session

    cfg, _ = run(TINY_GPU + ["--warm-process", flag], GPU1)
    placement, _, preload, modules = Session(cfg)._plan_cluster("qwen2", {})
    assert placement.num_gpus == 1 and preload == []
    assert bool(modules) == warm and (not warm or modules[0] == "torch")


def test_resolve_is_idempotent_and_does_not_mutate_its_input():
    cfg, prov = parse(["--offload"])
    once = resolve(cfg, prov, CPU)
    assert cfg.memory.offload_train is None  # input untouched
    twice = resolve(once, prov, CPU)
    assert once == twice


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--task", "guess"], {"env_path": None, "max_turns": 4}),
        (["--env-path", "my_envs:Maze", "--max-turns", "8"], {"env_path": "my_envs:Maze", "max_turns": 8}),
        (["--env-path", "my_envs.Maze"], "--env-path my_envs.Maze: expected module:Class or file.py:Class"),
        (["--env-path", "/no/such/envs.py:Maze"], "--env-path /no/such/envs.py:Maze: no such file /no/such/envs.py"),
        (["--max-turns", "3"], "--max-turns has no effect without an environment"),
        (["--agent-reward", "rm"], "--agent-reward has no effect without an environment"),
        (
            ["--env-path", "e:E", "--custom-generate-function-path", "g:f"],
            "--custom-generate-function-path and an environment both decide",
        ),
        (
            ["--task", "guess", "--rollout-max-response-len", "8", "--max-trajectory-tokens", "4"],
            "--max-trajectory-tokens 4 is below --rollout-max-response-len 8",
        ),
        (["--task", "calculator"], "--task calculator asks chat questions; --model tiny has a character tokenizer"),
        (["--task", "guess"], {"rollout_prefix_cache_mb": 1024}),
        (["--task", "guess", "--rollout-prefix-cache-mb", "0"], {"rollout_prefix_cache_mb": 0}),
        ([], {"rollout_prefix_cache_mb": 0}),
        # the batch rule counts a whole trajectory: 512 prompt + 1024 trajectory tokens
        (["--task", "guess", "--max-tokens-per-gpu", "1000"], "below the longest sample (512 prompt + 1024 trajectory"),
        (["--task", "guess", "--async", "one-step"], "--async one-step generates one response per prompt"),
    ],
)
def test_rule_multi_turn(argv, expect):
    check(argv, CPU, expect)


def test_memory_plan_counts_trajectories_and_stored_prefixes():
    from tidal.config.plan import build_plan, model_shape

    single, _ = run([])
    multi, _ = run(["--task", "guess"])
    plans = [build_plan(c, model_shape(c), CPU) for c in (single, multi)]
    assert "prefix_cache" not in plans[0].engine and plans[1].engine["prefix_cache"] > 0
    # the engine KV of a trajectory: 512 + 1024 tokens against 512 + 1
    assert plans[1].engine["kv_cache"] == plans[0].engine["kv_cache"] * (512 + 1024) // (512 + 1)


GPU2_MEGATRON = Environment(
    cuda_available=True,
    device_count=2,
    device_memory=80 * GIB,
    host_memory=256 * GIB,
    tms_available=True,
    megatron_available=True,
)
MEGATRON = ["--model", "tiny", "--device", "cuda", "--train-backend", "megatron"]


@pytest.mark.parametrize(
    "argv,env,expect",
    [
        (MEGATRON, GPU2_MEGATRON, {"train_backend": "megatron", "tensor_model_parallel_size": 1}),
        (
            [*MEGATRON, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            dataclasses.replace(GPU2_MEGATRON, transformer_engine_available=True),
            {"tensor_model_parallel_size": 2, "sequence_parallel": True, "transformer_impl": "transformer_engine"},
        ),
        (
            [*MEGATRON, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            dataclasses.replace(GPU2_MEGATRON, apex_available=True),
            {"sequence_parallel": True, "transformer_impl": "local"},
        ),
        (
            [*MEGATRON, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            GPU2_MEGATRON,
            "--sequence-parallel with --transformer-impl local needs apex",
        ),
        (
            [*MEGATRON, "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2"],
            GPU2_MEGATRON,
            {"pipeline_model_parallel_size": 2},
        ),
        (["--model", "tiny", "--train-backend", "megatron"], CPU, "--train-backend megatron needs CUDA"),
        (MEGATRON, GPU1, "megatron-core is not installed; pip install 'tidal[megatron]'"),
        (
            ["--model", "tiny", "--tensor-model-parallel-size", "2"],
            CPU,
            "--tensor-model-parallel-size is a Megatron option",
        ),
        (["--model", "tiny", "--use-distributed-optimizer"], CPU, "--use-distributed-optimizer is a Megatron option"),
        (["--model", "tiny", "--use-nccl-ub"], CPU, "--use-nccl-ub is a Megatron option"),
        ([*MEGATRON, "--context-parallel-size", "2"], GPU2_MEGATRON, "--context-parallel-size 2"),
        ([*MEGATRON, "--sequence-parallel"], GPU2_MEGATRON, "--sequence-parallel splits over tensor-parallel ranks"),
        ([*MEGATRON, "--tensor-model-parallel-size", "2"], GPU2_MEGATRON, "does not divide the 1 trainer ranks"),
        (
            [
                *MEGATRON,
                "--actor-num-gpus-per-node",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--model",
                "qwen2.5-7b-shape",
                "--no-check-memory-plan",
            ],
            GPU2_MEGATRON,
            {"tensor_model_parallel_size": 2},
        ),
        (
            [
                *MEGATRON,
                "--actor-num-gpus-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--model",
                "qwen2.5-7b-shape",
                "--no-check-memory-plan",
            ],
            GPU2_MEGATRON,
            {"pipeline_model_parallel_size": 2},
        ),
        ([*MEGATRON, "--advantage-estimator", "ppo"], GPU2_MEGATRON, "does not have; use --train-backend fsdp"),
        (
            ["--model", "tiny", "--train-backend", "megatron", "--debug-rollout-only"],
            CPU,
            {"train_backend": "megatron"},
        ),
    ],
)
def test_rule_megatron(argv, env, expect):
    check(argv, env, expect)


GPU2_MEGATRON_TE = dataclasses.replace(GPU2_MEGATRON, transformer_engine_available=True)


@pytest.mark.parametrize(
    "argv,env,expect",
    [
        # derived from what is installed: Transformer Engine's spec when it is, else the local one
        (MEGATRON, GPU2_MEGATRON, {"transformer_impl": "local"}),
        (MEGATRON, GPU2_MEGATRON_TE, {"transformer_impl": "transformer_engine"}),
        ([*MEGATRON, "--transformer-impl", "local"], GPU2_MEGATRON_TE, {"transformer_impl": "local"}),
        ([*MEGATRON, "--transformer-impl", "transformer_engine"], GPU2_MEGATRON, "transformer_engine is not installed"),
        (["--model", "tiny", "--transformer-impl", "local"], CPU, "--transformer-impl is a Megatron option"),
        (["--model", "tiny"], CPU, {"transformer_impl": None}),  # the fsdp backend has no layer spec
    ],
)
def test_rule_megatron_layer_spec(argv, env, expect):
    prov = check(argv, env, expect)
    if prov is not None and "--transformer-impl" not in argv and "megatron" in argv:
        line = next(x for x in explain_text(argv, env).splitlines() if "--transformer-impl" in x)
        assert "megatron" in line and "installed" in line, line


def test_rule_megatron_splits_follow_the_model():
    """tiny: 2 key-value heads, 2 layers; 4-way TP or 4 stages do not divide it."""
    env = Environment(
        cuda_available=True, device_count=4, device_memory=80 * GIB, host_memory=256 * GIB, megatron_available=True
    )
    base = [*MEGATRON, "--actor-num-gpus-per-node", "4"]
    check([*base, "--tensor-model-parallel-size", "4"], env, "does not divide tiny's 2 key-value heads")
    check([*base, "--pipeline-model-parallel-size", "4"], env, "does not divide tiny's 2 layers")


@pytest.mark.parametrize(
    "argv,env,expect",
    [
        # the seed's derivation, both backends: off without offload-train, on with it
        (["--model", "tiny", "--no-offload-train"], CPU, {"disable_grad_buffers_cpu_backup": False}),
        (["--model", "tiny", "--offload-train"], CPU, {"disable_grad_buffers_cpu_backup": True}),
        ([*TINY_GPU, "--offload"], GPU1, {"disable_grad_buffers_cpu_backup": True, "offload_train": True}),
        ([*MEGATRON, "--offload-train"], GPU2_MEGATRON, {"disable_grad_buffers_cpu_backup": True}),
        ([*MEGATRON, "--no-offload-train"], GPU2_MEGATRON, {"disable_grad_buffers_cpu_backup": False}),
        # a critic forces offload-train when colocated, and with it the derived value
        (["--model", "tiny", "--advantage-estimator", "ppo"], CPU, {"disable_grad_buffers_cpu_backup": True}),
        # debug-rollout-only: nothing pauses
        (["--model", "tiny", "--debug-rollout-only"], CPU, {"disable_grad_buffers_cpu_backup": False}),
        # explicit values must agree with offload-train
        (
            ["--model", "tiny", "--offload-train", "--disable-grad-buffers-cpu-backup"],
            CPU,
            {"disable_grad_buffers_cpu_backup": True},
        ),
        (
            ["--model", "tiny", "--offload-train", "--no-disable-grad-buffers-cpu-backup"],
            CPU,
            "--no-disable-grad-buffers-cpu-backup contradicts offload-train on",
        ),
        (
            ["--model", "tiny", "--no-offload-train", "--disable-grad-buffers-cpu-backup"],
            CPU,
            "--disable-grad-buffers-cpu-backup contradicts offload-train off",
        ),
        # NCCL user buffers cannot be paused without backup
        (
            [*MEGATRON, "--offload-train", "--use-nccl-ub"],
            GPU2_MEGATRON,
            "--use-nccl-ub: NCCL user buffers come from NCCL's pool",
        ),
        ([*MEGATRON, "--no-offload-train", "--use-nccl-ub"], GPU2_MEGATRON, {"use_nccl_ub": True}),
    ],
)
def test_rule_grad_buffers(argv, env, expect):
    prov = check(argv, env, expect)
    if prov is not None and not prov.explicit("disable_grad_buffers_cpu_backup"):
        line = next(x for x in explain_text(argv, env).splitlines() if "--disable-grad-buffers-cpu-backup" in x)
        assert "grad-buffers" in line, line


def explain_text(argv, env) -> str:
    from tidal.config.explain import explain_argv

    return explain_argv(argv, env)


def test_explain_does_not_show_api_keys():
    cfg, prov = run(["--api-key", "s3cret-serve", "--rollout-engine-api-key", "s3cret-engine"], CPU)
    text = explain(cfg, prov, CPU)
    assert "s3cret" not in text and text.count("(set, not shown)") == 2


@pytest.mark.parametrize(
    "argv,env,expect",
    [
        # Off: the full-mode flags are refused; over-sampling stays unset (one round of the batch).
        ([], CPU, {"async_mode": "off", "colocate": True, "over_sampling_batch_size": None, "async_buffer_size": None}),
        (["--async", "one-step"], CPU, {"over_sampling_batch_size": 32}),
        (["--max-staleness", "2"], CPU, "--max-staleness is only used with --async"),
        (["--partial-rollout"], CPU, "--partial-rollout is only used with --async"),
        # CPU: engines on their own cores, no offload, TIS derived.
        (
            ["--async", "one-step"],
            CPU,
            {"colocate": False, "offload_train": False, "offload_rollout": False, "use_tis": True},
        ),
        (["--async", "one-step", "--use-rollout-logprobs"], CPU, {"use_tis": False, "use_rollout_logprobs": True}),
        (["--async", "one-step", "--no-use-tis"], CPU, {"use_tis": False}),
        (["--async", "one-step", "--max-staleness", "2"], CPU, "only used with --async full"),
        (["--async", "full"], CPU, {"async_buffer_size": 32, "max_staleness": 1}),
        (["--async", "full", "--max-staleness", "3"], CPU, {"async_buffer_size": 96}),
        (["--async", "full", "--async-buffer-size", "8"], CPU, "below --rollout-batch-size 32"),
        (["--async", "full", "--partial-rollout"], CPU, {"partial_rollout": True}),
        (["--async", "one-step", "--partial-rollout"], CPU, "--async one-step has none"),
        (
            ["--async", "full", "--partial-rollout", "--custom-generate-function-path", "m:f"],
            CPU,
            {"partial_rollout": True, "custom_generate_function_path": "m:f"},
        ),
        (["--async", "full", "--partial-rollout", "--task", "guess"], CPU, "not a multi-turn environment"),
        (
            ["--async", "full", "--partial-rollout", "--rollout-engine", "sglang"],
            CPU,
            {"partial_rollout": True, "rollout_engine": "sglang"},
        ),
        (["--async", "full", "--debug-rollout-only"], CPU, "--debug-rollout-only has none"),
        # Colocated by choice: both resident; an explicit offload is refused in one line.
        (["--async", "one-step", "--colocate"], CPU, {"colocate": True, "offload_train": False, "train_env_vars": {}}),
        (["--async", "one-step", "--colocate", "--offload"], CPU, "neither can release its memory"),
        # One GPU: trainer and engine stay on it together, resident; eight GPUs: engines get their own.
        # Sharing it, the trainer's kernels go below the engine's under MPS, unless a side sets a priority.
        (
            TINY_GPU + ["--async", "one-step"],
            GPU1,
            {
                "colocate": True,
                "offload_train": False,
                "offload_rollout": False,
                "train_env_vars": {"CUDA_MPS_CLIENT_PRIORITY": "1"},
            },
        ),
        (
            TINY_GPU + ["--async", "full", "--train-env-vars", '{"A": "b"}'],
            GPU1,
            {"train_env_vars": {"A": "b", "CUDA_MPS_CLIENT_PRIORITY": "1"}},
        ),
        (
            TINY_GPU + ["--async", "one-step", "--rollout-env-vars", '{"CUDA_MPS_CLIENT_PRIORITY": "1"}'],
            GPU1,
            {"train_env_vars": {}},
        ),
        (
            TINY_GPU + ["--async", "one-step", "--train-env-vars", '{"CUDA_MPS_CLIENT_PRIORITY": "0"}'],
            GPU1,
            {"train_env_vars": {"CUDA_MPS_CLIENT_PRIORITY": "0"}},
        ),
        (TINY_GPU, GPU1, {"train_env_vars": {}}),
        (TINY_GPU + ["--async", "one-step"], GPU8, {"colocate": False, "rollout_num_gpus": 1, "train_env_vars": {}}),
        # Over-sampling below a batch needs dynamic sampling (rounds continue until a batch is kept).
        (["--over-sampling-batch-size", "64"], CPU, {"over_sampling_batch_size": 64, "async_mode": "off"}),
        (["--over-sampling-batch-size", "16"], CPU, "without --dynamic-sampling"),
        (["--async", "full", "--over-sampling-batch-size", "16"], CPU, "without --dynamic-sampling"),
        (
            ["--async", "full", "--over-sampling-batch-size", "16", "--dynamic-sampling"],
            CPU,
            {"over_sampling_batch_size": 16},
        ),
    ],
)
def test_rule_async(argv, env, expect):
    check(argv, env, expect)


GPU8_64G = Environment(
    cuda_available=True, device_count=8, device_memory=64 * GIB, host_memory=1024 * GIB, tms_available=True
)


@pytest.mark.parametrize(
    "argv, env, expect, why",
    [
        # The default on GPU: the weights where the plan fits them, the provenance saying what it fits. The 0.5B
        # preset on an 80 GiB GPU fits its whole trainer state (8 GiB) beside the generate phase (all stays
        # opt-in); 7B on 8 x 64 GiB its weight shard only. Off where nothing fits, on CPU and without offload.
        (HALF_0P5B, GPU1, {"train_resume_early": "weights"}, "all fits: generate"),
        (HALF_0P5B, GPU1, {}, "; so weights (all is opt-in)"),
        (SEVEN_B + ["--offload"], GPU8_64G, {"train_resume_early": "weights"}, "the weights fit: generate"),
        (SEVEN_B + ["--offload"], GPU8_64G, {}, "usable per GPU; so weights"),
        (
            SEVEN_B + ["--offload", "--rollout-batch-size", "8192", "--no-check-memory-plan"],
            GPU8_64G,
            {"train_resume_early": "off"},
            "nothing fits",
        ),
        (["--offload-train"], CPU, {"train_resume_early": "off"}, "off on CPU"),
        ([], CPU, {"train_resume_early": "off"}, "never pauses"),
        # Asked for: what the plan fits is accepted, more is refused with what does fit.
        (HALF_0P5B + ["--train-resume-early", "all"], GPU1, {"train_resume_early": "all"}, None),
        (SEVEN_B + ["--offload", "--train-resume-early", "weights"], GPU8_64G, {"train_resume_early": "weights"}, None),
        (
            SEVEN_B + ["--offload", "--train-resume-early", "all"],
            GPU8_64G,
            "--train-resume-early all: the memory plan does not fit it beside the generate phase (the weights fit: "
            "generate 50.2 GiB",
            None,
        ),
        (SEVEN_B + ["--offload", "--train-resume-early", "all", "--no-check-memory-plan"], GPU8_64G, {}, None),
        # On CPU the host is the device: explicit values are how CI runs the early resume.
        (["--offload-train", "--train-resume-early", "weights"], CPU, {"train_resume_early": "weights"}, None),
        (["--train-resume-early", "all"], CPU, "--train-resume-early all needs --offload-train", None),
        (["--train-resume-early", "off"], CPU, {"train_resume_early": "off"}, None),
    ],
)
def test_rule_resume_early(argv, env, expect, why):
    prov = check(argv, env, expect)
    if why is not None:
        assert why in prov.of("train_resume_early").detail


def test_rule_compile_options():
    """Combo kernels for the compiled decode step with CUDA, nothing on CPU or without the compiled step; a user's
    options are kept, as JSON scalars, and need the compiled step."""
    check([], CPU, {"rollout_compile_options": {}})
    check(TINY_GPU, GPU1, {"rollout_compile_options": {"combo_kernels": True}})
    check(TINY_GPU + ["--no-rollout-compile"], GPU1, {"rollout_compile_options": {}})
    mine = {"combo_kernels": False, "max_autotune": True}
    check(TINY_GPU + ["--rollout-compile-options", json.dumps(mine)], GPU1, {"rollout_compile_options": mine})
    check(TINY_GPU + ["--rollout-compile-options", '{"a": [1]}'], GPU1, "--rollout-compile-options: a is [1]")
    check(["--rollout-compile-options", '{"combo_kernels": true}'], CPU, "--rollout-compile-options sets the compiled")
    check(["--rollout-compile", "--rollout-compile-options", '{"combo_kernels": true}'], CPU,
          {"rollout_compile_options": {"combo_kernels": True}})  # fmt: skip
