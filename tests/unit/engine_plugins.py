"""Generate functions loaded by path in end-to-end tests (through --custom-generate-function-path).

``perturbed`` makes the engine sample from a policy that is not the trainer's, the way a
lower-precision or differently compiled engine does, but larger: it adds noise to the engine's
output layer for the duration of one generate call, so the responses *and* the log-probs the engine
reports come from the perturbed policy. The weights are restored afterwards, so every sync still
lands on (and is checked against) the trainer's weights.

``held_until_paused`` holds engine 0's calls after their first decode step until a pause arrives, so
that a ``--partial-rollout`` run always has rows with tokens to continue on new weights.
"""

from __future__ import annotations

import torch

NOISE_STD = 0.03


def perturbed(engine, samples, sampling):
    head = engine.model.get_output_embeddings().weight
    gen = torch.Generator(device="cpu").manual_seed(int(sampling.seed or 0))
    noise = torch.randn(head.shape, generator=gen).to(head.device, head.dtype) * NOISE_STD
    with torch.no_grad():
        head.add_(noise)
    try:
        return engine.generate_default(samples, sampling)
    finally:
        with torch.no_grad():
            head.sub_(noise)


HOLD_LIMIT_S = 120.0  # a pause that never comes (a broken loop) fails the run's checks instead of hanging it


def held_until_paused(engine, samples, sampling):
    """The built-in generate step, except that on engine 0 each new call (every one after the engine's
    first, none that continues rows a pause cut short) stops after its first decode step and waits there
    until the engine is asked to pause (``pause_generation``): the pause then always finds rows that
    already have tokens, so a ``--partial-rollout`` run continues them on the next weights whatever the
    machine's speed. Engine 1 generates freely and keeps the trainer fed meanwhile."""
    fresh = all(not s.response_ids and s.status == "pending" for s in samples)
    if engine.engine_rank != 0 or not fresh or engine._calls == 0:
        return engine.generate_default(samples, sampling)
    forwards = 0

    def hold(module, args, output):
        nonlocal forwards
        forwards += 1
        if forwards == 2:  # the prefill and one decode step: every row has sampled tokens
            engine.paused.wait(HOLD_LIMIT_S)

    handle = engine.model.register_forward_hook(hold)
    try:
        return engine.generate_default(samples, sampling)
    finally:
        handle.remove()
