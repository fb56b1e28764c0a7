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
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from tidal.errors import ResidencyError


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
        return out


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
    def pause(self, classes: Sequence[StateClass]) -> MemoryReport:
        """Release device memory of these classes, backing up those whose policy says so."""

    @abc.abstractmethod
    def resume(self, classes: Sequence[StateClass]) -> MemoryReport:
        """Re-materialise these classes; backed-up ones get their contents back bit for bit."""

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
