"""Moving tensors into a state class's region after they were allocated: ``rehome`` and ``Adopter``.

A region decides where an allocation lands (for torch_memory_saver: which tag, with or without a host
backup). Some tensors cannot be allocated inside the right region:

- optimizer state is created lazily, by the first ``optimizer.step()``. Running the step inside the
  OPTIMIZER region would also put the step's temporaries there (foreach AdamW's square root of every
  second moment: as large as the parameters; the clipping's scaled copies). Freed, they stay cached
  in the region's pool, and torch_memory_saver, which pauses and backs up whole pool segments, backs
  them up at every pause together with the state: host memory while paused grew by the parameters'
  size again. So the step runs outside any region and ``Adopter`` moves each new state tensor in
  afterwards, once;
- Megatron's distributed optimizer allocates flat parameter buffers while its DDP wrapper (built in
  the GRADS region) is constructed; ``rehome`` moves them to WEIGHTS.

``rehome`` allocates a new block inside the region for each distinct storage, copies the bytes, and
re-points every given tensor that uses the storage onto the new block at its own offset, size and
stride (assigning ``.data``, in every torch release; a parameter keeps its gradient accumulator and
the hooks on it): tensors given together that shared a storage still share one. The old block is freed where it was allocated (a pool that is not backed up, or the
process-wide one, which the pause's ``empty_cache`` hands back).

Re-pointing is only correct if the given tensors are *every* tensor using the storage: one left out
would keep the old block, silently no longer sharing memory with the others. So each storage's use
count (``torch._C._storage_Use_Count``: one per tensor on it, calibrated once against a fresh tensor)
is checked against the tensors given before anything moves. Where it shows other users, the storage
can still be moved in place by swapping the blocks (``UntypedStorage._swap_data_ptr_``: the storage
object stays, so every tensor on it follows), on torch releases that have it (``CAN_SWAP``; 2.11 lacks
it); without it ``rehome`` refuses with one line, moving nothing. Optimizer state has no views (one
tensor per storage), so it moves on every release; Megatron's parameter buffers move when the caller
gives every view of them (``tidal.trainer.megatron.memory.param_buffer_holders``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable

import torch

from tidal.errors import UserError

Region = Callable[[], contextlib.AbstractContextManager]

CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


# Long in CUDA builds (CUDA graphs use it), in CPU builds since later releases.
_HAS_USE_COUNT = hasattr(torch._C, "_storage_Use_Count")


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


# A storage's use count with one tensor on it; what else holds a storage (its Python object, where
# kept) differs between torch releases.
_ONE_TENSOR = _use_count(torch.empty(1)) if _HAS_USE_COUNT else 1


def storage_users(t: torch.Tensor) -> int | None:
    """How many tensors (views and aliases included, wherever held) use ``t``'s storage; None where this
    torch cannot tell (then only the swap can move it)."""
    return _use_count(t) - _ONE_TENSOR + 1 if _HAS_USE_COUNT else None


def _by_storage(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The distinct tensors grouped by the storage they use, in first-seen order."""
    groups: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            groups.setdefault(t.untyped_storage()._cdata, []).append(t)
    return list(groups.values())


def rehome(
    tensors: Iterable[torch.Tensor],
    region: Region,
    *,
    zero: bool = False,
    hint: str = "run without --use-distributed-optimizer",
) -> int:
    """Move each distinct storage of ``tensors`` into a block allocated inside ``region()`` (a fresh context
    each time: one storage at a time, so the peak is one storage more). The contents are copied unless
    ``zero`` (then zeroed). Tensors sharing a storage keep sharing it. Returns the bytes moved.

    Refuses (moving nothing) when a storage has users other than the tensors given and this torch cannot
    swap blocks in place (the error line ends with ``hint``: what to do)."""
    groups = _by_storage(tensors)
    partial = [(g, storage_users(g[0])) for g in groups]
    partial = [(g, n) for g, n in partial if n != len(g)]
    if partial and not CAN_SWAP:
        g, n = partial[0]
        users = "an unknown number of" if n is None else str(n)
        raise UserError(
            f"this torch ({torch.__version__}) cannot move a memory block that tensors not given to it may use "
            f"({users} tensors use a storage of {g[0].untyped_storage().nbytes()} bytes, {len(g)} given; "
            f"no UntypedStorage._swap_data_ptr_): use a torch release that has it, or {hint}"
        )
    swap = {id(g) for g, _ in partial}
    moved = 0
    for group in groups:
        storage = group[0].untyped_storage()
        nbytes = storage.nbytes()
        with region():
            fresh = torch.UntypedStorage(nbytes, device=storage.device)
        if zero:
            fresh.fill_(0)
        else:
            fresh.copy_(storage)
        if id(group) in swap:
            storage._swap_data_ptr_(fresh)  # ``storage`` now owns the region's block; ``fresh`` the old one
        else:
            with torch.no_grad():
                for t in group:
                    # ``.data =``, not ``t.set_``: set_ gives a parameter a new gradient accumulator, dropping
                    # the hooks registered on the old one (Megatron's DDP fills its grad buffers from them)
                    alias = torch.empty(0, dtype=t.dtype, device=fresh.device)
                    t.data = alias.set_(fresh, t.storage_offset(), t.size(), t.stride())
        del storage, fresh  # the old block is freed with its last user
        moved += nbytes
    return moved


class Adopter:
    """Moves tensors into one region the first time it sees them (``adopt``), e.g. after every optimizer
    step (which runs outside any region), so that state created by that step ends up in the region and
    its temporaries do not."""

    def __init__(self, region: Region):
        self.region = region
        # tensors already inside the region, by identity (a tensor replaced, e.g. by a checkpoint load, is new)
        self.homed: dict[int, weakref.ref] = {}

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (this very tensor) was adopted."""
        ref = self.homed.get(id(t))
        return ref is not None and ref() is t

    def adopt(self, tensors: Iterable[torch.Tensor]) -> int:
        """Rehome the tensors not adopted before; returns the bytes moved."""
        new = [t for t in tensors if not self.holds(t)]
        if not new:
            return 0
        moved = rehome(new, self.region, hint="use an optimizer whose state tensors have storages of their own")
        self.homed = {k: r for k, r in self.homed.items() if r() is not None}
        self.homed.update((id(t), weakref.ref(t)) for t in new)
        return moved
