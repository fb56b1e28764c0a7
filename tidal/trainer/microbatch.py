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
        # [0] response mask, [1] positions with an engine log-prob
        flags = torch.zeros((2, b, width - 1), dtype=torch.bool)
        engine_lp = torch.zeros((b, width - 1), dtype=torch.float32)
        adv = torch.zeros((b, width - 1), dtype=torch.float32)  # per target position (per-token estimators)
        rewards = torch.zeros(b, dtype=torch.float32)
        for r, s in enumerate(rows):
            p, n = len(s.prompt_ids), len(s.response_ids)
            if n == 0:
                continue
            # Target position t predicts token t + 1: response tokens p .. p+n-1 are targets p-1 .. p+n-2.
            # Only policy tokens are trained: tokens the environment supplied (loss_mask 0) stay out of the
            # response mask, so every loss term, estimator and metric that reads ``mask`` skips them.
            if s.loss_mask:
                flags[0, r, p - 1 : p - 1 + n] = torch.tensor(s.loss_mask, dtype=torch.bool)
            else:
                flags[0, r, p - 1 : p - 1 + n] = True
            if len(s.token_advantages) == n:
                adv[r, p - 1 : p - 1 + n] = torch.tensor(s.token_advantages, dtype=torch.float32)
            else:
                adv[r, p - 1 : p - 1 + n] = float(s.advantage)
            rewards[r] = float(s.reward)
            if len(s.response_logprobs) == n:
                engine_lp[r, p - 1 : p - 1 + n] = torch.tensor(s.response_logprobs, dtype=torch.float32)
                flags[1, r, p - 1 : p - 1 + n] = flags[0, r, p - 1 : p - 1 + n]  # environment tokens have none
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
