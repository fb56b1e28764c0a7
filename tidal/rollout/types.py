"""Data that flows between the driver, the rollout engines and the trainer.

A ``Sample`` is one response to one prompt. Samples of the same prompt share a ``group`` id (the
GRPO group). The engine fills the response fields; the reward step fills ``reward``; the trainer
reads ``prompt_ids + response_ids``, ``response_logprobs`` (the engine's, used as old log-probs
when the trainer does not recompute them), ``advantage`` (or ``token_advantages``) and, for PPO's
critic, ``reward``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Sample:
    index: int  # position in the rollout batch
    group: int  # prompt id within the rollout; samples of one prompt share it
    prompt: Any  # text or chat messages, as in the dataset
    label: Any = None
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_text: str = ""
    status: str = "pending"  # pending | completed | truncated
    reward: float = 0.0
    advantage: float = 0.0
    # One advantage per response token when the estimator gives them (REINFORCE++); empty: ``advantage``
    # for every token.
    token_advantages: list[float] = field(default_factory=list)
    weight_version: int = -1  # engine weight version that generated it
    metadata: dict = field(default_factory=dict)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)
