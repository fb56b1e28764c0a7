"""What asynchronous training keeps between generation and training: prompt serials and the staleness buffer.

``PromptCursor`` hands out prompts with a *serial*: the prompt's place in the dataset's endless,
deterministic order (epoch x prompts + position), which is also the GRPO group id of its samples.
A prompt is *done* once its group is trained or dropped (stale, or zero-advantage under dynamic
sampling); prompts in flight or buffered are not. ``state_dict()`` is the data position a
checkpoint records: the first serial not done (the dataset seeks there on resume) plus the done
serials after it (groups finish out of order when engines run at different speeds), so a resumed
run draws exactly the prompts that were not done: none skipped, none repeated. The synchronous loop
draws through the same cursor (``finish_drawn`` after each rollout), so a checkpoint of either loop
resumes in either loop.

``GroupBuffer`` holds scored groups in arrival order, at most ``capacity`` together with the
groups in flight. ``take(n, version)`` drops every group more than ``max_staleness`` versions
behind the trainer's ``version`` (counted in ``dropped``) and returns the oldest ``n`` of the rest.
A group's version is its oldest sample's ``weight_version`` (the engine weights that produced it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tidal.rollout.types import Sample


@dataclass
class Group:
    """One prompt's samples, scored and given advantages."""

    serial: int
    samples: list[Sample]

    @property
    def version(self) -> int:
        return min(x.weight_version for x in self.samples)


class PromptCursor:
    """Serial numbers for the dataset's prompts, and which of them are done (see the module docstring)."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.size = len(dataset.items)
        self.next_serial = self._serial_of(dataset.state_dict())
        self.low = self.next_serial  # every serial below is done
        self._done: set[int] = set()  # done serials at or above ``low``
        self._skip: set[int] = set()  # done before a resume: not drawn again

    def _serial_of(self, state: dict) -> int:
        return int(state["epoch"]) * self.size + int(state["position"])

    def draw(self, n: int) -> list[tuple[int, tuple]]:
        """The next ``n`` prompts not yet done, each with its serial."""
        out = []
        while len(out) < n:
            item = self.dataset.next_batch(1)[0]
            serial, self.next_serial = self.next_serial, self.next_serial + 1
            if serial in self._skip:
                self._skip.discard(serial)
                continue
            out.append((serial, item))
        return out

    def done(self, serials) -> None:
        for serial in serials:
            if serial < self.low or serial in self._done:
                raise RuntimeError(f"prompt serial {serial} finished twice")
            self._done.add(serial)
        while self.low in self._done:
            self._done.discard(self.low)
            self.low += 1

    def finish_drawn(self) -> None:
        """Every prompt drawn so far is done (the synchronous loop: a rollout's prompts are all trained or
        dropped by the time it ends)."""
        self.done(x for x in range(self.low, self.next_serial) if x not in self._done)

    def state_dict(self) -> dict:
        """The dataset's state at the first serial not done, and the done serials after it."""
        state = dict(self.dataset.state_dict())
        state.update(epoch=self.low // self.size, position=self.low % self.size)
        return {"data": state, "done_after": sorted(self._done)}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state["data"])
        self.next_serial = self.low = self._serial_of(state["data"])
        self._skip = set(int(x) for x in state.get("done_after", []))
        self._done = set(self._skip)


class GroupBuffer:
    """Finished groups waiting for the trainer, bounded together with those in flight."""

    def __init__(self, capacity: int, max_staleness: int | None):
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.groups: deque[Group] = deque()
        self.dropped = 0  # groups dropped as too stale, over the run

    def __len__(self) -> int:
        return len(self.groups)

    def room(self, in_flight: int) -> int:
        """Groups that may still be started."""
        return max(0, self.capacity - len(self.groups) - in_flight)

    def put(self, groups) -> None:
        self.groups.extend(groups)

    def drop_stale(self, version: int) -> list[Group]:
        """Remove the groups more than ``max_staleness`` versions behind ``version``; returns them."""
        if self.max_staleness is None:
            return []
        stale = [g for g in self.groups if version - g.version > self.max_staleness]
        if stale:
            self.groups = deque(g for g in self.groups if version - g.version <= self.max_staleness)
            self.dropped += len(stale)
        return stale

    def take(self, n: int) -> list[Group]:
        """The ``n`` groups of the oldest weights (lowest version; by arrival among equals), so the groups
        nearest the staleness bound train first, continued partial ones among them (call ``drop_stale``
        first)."""
        if len(self.groups) < n:
            raise RuntimeError(f"take({n}) from a buffer of {len(self.groups)} groups")
        groups = list(self.groups)
        chosen = sorted(range(len(groups)), key=lambda i: groups[i].version)[:n]  # stable: arrival among equals
        taken = set(chosen)
        self.groups = deque(g for i, g in enumerate(groups) if i not in taken)
        return [groups[i] for i in chosen]
