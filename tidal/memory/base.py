"""The memory-backend interface: pause and resume device memory by state class.

Trainer and engine memory is grouped into *state classes*; each class has one policy that says
whether its contents survive a pause (backed up to host) or are discarded (recomputed or rewritten
before next use):

    trainer   weights      backed up (unless another host copy exists)
              optimizer    backed up
              grads        discarded: zeroed at the start of every step anyway (slime PR #1924)
              activations  discarded: freed before pausing, never backed up
    engine    weights      discarded: the next weight sync rewrites them
              kv_cache     discarded: the cache is flushed first

A backend is used in two ways, and every backend implements both so that callers need not know
which one is active:

- ``region(state_class)``: a context manager around *allocation* of that class's tensors
  (torch_memory_saver must see the allocation happen; the portable backend ignores it);
- ``register(state_class, tensors)``: tells the backend which live tensors belong to a class
  (a callable, evaluated at pause time, so lazily created optimizer state is included).

``pause(classes)`` / ``resume(classes)`` return a ``MemoryReport`` with per-class figures. While
a backed-up class is paused, ``host_view(tensor)`` returns a CPU tensor aliasing its backup
(zero copy), valid only until that class is resumed.

A resume can *defer* a class's contents (``resume(classes, defer=[...])``, where ``defers(c)``): its
memory is back when the call returns, its bytes arrive later (on CUDA, on a copy stream beside the
caller's work), and ``settle(classes)`` orders the caller's stream after them. The trainer defers its
optimizer state, which nothing reads before the optimizer step, so the copy runs under the forward and
backward instead of before them. Until settled, the tensors of a deferred class must not be read or
written. A pause can defer too (``pause(classes, defer=[...])``): the copy to the host starts after the
caller's work and the memory is released by ``settle`` (the host waits for the copy there), so that
the copy runs beside what the caller does in between. Every pause and resume settles its classes first.

``HostBackedBackend`` is what the two real backends (``portable``, ``tms``) share: the device, the
host-memory policy of backed-up classes (``release``, ``retain``, ``disk``), a label naming the owner
in messages, and the registered sources.
"""

from __future__ import annotations

import abc
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch
from typing_extensions import TypedDict, Unpack

from tidal.errors import ConfigError, ResidencyError
from tidal.memory.telemetry import device_used_bytes, host_rss_bytes


class StateClass(str, Enum):
    WEIGHTS = "weights"
    OPTIMIZER = "optimizer"
    GRADS = "grads"
    ACTIVATIONS = "activations"
    KV_CACHE = "kv_cache"


@dataclass(frozen=True)
class ClassPolicy:
    """Whether a paused class keeps its contents (host backup) or loses them."""

    backup: bool


def trainer_policy(*, grads_backup: bool = False, weights_backup: bool = True) -> dict[StateClass, ClassPolicy]:
    """Per-class policy of a trainer. ``--offload-train`` means grads are never backed up."""
    return {
        StateClass.WEIGHTS: ClassPolicy(backup=weights_backup),
        StateClass.OPTIMIZER: ClassPolicy(backup=True),
        StateClass.GRADS: ClassPolicy(backup=grads_backup),
        StateClass.ACTIVATIONS: ClassPolicy(backup=False),
    }


def engine_policy() -> dict[StateClass, ClassPolicy]:
    """Per-class policy of a rollout engine: everything is discarded and rewritten."""
    return {
        StateClass.WEIGHTS: ClassPolicy(backup=False),
        StateClass.KV_CACHE: ClassPolicy(backup=False),
    }


@dataclass
class ClassReport:
    """What one pause or resume did to one state class."""

    state_class: str
    bytes: int = 0  # device bytes released (pause) or re-materialised (resume)
    backup_bytes: int = 0  # bytes copied to (pause) or from (resume) the host backup
    seconds: float = 0.0
    deferred: bool = False  # the copy was left running, its end (and a pause's release) left to ``settle``

    @property
    def gbps(self) -> float:
        return self.backup_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class MemoryFigures:
    """Process memory right after a pause, resume or release: what the memory timeline records."""

    host_rss: int = 0  # bytes
    device_used: int = 0  # bytes in use on the device, all processes (host RSS for a CPU device)


@dataclass
class MemoryResult:
    """What a trainer's pause or resume returns: step metrics (``memory/trainer_pause/...``) and the
    process memory after it (None where nothing was paused, and on ranks other than 0)."""

    metrics: dict[str, float | int] = field(default_factory=dict)
    after: MemoryFigures | None = None


