"""The trainer interface: --train-backend picks a class from one table, and the FSDP2 backend speaks the
protocols checkpoints and export read it through."""

from __future__ import annotations

import dataclasses

import pytest

from tidal.checkpoint.export import ExportSource
from tidal.checkpoint.store import TrainState
from tidal.config.schema import TrainerConfig
from tidal.errors import ConfigError
from tidal.trainer.actor import TrainerActor
from tidal.trainer.base import BACKENDS, Trainer, trainer_class
from tidal.trainer.fsdp_state import FSDPState


def test_train_backend_flag_and_table_agree():
    (field,) = [f for f in dataclasses.fields(TrainerConfig) if f.name == "train_backend"]
    assert set(field.metadata["choices"]) == set(BACKENDS)
    assert trainer_class(TrainerConfig().train_backend) is TrainerActor
    assert issubclass(TrainerActor, Trainer)
    with pytest.raises(ConfigError, match="--train-backend 'deepspeed'"):
        trainer_class("deepspeed")


def test_fsdp_state_speaks_the_checkpoint_and_export_protocols():
    parts = dict.fromkeys(("model", "params", "optimizer", "schedule", "groups", "memory", "tokenizer", "gather"))
    state = FSDPState(rank=0, world_size=1, model_name="tiny", **parts)
    assert isinstance(state, TrainState) and isinstance(state, ExportSource)


def test_a_backend_must_implement_the_whole_contract():
    class Half(Trainer):
        def init(self) -> dict:
            return {}

    with pytest.raises(TypeError, match="abstract"):
        Half()
