"""Generate functions loaded by path in end-to-end tests (through --custom-generate-function-path).

``perturbed`` makes the engine sample from a policy that is not the trainer's, the way a
lower-precision or differently compiled engine does, but larger: it adds noise to the engine's
output layer for the duration of one generate call, so the responses *and* the log-probs the engine
reports come from the perturbed policy. The weights are restored afterwards, so every sync still
lands on (and is checked against) the trainer's weights.
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
