"""Residency state machines: every legal order passes, every illegal one raises a ResidencyError naming it."""

from __future__ import annotations

import pytest

from tidal.errors import ResidencyError
from tidal.memory import EngineResidency, EngineState, TrainerResidency, TrainerState


def test_trainer_cycle_and_illegal_orders():
    r = TrainerResidency("trainer rank 0")
    assert r.state is TrainerState.ACTIVE
    r.require_active("train")
    with pytest.raises(ResidencyError, match="resume\\(\\) of an ACTIVE trainer"):
        r.resume()
    with pytest.raises(ResidencyError, match="while ACTIVE"):
        r.require_paused("read weights from the host backup")
    r.pause()
    assert r.paused
    with pytest.raises(ResidencyError, match="trainer rank 0: pause\\(\\) while already PAUSED \\(double pause\\)"):
        r.pause()
    with pytest.raises(ResidencyError, match="train while PAUSED"):
        r.require_active("train")
    r.require_paused("read weights from the host backup")
    r.resume()
    assert r.state is TrainerState.ACTIVE


def test_engine_loop_order_is_legal():
    e = EngineResidency("engine 0")
    e.require_generate()
    for _ in range(3):  # the colocated loop: generate, release, resume weights, sync, resume KV
        e.require_generate()
        e.release()
        e.resume_weights()
        e.require_sync()
        e.mark_synced()
        e.resume_kv()
    assert e.state is EngineState.AWAKE and e.weights_valid


def test_engine_illegal_orders():
    e = EngineResidency("engine 0")
    with pytest.raises(ResidencyError, match="resume_weights\\(\\) while AWAKE"):
        e.resume_weights()
    with pytest.raises(ResidencyError, match="resume_kv\\(\\) while AWAKE"):
        e.resume_kv()
    e.release()
    with pytest.raises(ResidencyError, match="double release"):
        e.release()
    with pytest.raises(ResidencyError, match="weight sync into an ASLEEP engine"):
        e.require_sync()
    with pytest.raises(ResidencyError, match="weight sync into an ASLEEP engine"):
        e.mark_synced()
    with pytest.raises(ResidencyError, match="generate while ASLEEP"):
        e.require_generate()
    with pytest.raises(ResidencyError, match="resume_kv\\(\\) while ASLEEP"):
        e.resume_kv()
    e.resume_weights()
    with pytest.raises(ResidencyError, match="generate while WEIGHTS_ONLY"):
        e.require_generate()
    e.resume_kv()  # KV back without a sync: the weights are still undefined
    with pytest.raises(ResidencyError, match="never synced"):
        e.require_generate()
    e.mark_synced()
    e.require_generate()


def test_engine_release_from_weights_only():
    e = EngineResidency()
    e.release()
    e.resume_weights()
    e.release()  # a sync was abandoned: releasing the weights again is legal
    assert e.state is EngineState.ASLEEP