@dataclass
class MemoryReport:
    """One pause or resume: per-class figures plus process memory before and after."""

    op: str  # "pause" or "resume"
    backend: str
    classes: list[ClassReport] = field(default_factory=list)
    seconds: float = 0.0
    host_rss_before: int = 0
    host_rss_after: int = 0
    device_used_before: int = 0
    device_used_after: int = 0

    @property
    def after(self) -> MemoryFigures:
        return MemoryFigures(host_rss=self.host_rss_after, device_used=self.device_used_after)

    def metrics(self, prefix: str) -> dict[str, float]:
        """Flat step metrics, e.g. ``memory/trainer_pause/optimizer/bytes``."""
        out: dict[str, float] = {
            f"{prefix}/seconds": self.seconds,
            f"{prefix}/host_rss_before": self.host_rss_before,
            f"{prefix}/host_rss_after": self.host_rss_after,
            f"{prefix}/device_used_before": self.device_used_before,
            f"{prefix}/device_used_after": self.device_used_after,
        }
        for c in self.classes:
            out[f"{prefix}/{c.state_class}/bytes"] = c.bytes
            out[f"{prefix}/{c.state_class}/backup_bytes"] = c.backup_bytes
            out[f"{prefix}/{c.state_class}/seconds"] = c.seconds
            out[f"{prefix}/{c.state_class}/gbps"] = c.gbps
            if c.deferred:
                out[f"{prefix}/{c.state_class}/deferred"] = 1
        return out

    def then(self, later: MemoryReport) -> MemoryReport:
        """This report followed by ``later`` (one pause made in two stages): every class of both, the seconds
        summed, memory before this one and after ``later``."""
        return MemoryReport(
            op=self.op,
            backend=self.backend,
            classes=[*self.classes, *later.classes],
            seconds=self.seconds + later.seconds,
            host_rss_before=self.host_rss_before,
            host_rss_after=later.host_rss_after,
            device_used_before=self.device_used_before,
            device_used_after=later.device_used_after,
        )


TensorSource = Callable[[], Iterable[torch.Tensor]]


