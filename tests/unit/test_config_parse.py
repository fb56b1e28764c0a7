"""Flags, config files and presets: precedence, typing, unknown and removed flags, size units."""

from __future__ import annotations

import pytest

from tidal.config import REMOVED, Environment, parse, parse_size, split_assumptions, to_yaml
from tidal.config.args import config_from_dict, fields, load_file
from tidal.errors import ConfigError, UserError


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_no_flags_is_the_schema_default():
    cfg, prov = parse([])
    assert cfg.rollout.rollout_batch_size == 32 and cfg.model.model == "tiny"
    assert all(prov.of(f.name).kind == "default" for f in fields())


def test_precedence_default_preset_file_flag(tmp_path):
    path = write(tmp_path, "preset: tiny-cpu\nrollout_batch_size: 16\nn_samples_per_prompt: 4\nlr: 0.01\n")
    cfg, prov = parse(["--config", path, "--n-samples-per-prompt", "2"])
    assert cfg.rollout.n_samples_per_prompt == 2 and prov.of("n_samples_per_prompt").kind == "flag"
    assert cfg.rollout.rollout_batch_size == 16 and prov.of("rollout_batch_size").kind == "file"
    assert prov.of("rollout_batch_size").detail == path
    assert cfg.model.model == "tiny" and prov.of("model").kind == "preset"
    assert cfg.trainer.lr == 0.01
    assert prov.of("rollout_seed").kind == "default"


def test_preset_flag_overrides_the_files_preset(tmp_path):
    path = write(tmp_path, "preset: tiny-cpu\n")
    cfg, prov = parse(["--config", path, "--preset", "qwen2.5-0.5b-1gpu"])
    assert cfg.model.model == "qwen2.5-0.5b-shape"
    assert prov.of("model").detail == "qwen2.5-0.5b-1gpu"


def test_sectioned_and_flat_keys_with_dashes(tmp_path):
    path = write(
        tmp_path,
        "rollout:\n  rollout-batch-size: 4\nmemory:\n  offload_train: true\nupdate-weight-buffer-size: 64MiB\n",
    )
    cfg, _ = parse(["--config", path])
    assert cfg.rollout.rollout_batch_size == 4
    assert cfg.memory.offload_train is True
    assert cfg.weight_sync.update_weight_buffer_size == 64 * 1024**2


@pytest.mark.parametrize(
    "text, message",
    [
        ("rollout_batch_sizes: 4\n", "unknown key rollout_batch_sizes; did you mean rollout_batch_size?"),
        ("rollout:\n  lr: 0.1\n", "lr belongs to section trainer, not rollout; move it there"),
        (
            "rollout:\n  rollout_batchsize: 4\n",
            "unknown key rollout.rollout_batchsize; did you mean rollout_batch_size?",
        ),
        (
            "train_memory_margin_bytes: 1024\n",
            "key train_memory_margin_bytes: --train-memory-margin-bytes was removed in tidal 0.1.0",
        ),
        ("rollout_batch_size: many\n", "rollout_batch_size: expected an int, got 'many'"),
        ("colocate: maybe\n", "colocate: expected a bool, got 'maybe'"),
        ("device: gpu\n", "device: 'gpu' is not a choice"),
        ("rollout_batch_size: 0\n", "rollout_batch_size: must be at least 1"),
        ("- a\n- b\n", "expected a mapping of flag names to values"),
        ("a: [\n", "not valid YAML at line"),
        ("preset: nope\n", "--preset nope: no such preset"),
        ("colocate: null\n", "colocate: cannot be empty"),
    ],
)
def test_bad_config_files(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        parse(["--config", path])
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rollout-batch-sizes", "4"], "unknown flag --rollout-batch-sizes; did you mean --rollout-batch-size?"),
        (["--ofload-train"], "unknown flag --ofload-train; did you mean --offload-train?"),
        (["--no-colocated"], "unknown flag --no-colocated; did you mean --no-colocate?"),
        (
            ["--update-weight-transprot=disk"],
            "unknown flag --update-weight-transprot; did you mean --update-weight-transport?",
        ),
        (["--colo"], "unknown flag --colo"),  # abbreviations are not accepted
        (["--zzzzzz"], "unknown flag --zzzzzz (all flags: docs/cli.md)"),
        (["train.yaml"], "unexpected argument 'train.yaml'"),
        (["--rollout-batch-size"], "argument --rollout-batch-size: expected one argument"),
        (["--device", "gpu"], "--device: 'gpu' is not a choice"),
        (["--lr", "fast"], "--lr: expected a float, got 'fast'"),
        (["--update-weight-buffer-size", "lots"], "--update-weight-buffer-size: cannot read 'lots' as a size"),
        (["--config", "/nonexistent/x.yaml"], "--config /nonexistent/x.yaml: no such file"),
        (["--preset", "tiny-gpu"], "--preset tiny-gpu: no such preset; did you mean tiny-cpu?"),
    ],
)
def test_bad_flags(argv, message):
    with pytest.raises(ConfigError) as exc:
        parse(argv)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_unknown_flag_did_you_mean_gives_nothing_when_nothing_is_close():
    with pytest.raises(ConfigError) as exc:
        parse(["--qqqqqqqqqq"])
    assert "did you mean" not in str(exc.value)


