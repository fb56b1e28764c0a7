"""A state class's bytes in one page-locked host buffer, copied on a stream of their own.

torch_memory_saver backs a tag up with a synchronous copy per allocation: its resume returns when every
byte is back on the device. For the trainer's optimizer state that wait sits on the step's critical path
(3.95 GB, about 80 ms at a pinned copy's 50 GB/s, on the 0.5B preset) although nothing reads the state
before the optimizer step, after the whole forward and backward. With ``--offload-host-memory retain``
the torch_memory_saver backend therefore keeps the optimizer state's backup itself, in a ``Shadow``:

- one host buffer for the class, page-locked once with ``cudaHostRegister`` (exactly its bytes: torch's
  pinned allocator rounds every buffer up to a power of two) and kept across cycles, each storage at an
  offset of its own (4 KiB aligned);
- ``save`` and ``restore`` only enqueue the copies (out after the caller's work, back into the storages
  mapped again) and return the event after them: a pause waits for it before the pages go (at once, or
  in ``MemoryBackend.settle`` when deferred), a resume makes the caller's stream wait for it in
  ``settle``.

The layout is made anew when the class's storages change (a checkpoint load replaces the optimizer
state); the buffer is then replaced, unregistered before it is freed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tidal.errors import ResidencyError
from tidal.memory.views import HostView, ViewToken, make_host_view

_ALIGN = 4096


def u8(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class CopyStream:
    """The stream of one backend's copies between host backups and the device, made at first use (torch's
    streams do not wait for the default one: work there runs beside them)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream: torch.cuda.Stream | None = None

    def after_caller(self) -> torch.cuda.Stream:
        """The stream, ordered after the caller's work so far."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._stream

    def enqueue(self, copies: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        """Each ``(dst, src)`` copied on the stream after the caller's work; returns the event after them."""
        stream = self.after_caller()
        with torch.cuda.stream(stream):
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        return done


def _lay_out(storages: dict[int, torch.UntypedStorage]) -> tuple[dict[int, tuple[int, int]], int]:
    """Storage key -> (offset, bytes) in the buffer, in the given order; and the buffer's size."""
    layout: dict[int, tuple[int, int]] = {}
    end = 0
    for key, st in storages.items():
        n = st.nbytes()
        layout[key] = (end, n)
        end += -(-n // _ALIGN) * _ALIGN
    return layout, end


class Shadow:
    """The host copy of one CUDA state class (see the module docstring)."""

    def __init__(self, device: torch.device, what: str):
        self.device, self.what = device, what
        self._buffer: torch.Tensor | None = None  # uint8, page-locked while registered
        self._layout: dict[int, tuple[int, int]] = {}
        self._copies = CopyStream(device)

    def save(self, storages: dict[int, torch.UntypedStorage]) -> torch.cuda.Event:
        """Enqueue the copies of every storage into the buffer (laid out anew when they changed), after the
        caller's work; returns the event recorded after them. The storages must stay until that event."""
        layout, size = _lay_out(storages)
        if self._buffer is None or layout != self._layout:
            self._allocate(size)
            self._layout = layout
        return self._copies.enqueue((self._slice(key), u8(st)) for key, st in storages.items())

    def restore(self, storages: dict[int, torch.UntypedStorage]) -> torch.cuda.Event:
        """Enqueue the copies back into ``storages`` (the ones ``save`` saw, with their memory mapped again);
        returns the event recorded after them. Nothing may use the storages before that event."""
        return self._copies.enqueue((u8(st), self._slice(key)) for key, st in storages.items())

    def _slice(self, key: int) -> torch.Tensor:
        """The bytes of storage ``key`` in the buffer."""
        off, n = self._layout[key]
        assert self._buffer is not None
        return self._buffer[off : off + n]

    def view(self, key: int, like: torch.Tensor, token: ViewToken) -> HostView:
        """``like`` (a tensor on the storage ``key``) read from the buffer, without a copy."""
        off, _ = self._layout[key]
        assert self._buffer is not None
        offset = off // like.element_size() + like.storage_offset()
        return make_host_view(self._buffer.untyped_storage(), like, token, offset=offset)

    def _allocate(self, size: int) -> None:
        self.close()
        buffer = torch.empty(size, dtype=torch.uint8)
        if size:
            err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), size, 0)
            if int(err) != 0:
                raise ResidencyError(
                    f"{self.what}: page-locking {size / 2**30:.2f} GiB of host memory failed (CUDA error {int(err)}); "
                    "free host memory or run with --offload-host-memory release"
                )
        self._buffer = buffer

    def close(self) -> None:
        """Unregister and drop the buffer."""
        if self._buffer is not None and self._buffer.numel():
            torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
        self._buffer, self._layout = None, {}