class MemoryBackend(abc.ABC):
    """Pauses and resumes registered device memory, one state class at a time."""

    name: str = "abstract"

    def __init__(self, policy: dict[StateClass, ClassPolicy]):
        self.policy = dict(policy)

    @contextlib.contextmanager
    def region(self, state_class: StateClass) -> Iterator[None]:
        """Allocations inside belong to ``state_class``. Default: nothing to hook."""
        yield

    @contextlib.contextmanager
    def unmanaged(self) -> Iterator[None]:
        """Allocations inside are ordinary, freed at once (weight-sync temporaries). Default: nothing to do."""
        yield

    def close(self) -> None:  # noqa: B027 - optional hook
        """Drop retained host buffers and spill files."""

    @abc.abstractmethod
    def register(self, state_class: StateClass, tensors: TensorSource) -> None:
        """Declare the live tensors of a class; ``tensors`` is called at every pause."""

    @abc.abstractmethod
    def pause(self, classes: Sequence[StateClass], *, defer: Sequence[StateClass] = ()) -> MemoryReport:
        """Release device memory of these classes, backing up those whose policy says so. Those also in ``defer``
        that ``defers`` allows are copied out beside the caller's next work and released by ``settle``."""

    @abc.abstractmethod
    def resume(self, classes: Sequence[StateClass], *, defer: Sequence[StateClass] = ()) -> MemoryReport:
        """Re-materialise these classes; backed-up ones get their contents back bit for bit. Those also in
        ``defer`` that ``defers`` allows get them only once ``settle``d (the others before the call returns)."""

    def defers(self, state_class: StateClass) -> bool:
        """Whether a pause or resume can leave this class's copy running (``defer=...``). Default: never."""
        return False

    def settle(self, classes: Sequence[StateClass] | None = None) -> None:  # noqa: B027 - nothing deferred here
        """Finish what a deferred pause or resume of these classes left (every class when None): a resumed class's
        tensors may be used from here on (the caller's stream waits for their copy), a paused class's memory is
        released (the host waits for its copy). A class not deferred needs nothing; calling it again is free."""

    @abc.abstractmethod
    def host_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU tensor aliasing the host backup of a paused, backed-up tensor (no copy)."""

    @abc.abstractmethod
    def is_paused(self, state_class: StateClass) -> bool:
        """Whether this class is paused now."""

    def _check(self, classes: Sequence[StateClass], *, want_paused: bool, op: str) -> list[StateClass]:
        """The classes of a pause (``want_paused=False``) or resume, checked before anything is touched.

        Subclasses keep ``self.label`` and ``self._paused`` (the classes paused now). Unknown classes,
        a class listed twice, a double pause and a resume of an active class are refused here, before
        torch_memory_saver could terminate the process on them.
        """
        out: list[StateClass] = []
        names = ", ".join(c.value for c in self.policy)
        for c in classes:
            c = StateClass(c)
            if c not in self.policy:
                raise ValueError(f"{self.label}: {op} of state class {c.value}, which has no policy ({names})")
            if c in out:
                raise ResidencyError(f"{self.label}: {op} lists {c.value} twice")
            if want_paused and c not in self._paused:
                raise ResidencyError(f"{self.label}: resume of {c.value}, which is active (not paused)")
            if not want_paused and c in self._paused:
                raise ResidencyError(f"{self.label}: pause of {c.value}, which is already paused (double pause)")
            out.append(c)
        return out


HOST_MEMORY_POLICIES = ("release", "retain", "disk")


def check_host_memory(host_memory: str, disk_dir) -> None:
    """The host-memory policy must be known, and ``disk`` needs a directory."""
    if host_memory not in HOST_MEMORY_POLICIES:
        raise ConfigError(
            f"--offload-host-memory {host_memory!r} is not one of {', '.join(HOST_MEMORY_POLICIES)}; pick one"
        )
    if host_memory == "disk" and not disk_dir:
        raise ConfigError("--offload-host-memory disk needs --offload-disk-dir; name a directory on a real disk")


class Backing(TypedDict, total=False):
    """The keyword arguments every ``HostBackedBackend`` takes besides its device."""

    host_memory: str  # release (default) | retain | disk
    disk_dir: str | os.PathLike | None  # where ``disk`` spills
    label: str  # the owner in messages and tags (default "memory")


class HostBackedBackend(MemoryBackend):
    """A backend that frees registered device memory and keeps backed-up classes on the host (or disk).

    Subclasses keep ``self._paused`` (the classes paused now, each with what its resume needs)."""

    def __init__(
        self, policy: dict[StateClass, ClassPolicy], *, device: str | torch.device, **backing: Unpack[Backing]
    ):
        super().__init__(policy)
        self.host_memory = backing.get("host_memory", "release")
        self.disk_dir = backing.get("disk_dir")
        self.label = backing.get("label", "memory")
        check_host_memory(self.host_memory, self.disk_dir)
        self.device = torch.device(device)
        self._sources: dict[StateClass, list[TensorSource]] = {}
        # Classes paused or resumed with their copy still running, each with what ``settle`` finishes for it.
        self._deferred: dict[StateClass, Callable[[], None]] = {}

    def settle(self, classes: Sequence[StateClass] | None = None) -> None:
        for c in list(self._deferred) if classes is None else [StateClass(c) for c in classes]:
            finish = self._deferred.pop(c, None)
            if finish is not None:
                finish()

    def _wait_on(self, event: torch.cuda.Event) -> Callable[[], None]:
        """A ``settle`` step for a copy that records ``event``: the caller's current stream waits for it (on the
        device: the host goes on)."""
        return lambda: torch.cuda.current_stream(self.device).wait_event(event)

    def _pin_cuda_index(self) -> None:
        """A CUDA device without an index is the current one: name it (pools and reports need the index)."""
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _names(self) -> str:
        return ", ".join(c.value for c in self.policy)

    def register(self, state_class: StateClass, tensors: TensorSource) -> None:
        state_class = StateClass(state_class)
        if state_class not in self.policy:
            raise ValueError(f"{self.label}: state class {state_class.value} has no policy here ({self._names()})")
        if not callable(tensors):
            raise TypeError("register() takes a callable returning the tensors (evaluated at every pause)")
        self._sources.setdefault(state_class, []).append(tensors)

    def is_paused(self, state_class: StateClass) -> bool:
        return StateClass(state_class) in self._paused

    def _check_room(self, classes: Sequence[StateClass], needed: int, free: int) -> None:
        """Refuse a resume that needs more device memory than is free, before anything is touched."""
        if needed > free:
            raise ResidencyError(
                f"{self.label}: resume of {', '.join(c.value for c in classes)} needs {needed / 2**30:.2f} GiB but "
                f"{free / 2**30:.2f} GiB is free on {self.device}; release the other tenant (engines) first"
            )

    def _measure_before(self, report: MemoryReport) -> float:
        """Host RSS and device use before the work of ``report``; returns its start time."""
        report.host_rss_before, report.device_used_before = host_rss_bytes(), device_used_bytes(self.device)
        return time.perf_counter()

    def _measure_after(self, report: MemoryReport, t0: float) -> MemoryReport:
        """``report`` with its duration since ``t0`` and host RSS and device use after the work."""
        report.seconds = time.perf_counter() - t0
        report.host_rss_after, report.device_used_after = host_rss_bytes(), device_used_bytes(self.device)
        return report
