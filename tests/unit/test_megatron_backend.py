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
