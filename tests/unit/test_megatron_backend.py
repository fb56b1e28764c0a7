"""The Megatron backend behind the trainer interface, on a CPU machine: it is chosen by --train-backend,
speaks the checkpoint protocols, and refuses to start without CUDA in one line (exit 2 from the CLI)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tidal.checkpoint.export import ExportSource
from tidal.checkpoint.store import TrainState
from tidal.config.schema import AlgorithmConfig, MemoryConfig, ModelConfig, TrainerConfig, WeightSyncConfig
from tidal.errors import UserError
from tidal.trainer.base import Trainer, trainer_class
from tidal.trainer.megatron.model import choose_transformer_impl, megatron_available
from tidal.trainer.megatron.state import MegatronState
from tidal.trainer.megatron.trainer import CPU_REFUSAL, MegatronTrainer


def _trainer(**memory) -> MegatronTrainer:
    return MegatronTrainer(
        0,
        1,
        "127.0.0.1",
        29500,
        model=ModelConfig(model="tiny"),
        trainer=TrainerConfig(train_backend="megatron"),
        algorithm=AlgorithmConfig(),
        memory=MemoryConfig(**memory),
        weight_sync=WeightSyncConfig(),
        device="cpu",
    )


def test_megatron_is_a_trainer_chosen_by_the_flag():
    assert trainer_class("megatron") is MegatronTrainer
    assert issubclass(MegatronTrainer, Trainer)
    state = MegatronState(_trainer())
    assert isinstance(state, TrainState) and isinstance(state, ExportSource)


@pytest.mark.parametrize(
    "memory,unbacked", [({}, False), ({"offload_train": True}, True), ({"offload_train": False}, False)]
)
def test_grad_buffers_follow_offload_train(memory, unbacked):
    assert _trainer(**memory).grads_unbacked is unbacked


@pytest.mark.parametrize(
    "requested,importable,expect",
    [
        (None, True, "transformer_engine"),
        (None, False, "local"),
        ("local", True, "local"),
        ("transformer_engine", True, "transformer_engine"),
        ("transformer_engine", False, "does not import on this machine"),
    ],
)
def test_layer_spec_is_transformer_engines_when_it_imports(requested, importable, expect):
    if expect in ("local", "transformer_engine"):
        assert choose_transformer_impl(requested, lambda: importable) == expect
    else:
        with pytest.raises(UserError, match=expect):
            choose_transformer_impl(requested, lambda: importable)


def test_init_on_cpu_refuses_in_one_line():
    with pytest.raises(UserError) as exc:
        _trainer().init()
    assert str(exc.value) == CPU_REFUSAL and "\n" not in CPU_REFUSAL


def test_cli_refuses_megatron_on_cpu_with_exit_2(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tidal.cli",
            "train",
            "--train-backend",
            "megatron",
            "--device",
            "cpu",
            "--num-rollout",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines == [f"tidal: error: {CPU_REFUSAL}"], r.stderr
    assert not any(tmp_path.iterdir()), "nothing written"


@pytest.mark.skipif(not megatron_available(), reason="megatron-core is not installed (pip install 'tidal[megatron]')")
def test_megatron_trains_like_fsdp_on_cpu(tmp_path):
    """Megatron's GPTModel, DDP, optimizer and schedule under MegatronTrainer.train next to the FSDP2 backend
    (tests/megatron_cpu_train.py): the same seeded start, the same metrics for a one-step and a two-step
    rollout with a KL reference, weights within fp32 noise after three AdamW steps; pause/resume and
    save/load bit-exact; the FSDP2 backend loads the Megatron checkpoint bit for bit; memory moved into its
    regions without torch's block swap; the distributed optimizer trains like the plain one. (Two ranks with
    DP, TP and PP = 2: test_megatron_layout.py.)"""
    import json
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "result.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, os.path.join(root, "tests", "megatron_cpu_train.py"), str(port), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["start_equal"]
    for meg, fsdp in res["rollouts"]:
        assert meg["tokens"] == fsdp["tokens"] and meg["optimizer_steps"] == fsdp["optimizer_steps"]
        for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
            assert abs(meg[k] - fsdp[k]) <= 1e-5 * max(1.0, abs(fsdp[k])), (k, meg[k], fsdp[k])
    assert res["rollouts"][1][0]["kl"] > 0  # the reference model is in the loss
    assert res["weights_max_abs_diff"] < 1e-4
    assert res["resume_bit_exact"] and res["load_bit_exact"] and res["fsdp_loads_it"]
    # Without torch's in-place block swap (as on torch 2.11): every optimizer state tensor the first step made
    # was moved into its region by re-pointing (FSDP2: the DTensors' local tensors), and the distributed
    # optimizer's parameter buffers too, with every view of them: it trains bit for bit like the plain one.
    for backend in ("megatron", "fsdp"):
        adopted = res["adopted"][backend]
        assert adopted["tensors"] > 0 and adopted["adopted"] == adopted["tensors"], (backend, adopted)
    dist_opt = res["distributed_optimizer"]
    assert dist_opt["param_buffers_moved"] > 0
    # Loss, KL and entropy bit for bit (they read the weights the first step made); the gradient norm sums the
    # same squares in the distributed optimizer's buffer order, which may round the last bit differently.
    for dist, (meg, _) in zip(dist_opt["rollouts"], res["rollouts"], strict=True):
        assert {k: v for k, v in dist.items() if k != "grad_norm"} == {k: v for k, v in meg.items() if k != "grad_norm"}
        assert abs(dist["grad_norm"] - meg["grad_norm"]) <= 1e-6 * meg["grad_norm"], (dist, meg)
    # Megatron's process groups: destroyed at the pause, rebuilt at the resume, no reference to an old one
    # left anywhere, and the rollout after the resume (above) trained like FSDP2's through the new ones.
    groups = res["groups"]
    assert res["pause"]["memory/trainer_pause/groups_released"] == groups["old"] == groups["new"] > 10, res["pause"]
    assert res["resume"]["memory/trainer_resume/groups_rebuilt"] == 1
    assert res["resume"]["memory/trainer_resume/groups_repointed"] > 0
    assert groups["stale"] == [] and groups["old_registered"] == 0, groups
    assert groups["new_registered"] == groups["new"] and groups["fresh_getters"], groups
