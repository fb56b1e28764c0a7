"""Samples you can read: a few generated responses per step in ``samples.jsonl`` and on the console.

``--log-samples N`` (default 4) writes N samples of every rollout to ``<run dir>/samples.jsonl``, one
JSON object per line, flushed when the step ends::

    {"step": 3, "index": 17, "group": 2, "prompt": "What is 3 + 4? ...", "response": "7", "label": "7",
     "reward": 1.0, "advantage": 0.53, "weight_version": 4, "finish_reason": "stop", "response_length": 2}

The N samples are spread over the rollout's groups (the first sample of every k-th group, then the
second ones), so a step's lines show different prompts rather than N answers to one. ``prompt`` is
the dataset's prompt (text, or chat messages before the template). ``finish_reason``
is ``stop`` (an end token or stop string ended it) or ``length`` (the response budget ran out), as in
OpenAI's and SGLang's APIs. ``--show-samples`` also prints the first chosen sample of each step on the
console, one line, shortened to fit. A multi-turn sample (docs/multi-turn.md) also has ``turns``,
``[role, tokens]`` per span in order (``assistant`` spans are the policy's), and ``policy_tokens``;
its ``response`` is every turn decoded.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tidal.observe.rows import keep_before
from tidal.rollout.types import Sample

FINISH_REASON = {"completed": "stop", "truncated": "length"}


def pick(samples: list[Sample], n: int) -> list[Sample]:
    """Up to ``n`` samples spread over the groups: first samples of evenly spaced groups, then second ones."""
    if n <= 0 or not samples:
        return []
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    order = [groups[g] for g in sorted(groups)]
    stride = max(1, len(order) // n)
    spaced = order[::stride] + [g for i, g in enumerate(order) if i % stride]
    out: list[Sample] = []
    depth = 0
    while len(out) < n and depth < max(len(g) for g in order):
        out += [g[depth] for g in spaced if depth < len(g)][: n - len(out)]
        depth += 1
    return out


def prompt_text(prompt: Any) -> str:
    """A prompt for one console line: a chat is shown as its last message's text."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def sample_record(step: int, s: Sample) -> dict:
    return {
        "step": step,
        "index": s.index,
        "group": s.group,
        "prompt": s.prompt,
        "response": s.response_text,
        "label": s.label,
        "reward": float(s.reward),
        "advantage": float(s.advantage),
        "weight_version": int(s.weight_version),
        "finish_reason": FINISH_REASON.get(s.status, s.status),
        "response_length": len(s.response_ids),
        # --partial-rollout: a response continued on newer weights, as [version, tokens] runs
        **({"response_versions": _runs(s.response_versions)} if s.response_versions else {}),
        # multi-turn: who wrote which span (role, tokens); the policy's tokens are the trained ones
        **(
            {"turns": [[t.role, t.end - t.start] for t in s.turns], "policy_tokens": s.num_policy_tokens}
            if s.turns
            else {}
        ),
    }


def _runs(values: list[int]) -> list[list[int]]:
    """``[3, 3, 4]`` -> ``[[3, 2], [4, 1]]``."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([int(v), 1])
    return out


def sample_line(record: dict, width: int = 160) -> str:
    """One console line for a sample record."""

    def short(v: Any, n: int) -> str:
        text = v if isinstance(v, str) else json.dumps(v)
        text = text.replace("\n", "\\n")
        return text if len(text) <= n else text[: n - 1] + "…"

    room = max(20, (width - 60) // 2)
    return (
        f"  sample {record['step']:>4} | {short(prompt_text(record['prompt']), room)!s} -> {short(record['response'], room)!s}"
        f" | label {short(record['label'], 12)} | reward {record['reward']:.2f} | {record['finish_reason']}"
    )


class SampleLog:
    """Appends picked samples of each step to ``samples.jsonl``; nothing is opened when ``n`` is 0."""

    def __init__(self, run_path: str, n: int):
        self.n = n
        self.path = os.path.join(run_path, "samples.jsonl")
        self._f = open(self.path, "a", encoding="utf-8") if n > 0 else None

    def write(self, step: int, samples: list[Sample]) -> list[dict]:
        records = [sample_record(step, s) for s in pick(samples, self.n)]
        if self._f is not None and records:
            for r in records:
                self._f.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")
            self._f.flush()
        return records

    def resume_at(self, step: int) -> None:
        """Drop the lines of rollouts from ``step`` on (a continued run redoes them; ``RunDir.resume_at``)."""
        if self._f is not None:
            self._f.close()
        keep_before(self.path, step)
        self._f = open(self.path, "a", encoding="utf-8") if self.n > 0 else None

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
