"""One micro-batch of the trainer: a padded rectangle of sequences on the device, built once per rollout.

Everything the loss needs is aligned to targets ([B, T-1]); the counts the training loop needs on
the host are taken while building, from host tensors, so the loop never waits for the device.
``mask`` holds the trained positions: the response tokens the policy generated (a multi-turn
sample's ``loss_mask``; tokens supplied by an environment are out of it, and have no engine log-prob).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tidal.dtypes import dtype_of
from tidal.rollout.types import Sample

# On CUDA every micro-batch's width (tokens a row) is a multiple of this. Compiled layers (``--compile-layers``)
# take their sizes as symbols, but inductor's lowering of the CUDA flash and memory-efficient attention kernels
# guards on the row stride being a multiple of 8 (``sdpa_constraint``): a graph compiled at aligned widths (the
# warm-up's) did not serve a width such as 4 + 256 = 260, and a rollout's first unaligned micro-batches compiled
# the layers twice more (8.3 s of step 0's train on an H100 after the warm-up, 0.5B preset). Rounding up costs at
# most 7 pad columns a row (masked out everywhere) and keeps one family of graphs for every run.
WIDTH_MULTIPLE = 8


def width_multiple(device: torch.device) -> int:
    """What a micro-batch's width is rounded up to on ``device``: ``WIDTH_MULTIPLE`` on CUDA; 1 elsewhere (CPU
    kernels have no such guard, and the short rows of CPU runs would pay for the pads)."""
    return WIDTH_MULTIPLE if device.type == "cuda" else 1


class MicroBatch:
    """One padded rectangle of sequences on the device, with everything the loss needs ([B, T-1] aligned to targets).

    Built once per rollout on the host and sent in one copy (asynchronous on CUDA, ``HostStaging``),
    so the training loop never waits for one. Counts the loop needs on the host (response tokens,
    engine log-probs, the loss normaliser via ``host_mask``) are taken here, from host tensors.
    Rows are right-padded: a real token never attends to a pad under causal attention, so the model
    runs without an attention mask (see ``tidal.trainer.step.token_stats``).
    """

    def __init__(
        self,
        samples: list[Sample],
        idx: list[int],
        pad_id: int,
        device: torch.device,
        multiple: int | None = None,
        stage: StagingSlot | None = None,
    ):
        """``multiple``: the width is rounded up to it (default ``width_multiple(device)``); ``stage``: the
        page-locked slot its arrays cross in on CUDA (``HostStaging``; default a new one)."""
        self.indices = idx
        rows = [samples[i] for i in idx]
        self.empty = not rows
        longs, flags, floats = _host_arrays(rows, pad_id, width_multiple(device) if multiple is None else multiple)
        b, width = longs.shape[1:]
        t = width - 1
        # The trained positions (the response mask) in the flattened [B, W] grid of the model's outputs:
        # the LM head runs only there with --trained-logits-only (tidal.trainer.step.token_stats).
        grid = np.zeros((b, width), dtype=bool)
        grid[:, :t] = flags[0]
        positions = np.flatnonzero(grid)
        self.tokens = 0 if self.empty else int(longs[2].sum())  # real (unpadded) tokens, prompt + response
        self.num_response_tokens = int(flags[0].sum())
        self.num_engine_logprobs = int(flags[1].sum())
        self.host_mask = torch.from_numpy(flags[0])
        if device.type == "cuda":  # one asynchronous copy from page-locked memory (a slot of its own if not given)
            longs, flags, floats, positions = (stage or StagingSlot()).send((longs, flags, floats, positions), device)
        else:
            longs, flags, floats, positions = (
                torch.from_numpy(a).to(device) for a in (longs, flags, floats, positions)
            )
        self.trained_positions = positions
        self.input_ids, self.next_ids, self.attention_mask = longs[0], longs[1], longs[2]
        self.targets = self.input_ids[:, 1:]
        self.mask, self.has_engine_logprobs = flags[0], flags[1]
        self.engine_logprobs, self.advantages, self.rewards = floats[:, :t], floats[:, t : 2 * t], floats[:, -1]
        self.old_logprobs: torch.Tensor | None = None
        self.ref_logprobs: torch.Tensor | None = None
        self.correction = None  # tidal.algos.correction.Correction when --use-tis
        self.old_values: torch.Tensor | None = None  # PPO: the critic's values before the update, and GAE returns
        self.returns: torch.Tensor | None = None


class MicroBatches(Sequence):
    """One optimizer step's micro-batches on this rank (``batches``: sample indices of each), each built on
    first use and kept.

    The training loop launches a micro-batch's forward and backward and does not wait for them, so
    building the next one on the host (~10 ms for 32k tokens) overlaps the device's work on this one
    instead of delaying the first kernel by the whole step's building. ``normalizer`` gives the step's
    loss normaliser from the samples, without building anything.
    """

    def __init__(
        self,
        samples: list[Sample],
        batches: list[list[int]],
        pad_id: int,
        device: torch.device,
        staging: HostStaging | None = None,
        first_slot: int = 0,
    ):
        """``staging``: the trainer's page-locked slots (CUDA); micro-batch ``i`` crosses in slot ``first_slot + i``
        (a rollout's optimizer steps take slots after each other's)."""
        self.samples, self.batches, self.pad_id, self.device = samples, batches, pad_id, device
        self.staging, self.first_slot = staging, first_slot
        self._built: dict[int, MicroBatch] = {}

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]
        if i not in self._built:
            slot = self.staging.slot(self.first_slot + i) if self.staging is not None else None
            self._built[i] = MicroBatch(self.samples, self.batches[i], self.pad_id, self.device, stage=slot)
        return self._built[i]

    def normalizer(self, agg: str) -> float:
        """``tidal.algos.losses.loss_normalizer`` of every micro-batch's response mask, summed: the trained
        (policy) tokens for token-mean, the rows with at least one for seq-mean-token-mean."""
        from tidal.algos.losses import AGG_MODES

        if agg not in AGG_MODES:
            raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {AGG_MODES}")
        counts = [_policy_tokens(self.samples[i]) for mb in self.batches for i in mb]
        return float(sum(counts) if agg == "token-mean" else sum(c > 0 for c in counts))


class StagingSlot:
    """One reused page-locked buffer a micro-batch's host arrays cross to the device in, as one copy.

    A fresh ``pin_memory()`` of each array cost 4-14 ms of host time on an H100 host (45 ms before the first
    kernel of the 0.5B preset's train phase) for ~1 MB, and a copy from pageable memory would make the host
    wait for the device's queue. Here the arrays are packed with numpy into a buffer kept across steps and sent
    with one asynchronous copy; the slot waits for its last copy (long finished: a step ago) before refilling.
    """

    ALIGN = 64

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.sent = None  # the CUDA event after the last copy out of ``host``

    def send(self, arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
        """Copy ``arrays`` into the buffer, then to ``device`` in one asynchronous copy; the device tensors.
        (On a CPU device, a copy of the buffer: nothing of it aliases the slot.)"""
        cuda = device.type == "cuda"
        offsets, size = [], 0
        for a in arrays:
            offsets.append(size)
            size += -(-a.nbytes // self.ALIGN) * self.ALIGN
        if self.sent is not None and not self.sent.query():
            self.sent.synchronize()
        if self.host is None or self.host.numel() < size:
            grown = torch.empty(max(size, 2 * (0 if self.host is None else self.host.numel())), dtype=torch.uint8)
            self.host = grown.pin_memory() if cuda else grown
        flat = self.host.numpy()
        for a, off in zip(arrays, offsets):
            flat[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        out = self.host[:size].to(device, non_blocking=True) if cuda else self.host[:size].clone()
        if cuda:
            self.sent = torch.cuda.Event()
            self.sent.record()
        return [out[o : o + a.nbytes].view(dtype_of(a.dtype.name)).view(a.shape) for a, o in zip(arrays, offsets)]


class HostStaging:
    """The trainer's staging slots (CUDA), one per micro-batch of a step, kept for the whole run."""

    def __init__(self) -> None:
        self.slots: list[StagingSlot] = []

    def slot(self, i: int) -> StagingSlot:
        while len(self.slots) <= i:
            self.slots.append(StagingSlot())
        return self.slots[i]


def _policy_tokens(s: Sample) -> int:
    """How many of a sample's response tokens are trained (its loss mask's ones; all when it has none)."""
    return sum(1 for m in s.loss_mask if m) if s.loss_mask else len(s.response_ids)


def _host_arrays(rows: list[Sample], pad_id: int, multiple: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The micro-batch's three host arrays, filled a whole micro-batch at a time (numpy):

    - ``longs`` [3, B, W]: input ids, next ids (the target of every position; pad after the last),
      attention mask (1 on real tokens);
    - ``flags`` [2, B, W-1] bool, per target position: the response mask, the positions with an engine
      log-prob;
    - ``floats`` [B, 2(W-1) + 1] float32: engine log-probs, advantages (per target position), the row's
      reward (0 for an empty response).

    Target position i predicts token i + 1: a row's response tokens p .. p+n-1 are targets p-1 .. p+n-2.
    Only policy tokens are trained: tokens the environment supplied (loss_mask 0) stay out of the
    response mask, so every loss term, estimator and metric that reads ``mask`` skips them, and they
    have no engine log-prob. A boolean index fills a rectangle row by row, so each per-token field is
    one flat array of the rows' values in order (building rows as Python lists cost ~0.2 s of CPU for
    512 rows of 288 tokens). ``W`` is the longest row rounded up to ``multiple``. No rows: one zero-weight
    filler row of pads (two, rounded up), which runs forward/backward so that this rank joins every FSDP
    collective.
    """
    if not rows:
        w = -(-2 // multiple) * multiple
        longs = np.full((3, 1, w), pad_id, dtype=np.int64)
        longs[2] = 1
        return longs, np.zeros((2, 1, w - 1), dtype=bool), np.zeros((1, 2 * w - 1), dtype=np.float32)
    p = np.array([len(s.prompt_ids) for s in rows], dtype=np.int64)
    n = np.array([len(s.response_ids) for s in rows], dtype=np.int64)
    b, width = len(rows), -(-int((p + n).max()) // multiple) * multiple
    t = width - 1
    ids: list[int] = []
    for s in rows:
        ids += s.prompt_ids
        ids += s.response_ids
    longs = np.full((3, b, width), pad_id, dtype=np.int64)
    real = np.arange(width) < (p + n)[:, None]
    longs[0][real] = ids
    longs[1, :, :-1] = longs[0, :, 1:]
    longs[2] = real
    # Response target positions p-1 .. p+n-2 of each row (none for an empty response).
    cols = np.arange(t)
    resp = (cols >= p[:, None] - 1) & (cols < (p + n - 1)[:, None]) & (n[:, None] > 0)
    policy: list[int] = []
    adv: list[float] = []
    lp: list[float] = []
    has_lp: list[int] = []
    for s in rows:
        k = len(s.response_ids)
        mask = s.loss_mask if s.loss_mask else [1] * k
        policy += mask
        adv += s.token_advantages if len(s.token_advantages) == k else [float(s.advantage)] * k
        full = len(s.response_logprobs) == k
        lp += s.response_logprobs if full else [0.0] * k
        has_lp += mask if full else [0] * k
    flags = np.zeros((2, b, t), dtype=bool)
    flags[0][resp] = np.array(policy, dtype=bool)
    flags[1][resp] = np.array(has_lp, dtype=bool)
    floats = np.zeros((b, 2 * t + 1), dtype=np.float32)
    floats[:, :t][resp] = lp
    floats[:, t : 2 * t][resp] = adv
    floats[:, -1] = [float(s.reward) if len(s.response_ids) else 0.0 for s in rows]
    return longs, flags, floats
