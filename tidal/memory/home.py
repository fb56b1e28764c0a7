"""Moving tensors into a state class's region after they were allocated, in place: ``rehome`` and ``Adopter``.

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

``rehome`` gives the storage a new memory block allocated inside the region, copies the bytes, and
swaps the blocks (``UntypedStorage._swap_data_ptr_``): the storage object stays, so every tensor and
view that uses it follows, and the old block is freed where it was allocated (a pool that is not
backed up, or the process-wide one, which the pause's ``empty_cache`` hands back).

Not every torch release has that swap (``CAN_SWAP``; e.g. 2.11 lacks it). Without it, ``Adopter`` falls
back to running the step inside the region (``stepping``; the state is born there, and so are the step's
cached temporaries: correct, but host memory while paused holds them too), and ``rehome`` refuses with
one line, since a storage shared by views cannot be moved without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch

from tidal.errors import UserError

Region = Callable[[], contextlib.AbstractContextManager]

CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def rehome(tensors: Iterable[torch.Tensor], region: Region, *, zero: bool = False) -> int:
    """Move each distinct storage of ``tensors`` into a block allocated inside ``region()`` (a fresh context
    each time: one storage at a time, so the peak is one storage more), in place: views stay valid. The
    contents are copied unless ``zero`` (then zeroed). Returns the bytes moved."""
    tensors = list(tensors)
    if not tensors:
        return 0
    if not CAN_SWAP:
        raise UserError(
            f"this torch ({torch.__version__}) cannot move a tensor's memory into another region in place "
            "(no UntypedStorage._swap_data_ptr_): use a torch release that has it, or run without "
            "--use-distributed-optimizer"
        )
    moved = 0
    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        if storage._cdata in seen:
            continue
        seen.add(storage._cdata)
        nbytes = storage.nbytes()
        with region():
            fresh = torch.UntypedStorage(nbytes, device=t.device)
        if zero:
            fresh.fill_(0)
        else:
            fresh.copy_(storage)
        storage._swap_data_ptr_(fresh)  # ``storage`` now owns the region's block; ``fresh`` the old one
        del fresh  # frees the old block
        moved += nbytes
    return moved


class Adopter:
    """Moves tensors into one region the first time it sees their storage (``adopt``), e.g. after every
    optimizer step, so that state created by that step ends up in the region and its temporaries do not.
    Run the step inside ``stepping()``: no region where tensors can be moved, the region itself where not."""

    def __init__(self, region: Region):
        self.region = region
        self.homed: set[int] = set()  # storage identities already inside the region

    def stepping(self) -> contextlib.AbstractContextManager:
        """Where the step that creates the state runs: outside any region (its state is adopted after it),
        or, without ``CAN_SWAP``, inside the region, so that the state is born there."""
        return contextlib.nullcontext() if CAN_SWAP else self.region()

    def adopt(self, tensors: Iterable[torch.Tensor]) -> int:
        """Rehome the tensors whose storage was not adopted before; returns the bytes moved (0 without
        ``CAN_SWAP``: the state was created inside the region by ``stepping``)."""
        if not CAN_SWAP:
            return 0
        new = [t for t in tensors if t.untyped_storage()._cdata not in self.homed]
        if not new:
            return 0
        moved = rehome(new, self.region)
        self.homed.update(t.untyped_storage()._cdata for t in new)
        return moved