@pytest.mark.parametrize("entry", REMOVED, ids=lambda e: e.flag)
@pytest.mark.parametrize("form", ["flag value", "flag=value", "file key"])
def test_every_removed_flag_is_rejected_with_its_registry_message(tmp_path, entry, form):
    if form == "flag value":
        argv = ["--lr", "0.1", entry.flag, "1024"]
    elif form == "flag=value":
        argv = [f"{entry.flag}=1024"]
    else:
        argv = ["--config", write(tmp_path, f"{entry.key}: 1024\n")]
    with pytest.raises(ConfigError) as exc:
        parse(argv)
    msg = str(exc.value)
    assert entry.message() in msg
    assert f"removed in tidal {entry.version}" in msg and entry.instead in msg


def test_removed_flags_are_not_fields():
    names = {f.name for f in fields()}
    assert not [r.flag for r in REMOVED if r.key in names]


def test_config_error_is_a_user_error_with_exit_code_2():
    with pytest.raises(UserError) as exc:
        parse(["--nope"])
    assert exc.value.exit_code == 2


def test_bool_flags_have_both_forms():
    cfg, prov = parse(["--no-colocate", "--offload-train", "--no-offload-rollout", "--progress"])
    assert cfg.cluster.colocate is False and prov.of("colocate").detail == "--no-colocate"
    assert prov.of("offload_train").detail == "--offload-train"
    assert cfg.memory.offload_train is True and cfg.memory.offload_rollout is False


def test_lists_json_and_sizes():
    cfg, _ = parse(
        ["--rollout-stop", "\n\n", "</s>", "--train-env-vars", '{"A": "1"}', "--update-weight-buffer-size", "1e6"]
    )
    assert cfg.rollout.rollout_stop == ["\n\n", "</s>"]
    assert cfg.cluster.train_env_vars == {"A": "1"}
    assert cfg.weight_sync.update_weight_buffer_size == 1_000_000


@pytest.mark.parametrize(
    "text, value",
    [
        ("512MiB", 512 * 2**20),
        ("80GiB", 80 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("1024", 1024),
        (2048, 2048),
        ("4 kib", 4096),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_rejects_nonsense():
    with pytest.raises(ConfigError, match="cannot read '12 parsecs' as a size"):
        parse_size("12 parsecs", "--x")


def test_assumptions_are_taken_out_of_argv():
    base = Environment()
    env, rest = split_assumptions(
        [
            "--assume-gpus",
            "8",
            "--rollout-batch-size",
            "4",
            "--assume-gpu-memory=80GiB",
            "--assume-host-memory",
            "1TiB",
        ],
        base,
    )
    assert rest == ["--rollout-batch-size", "4"]
    assert (env.cuda_available, env.device_count, env.device_memory, env.host_memory) == (True, 8, 80 * 2**30, 2**40)
    assert env.tms_available and env.assumed
    env, _ = split_assumptions(["--assume-gpus", "2", "--assume-gpu-memory", "24GiB", "--assume-no-tms"], base)
    assert not env.tms_available
    with pytest.raises(ConfigError, match="--assume-gpus needs --assume-gpu-memory"):
        split_assumptions(["--assume-gpus", "8"], base)
    with pytest.raises(ConfigError, match="--assume-gpus: expected a whole number"):
        split_assumptions(["--assume-gpus", "eight"], base)


def test_yaml_dump_round_trips(tmp_path):
    cfg, _ = parse(["--offload", "--rollout-batch-size", "4", "--train-env-vars", '{"A": "1"}'])
    path = write(tmp_path, to_yaml(cfg))
    again, prov = parse(["--config", path])
    assert again == cfg
    assert prov.of("rollout_batch_size").kind == "file"
    assert config_from_dict(cfg.to_dict()) == cfg
    flat, preset = load_file(path)
    assert preset is None and flat["rollout_batch_size"] == 4


def test_detect_describes_this_machine():
    env = Environment.detect()
    assert env.host_memory > 0 and env.cpu_count >= 1
    assert "detected" in env.describe()


def test_the_driver_probe_leaves_the_question_to_torch_where_it_cannot_answer():
    """``cuda_without_torch``: None once torch is loaded (torch is then asked, at no cost), and None on a host
    whose torch has no CUDA kernels or no CUDA driver (this CPU host): the answer is torch's there. A fresh
    process on such a host detects the machine without importing torch. (Its answer on a GPU host:
    tests/gpu/test_config_gpu.py.)"""
    import subprocess
    import sys

    import torch

    from tidal.config.environment import cuda_build_version, cuda_without_torch

    assert "torch" in sys.modules and cuda_without_torch() is None
    # The CUDA version a torch build names in torch/version.py, against which the driver's must not be older.
    assert cuda_build_version("__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\n") == 13000
    assert cuda_build_version("cuda = '12.8'\n") == 12080
    assert cuda_build_version("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n") is None
    if not torch.cuda.is_available():
        code = (
            "import sys\nfrom tidal.config.environment import Environment, cuda_without_torch\n"
            "assert cuda_without_torch() is None and not Environment.detect().cuda_available\n"
            "print('torch' in sys.modules)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        assert out.stdout.strip() == "False", out.stdout + out.stderr
