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


def test_trainer_two_stage_pause_and_illegal_orders():
    """The offload loop's order: optimizer state and grads after training, the weights after the sync."""
    r = TrainerResidency("trainer rank 0")
    for _ in range(2):
        assert r.pause(keep_weights=True) is TrainerState.ACTIVE
        assert r.state is TrainerState.WEIGHTS_ONLY and not r.paused  # the weight source reads live weights
        with pytest.raises(ResidencyError, match="pause\\(keep_weights=True\\) while already WEIGHTS_ONLY"):
            r.pause(keep_weights=True)
        with pytest.raises(ResidencyError, match="train while WEIGHTS_ONLY"):
            r.require_active("train")
        with pytest.raises(ResidencyError, match="save while WEIGHTS_ONLY"):
            r.require_whole("save")
        with pytest.raises(ResidencyError, match="while WEIGHTS_ONLY \\(the weights have no host backup\\)"):
            r.require_paused("read weights from the host backup")
        assert r.pause() is TrainerState.WEIGHTS_ONLY
        assert r.paused
        r.require_whole("save")
        assert r.resume() is TrainerState.PAUSED
    # WEIGHTS_ONLY straight back to ACTIVE (nothing generated in between).
    r.pause(keep_weights=True)
    assert r.resume() is TrainerState.WEIGHTS_ONLY and r.state is TrainerState.ACTIVE
    r.require_whole("save")


def test_trainer_early_resume_brings_the_weights_first():
    """``resume(weights_only=True)``: PAUSED -> WEIGHTS_ONLY (the weights back while the engines generate), then
    ``resume()`` -> ACTIVE; only from PAUSED."""
    r = TrainerResidency("trainer rank 0")
    r.pause()
    assert r.resume(weights_only=True) is TrainerState.PAUSED and r.state is TrainerState.WEIGHTS_ONLY
    with pytest.raises(ResidencyError, match="resume\\(weights_only=True\\) while WEIGHTS_ONLY"):
        r.resume(weights_only=True)
    with pytest.raises(ResidencyError, match="train while WEIGHTS_ONLY"):
        r.require_active("train")
    assert r.resume() is TrainerState.WEIGHTS_ONLY and r.state is TrainerState.ACTIVE
    with pytest.raises(ResidencyError, match="resume\\(\\) of an ACTIVE trainer"):
        r.resume(weights_only=True)


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
