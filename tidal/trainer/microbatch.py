"""One micro-batch of the trainer: a padded rectangle of sequences on the device, built once per rollout.

Everything the loss needs is aligned to targets ([B, T-1]); the counts the training loop needs on
the host are taken while building, from host tensors, so the loop never waits for the device.
``mask`` holds the trained positions: the response tokens the policy generated (a multi-turn
sample's ``loss_mask``; tokens supplied by an environment are out of it, and have no engine log-prob).
"""

from __future__ import annotations

import torch

from tidal.rollout.types import Sample


class MicroBatch:
    """One padded rectangle of sequences on the device, with everything the loss needs ([B, T-1] aligned to targets).

    Built once per rollout on the host and sent with a few copies (pinned and asynchronous on CUDA),
    so the training loop never waits for one. Counts the loop needs on the host (response tokens,
    engine log-probs, the loss normaliser via ``host_mask``) are taken here, from host tensors.
    Rows are right-padded: a real token never attends to a pad under causal attention, so the model
    runs without an attention mask (see ``tidal.trainer.step.token_stats``).
    """

    def __init__(self, samples: list[Sample], idx: list[int], pad_id: int, device: torch.device):
        self.indices = idx
        rows = [samples[i] for i in idx]
        self.empty = not rows
        if self.empty:
            # Zero-weight filler: runs forward/backward so this rank joins every FSDP collective.
            rows_ids = [[pad_id, pad_id]]
        else:
            rows_ids = [list(s.prompt_ids) + list(s.response_ids) for s in rows]
        width = max(len(r) for r in rows_ids)
        b = len(rows_ids)
        # [0] input ids, [1] next ids (the target of every position; pad after the last), [2] attention mask
        longs = torch.full((3, b, width), pad_id, dtype=torch.long)
        longs[0] = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows_ids], dtype=torch.long)
        longs[1, :, :-1] = longs[0, :, 1:]
        lens = torch.tensor([len(r) for r in rows_ids])
        longs[2] = torch.arange(width) < lens.unsqueeze(1)
        # [0] response mask, [1] positions with an engine log-prob; per target position: engine log-probs and
        # advantages (per-token estimators); the rows' rewards. Built as lists, one tensor each (a row at a time
        # in torch costs ~10 ms a step for the default run's 256 rows).
        if self.empty:
            flags = torch.zeros((2, b, width - 1), dtype=torch.bool)
            engine_lp, adv = torch.zeros((b, width - 1)), torch.zeros((b, width - 1))
            rewards = torch.zeros(b, dtype=torch.float32)
        else:
            cols = [_target_row(s, width - 1) for s in rows]
            flags = torch.tensor([[c[0] for c in cols], [c[1] for c in cols]], dtype=torch.bool)
            engine_lp = torch.tensor([c[2] for c in cols], dtype=torch.float32)
            adv = torch.tensor([c[3] for c in cols], dtype=torch.float32)
            rewards = torch.tensor([c[4] for c in cols], dtype=torch.float32)
        self.tokens = int(lens.sum()) if not self.empty else 0  # real (unpadded) tokens, prompt + response
        self.host_mask = flags[0]
        self.num_response_tokens = int(flags[0].sum())
        self.num_engine_logprobs = int(flags[1].sum())

        pin = device.type == "cuda"
        longs, flags, floats = (
            t.pin_memory() if pin else t for t in (longs, flags, torch.cat([engine_lp, adv, rewards.unsqueeze(1)], 1))
        )
        longs, flags, floats = (t.to(device, non_blocking=pin) for t in (longs, flags, floats))
        self.input_ids, self.next_ids, self.attention_mask = longs[0], longs[1], longs[2]
        self.targets = self.input_ids[:, 1:]
        self.mask, self.has_engine_logprobs = flags[0], flags[1]
        t = width - 1
        self.engine_logprobs, self.advantages, self.rewards = floats[:, :t], floats[:, t : 2 * t], floats[:, -1]
        self.old_logprobs: torch.Tensor | None = None
        self.ref_logprobs: torch.Tensor | None = None
        self.correction = None  # tidal.algos.correction.Correction when --use-tis
        self.old_values: torch.Tensor | None = None  # PPO: the critic's values before the update, and GAE returns
        self.returns: torch.Tensor | None = None


def _target_row(s: Sample, t: int) -> tuple[list[bool], list[bool], list[float], list[float], float]:
    """One row over the ``t`` target positions: response mask, engine log-prob positions, engine
    log-probs, advantages, and the row's reward (0 for an empty response).

    Target position i predicts token i + 1: response tokens p .. p+n-1 are targets p-1 .. p+n-2. Only
    policy tokens are trained: tokens the environment supplied (loss_mask 0) stay out of the response
    mask, so every loss term, estimator and metric that reads ``mask`` skips them, and they have no
    engine log-prob."""
    p, n = len(s.prompt_ids), len(s.response_ids)
    if n == 0:
        return [False] * t, [False] * t, [0.0] * t, [0.0] * t, 0.0
    before, after = [False] * (p - 1), [False] * (t - (p - 1 + n))
    policy = [bool(m) for m in s.loss_mask] if s.loss_mask else [True] * n
    mask = before + policy + after
    zeros_before, zeros_after = [0.0] * (p - 1), [0.0] * (t - (p - 1 + n))
    if len(s.token_advantages) == n:
        adv = zeros_before + [float(a) for a in s.token_advantages] + zeros_after
    else:
        adv = zeros_before + [float(s.advantage)] * n + zeros_after
    if len(s.response_logprobs) == n:
        lp, has_lp = zeros_before + [float(x) for x in s.response_logprobs] + zeros_after, mask
    else:
        lp, has_lp = [0.0] * t, [False] * t
    return mask, has_lp, lp, adv, float(s.reward)
