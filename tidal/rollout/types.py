"""Data that flows between the driver, the rollout engines and the trainer.

A ``Sample`` is one response to one prompt. Samples of the same prompt share a ``group`` id (the
GRPO group). The engine fills the response fields; the reward step fills ``reward``; the trainer
reads ``prompt_ids + response_ids``, ``response_logprobs`` (the engine's, used as old log-probs
when the trainer does not recompute them), ``advantage`` (or ``token_advantages``) and, for PPO's
critic, ``reward``.

A multi-turn sample (``tidal.rollout.agent``) is a trajectory: its response is every token after
the prompt, in order, policy turns and environment turns alike, with the token ids exactly as the
engine generated them and the environment's observation ids exactly as tokenised once (never the
concatenated text re-tokenised). ``loss_mask`` marks which response tokens the policy generated (1:
trained, with its engine log-prob) and which the environment or user supplied (0: no loss, no KL,
entropy or mismatch figure, its ``response_logprobs`` entry a 0.0 placeholder); ``turns`` names the
spans. A single-turn sample leaves both empty: every response token is the policy's.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
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
class DecodeStats:
    """Where an engine's generate calls spent their time since it was last asked (``take_decode_stats``).

    Filled by the fast decode path (``tidal.rollout.fast``): ``calls`` generate calls, ``waves`` batches of at
    most the decoder's rows each decoded from prefill to end (one a call unless the call held more rows than
    the KV cache), ``steps`` decode steps, seconds of prefill, of decode steps and of graph captures
    (compiling in the captures' warm-up runs included; part of ``decode_s``), of whole decoder calls
    (``call_s``: prefill, decode steps, and the results brought to the host and cut at their stops; a
    rollout's ``generate_s`` beyond it is the engine's own handling of the samples, Ray and the driver),
    ``graph_captures`` new CUDA graphs and ``compactions`` of the running batch. ``engine_s``: seconds of the
    engine's whole built-in generate calls (the decoder's calls and the samples' handling around them: what a
    rollout's ``generate_s`` holds beyond it is Ray's transport and the driver's work). All zero where
    generation runs elsewhere (transformers generate, an HTTP server)."""

    calls: int = 0
    waves: int = 0
    steps: int = 0
    prefill_s: float = 0.0
    call_s: float = 0.0
    decode_s: float = 0.0
    capture_s: float = 0.0
    graph_captures: int = 0
    compactions: int = 0
    engine_s: float = 0.0

    def add(self, stats: dict) -> None:
        """Count one generate call of the fast decoder, from its ``DecodeResult.stats``."""
        self.calls += 1
        self.waves += int(stats.get("waves", 0))
        self.steps += int(stats.get("steps", 0))
        self.prefill_s += float(stats.get("prefill_s", 0.0))
        self.call_s += float(stats.get("seconds", 0.0))
        self.decode_s += float(stats.get("decode_s", 0.0))
        self.capture_s += float(stats.get("capture_s", 0.0))
        self.graph_captures += int(stats.get("graph_captures", 0))
        self.compactions += int(stats.get("compactions", 0))

    @staticmethod
    def metrics(engines: Sequence[DecodeStats]) -> dict[str, float]:
        """A rollout's ``decode/*`` metrics over every engine: counts summed, seconds the slowest engine's
        (the engines run side by side). Empty where no engine decoded through the fast path."""
        if not any(e.calls for e in engines):
            return {}
        out: dict[str, float] = {}
        for name in ("waves", "steps", "graph_captures", "compactions"):
            out[f"decode/{name}"] = sum(getattr(e, name) for e in engines)
        for name in ("prefill_s", "decode_s", "capture_s", "call_s", "engine_s"):
            out[f"decode/{name}"] = max(getattr(e, name) for e in engines)
        return out


@dataclass
class WarmUpReport:
    """What an actor compiled and captured before the run's first rollout (``--warm-up``), and how long it took.

    ``warmed`` names what ran (empty: nothing to warm on this actor); ``compile_s`` of ``seconds`` were spent in
    ``torch.compile``, ``backend_s`` of those in its backend (``tidal.compile_cache.compile_seconds``); an
    engine also says at how many rows (``rows``) and how many decode graphs it captured (``graph_captures``,
    ``capture_s``, compiling in the capture's warm-up runs included)."""

    seconds: float = 0.0
    warmed: list[str] = field(default_factory=list)
    compile_s: float = 0.0
    backend_s: float = 0.0
    rows: int = 0
    graph_captures: int = 0
    capture_s: float = 0.0

    @staticmethod
    def start() -> tuple[float, float, float]:
        """The clocks a warm-up starts from: wall time and ``compile_seconds``'s two counters."""
        from tidal.compile_cache import compile_seconds

        return (time.perf_counter(), *compile_seconds())

    @classmethod
    def since(cls, start: tuple[float, float, float], **fields: Any) -> WarmUpReport:
        """The report of a warm-up that began at ``start`` (``WarmUpReport.start()``), with ``fields``."""
        from tidal.compile_cache import compile_seconds

        compiled, backend = compile_seconds()
        return cls(
            seconds=time.perf_counter() - start[0],
            compile_s=compiled - start[1],
            backend_s=backend - start[2],
            **fields,
        )


@dataclass
class Turn:
    """One span of a trajectory's response: ``response_ids[start:end]`` came from ``role``."""

    role: str  # "assistant" (the policy: trained) | "tool" / "user" / "env" (supplied: not trained)
    start: int
    end: int


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
    status: str = "pending"  # pending | completed | truncated | aborted (cut short by a pause; continued later)
    reward: float = 0.0
    advantage: float = 0.0
    # One advantage per response token when the estimator gives them (REINFORCE++); empty: ``advantage``
    # for every token.
    token_advantages: list[float] = field(default_factory=list)
    weight_version: int = -1  # engine weight version that generated it (its first token's, when several did)
    # Per response token: the weight version that sampled it, when a response was continued on newer weights
    # (--partial-rollout). Empty: every token is ``weight_version``'s.
    response_versions: list[int] = field(default_factory=list)
    # Per response token: 1 generated by the policy (trained), 0 supplied by the environment (not
    # trained). Empty: every response token is the policy's (single-turn).
    loss_mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)  # the trajectory's spans; empty for single-turn
    metadata: dict = field(default_factory=dict)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def token_versions(self) -> list[int]:
        """One weight version per response token (``response_versions`` with its default filled in)."""
        return (
            list(self.response_versions) if self.response_versions else [self.weight_version] * len(self.response_ids)
        )

    @property
    def policy_mask(self) -> list[int]:
        """The loss mask with the single-turn default filled in: one 0/1 per response token."""
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.response_ids)

    @property
    def num_policy_tokens(self) -> int:
        return sum(1 for m in self.loss_mask if m) if self.loss_mask else len(self.response_ids)


class SampleBatch(list):
    """Samples crossing a process boundary (driver -> engine -> driver -> trainer) as one object.

    Ray's serializer packs a plain list element by element (a msgpack extension per sample) and
    pickle writes every sample's field names; this list pickles whole, as one list of field-value rows
    (256 samples: ~0.8 -> ~0.4 ms to write, ~1.4 -> ~1.0 ms to read, and no per-sample extensions).
    It is a ``list`` in every other way; a batch holding anything but plain ``Sample``s (a subclass, an attribute
    set on one) pickles item by item.
    """

    def __reduce__(self):
        width = len(_FIELDS)
        if all(type(x) is Sample and len(x.__dict__) == width for x in self):  # no attribute of its own
            return _batch_from_rows, (list(map(_ROW, self)),)
        return SampleBatch, (list(self),)


_FIELDS = tuple(Sample.__dataclass_fields__)
_ROW = operator.attrgetter(*_FIELDS)


def _batch_from_rows(rows: list[tuple]) -> SampleBatch:
    new = object.__new__
    out = SampleBatch()
    for row in rows:
        x = new(Sample)
        x.__dict__.update(zip(_FIELDS, row))
        out.append(x)
    return out
