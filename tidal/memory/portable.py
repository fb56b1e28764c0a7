"""The portable memory backend: real pause and resume of registered tensors on any device.

Nothing here needs torch_memory_saver or CUDA; CI runs the whole colocated loop on it. A pause
walks the registered tensors of each state class, takes each distinct storage once, and:

- backed-up classes keep their bytes on the host, then the device storage is freed *in place*:
  the tensor objects stay the same (optimizer state, parameter references and views stay valid),
  only their storage holds zero bytes until resume;
- discarded classes are just freed; resume hands back fresh, uninitialised storage.

Where the bytes go depends on the host-memory policy (``--offload-host-memory``):

    release  the backup exists only while paused.
             CPU device: zero copy. The device *is* the host, so the live storage's memory block is
             moved into the backup storage (``_swap_data_ptr_``) and moved back on resume: no byte
             is copied, and host RSS while paused = the backed-up bytes, nothing more.
             CUDA: a pinned host buffer is allocated per pause, freed on resume.
    retain   one host buffer per storage, kept across cycles (pinned on CUDA: pinning is what makes
             the first pause slow, so later cycles copy at PCIe speed); pause and resume copy.
             On a CPU device this holds the backed-up bytes twice while active: it exists there to
             run the same code path as on CUDA.
    disk     backed-up classes other than weights (optimizer state, backed-up grads) are written to
             files in ``disk_dir`` and read back on resume; weights keep a released host backup so
             that weight sync can still read them without the disk.

Freed host memory goes back to the OS: large blocks are unmapped by glibc on free, and the heap is
trimmed (``malloc_trim``) after every pause and resume.

Freed device memory goes back to the driver only as whole allocator segments. On CUDA each state
class therefore allocates (in ``region`` and when resuming) from its own allocator pool
(``torch.cuda.MemPool``): in the process-wide pool a class's tensor can be carved out of a cached
segment that also holds someone else's live tensor, and freeing it at a pause then returns nothing
for that segment (how the GPU suite, which runs after other tests in one process, saw 3.95 of
4.29 GB freed). A pause frees the class's storages and drops its pool, which hands every segment
back; a resume allocates into a fresh pool. Only the allocating thread is routed to a pool, so
gradients that autograd's device thread allocates during backward stay in the shared pool.

Deferred pause and resume (``defer=...``) are offered for ``retain`` classes. On CUDA the copies run on
a stream of their own; ``settle`` makes the caller's stream wait for a resume's, and waits on the host
for a pause's before freeing the storages. On a CPU device a deferred pause copies at once and frees at
``settle``; a deferred resume's copy itself waits for ``settle``, and until then the storages hold 0xFF
bytes (NaN in every float dtype): a caller that reads a deferred class before settling it computes
with NaN instead of passing by luck, which is how CI checks that the trainer settles its optimizer
state before the step.

Zero-copy access: ``host_view(t)`` on a paused, backed-up tensor returns a ``HostView`` aliasing its
backup (for a disk backup, a private memory map of the file). Every view of a class is invalidated
when that class resumes; using it afterwards raises ``ResidencyError`` (see ``tidal.memory.views``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from typing_extensions import Unpack

from tidal.errors import ResidencyError
from tidal.memory.base import (
    Backing,
    ClassPolicy,
    ClassReport,
    HostBackedBackend,
    MemoryReport,
    StateClass,
)
from tidal.memory.home import CAN_SWAP
from tidal.memory.shadow import CopyStream, u8
from tidal.memory.telemetry import trim_host_heap
from tidal.memory.views import HostView, ViewToken, make_host_view

# Moving a memory block between two storages without copying (``tidal.memory.home.CAN_SWAP``; torch 2.11
# lacks it): without it, pause and resume copy.

# Per-class allocator pools on CUDA (see the module docstring); older torch shares one pool.
_HAS_POOLS = hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")

_DISK_CHUNK = 64 * 1024**2  # staging chunk for disk transfers of device memory


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns memory on this rank (a DTensor's local shard, else ``t``)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _free(storage: torch.UntypedStorage) -> None:
    """Release a storage's memory in place; tensors on it keep their identity and metadata."""
    if CAN_SWAP:
        empty = torch.UntypedStorage(0, device=storage.device)
        storage._swap_data_ptr_(empty)  # ``empty`` now owns the block and frees it when dropped
        del empty
    else:
        storage.resize_(0)


def _alloc(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Give an emptied storage ``nbytes`` of fresh, uninitialised memory."""
    if CAN_SWAP:
        storage._swap_data_ptr_(torch.UntypedStorage(nbytes, device=storage.device))
    else:
        storage.resize_(nbytes)


@dataclass
class _Entry:
    """One storage of a paused class."""

    storage: torch.UntypedStorage  # the live storage, empty while paused
    nbytes: int
    mode: str  # move | copy | retain | disk | discard
    host: torch.UntypedStorage | None = None  # host backup (or memory map of the disk file)
    path: Path | None = None


@dataclass
class _Paused:
    state_class: StateClass
    token: ViewToken
    entries: dict[int, _Entry] = field(default_factory=dict)  # by storage identity


class PortableBackend(HostBackedBackend):
    """Pause/resume by freeing registered storages in place; works on CPU and on CUDA."""

    name = "portable"

    def __init__(
        self, policy: dict[StateClass, ClassPolicy], *, device: str | torch.device = "cpu", **backing: Unpack[Backing]
    ):
        super().__init__(policy, device=device, **backing)
        self._pin_cuda_index()
        disk = self.disk_dir
        self._disk_root = Path(disk) / f"tidal-{self.label}-{os.getpid()}-{id(self):x}" if disk else None
        self._paused: dict[StateClass, _Paused] = {}
        self._retained: dict[StateClass, dict[int, torch.UntypedStorage]] = {}
        self._on_cuda = self.device.type == "cuda"
        self._pools: dict[StateClass, object] = {}  # class -> torch.cuda.MemPool its storages live in
        self._copies = CopyStream(self.device)  # deferred copies (CUDA)

    @contextlib.contextmanager
    def region(self, state_class: StateClass) -> Iterator[None]:
        """Allocations inside come from ``state_class``'s own pool on CUDA; elsewhere nothing to hook."""
        with self._in_pool(StateClass(state_class)):
            yield

    @contextlib.contextmanager
    def _in_pool(self, c: StateClass) -> Iterator[None]:
        if not (self._on_cuda and _HAS_POOLS):
            yield
            return
        pool = self._pools.get(c)
        if pool is None:
            with torch.cuda.device(self.device):
                pool = self._pools[c] = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool, device=self.device):
            yield

    # -- registration -------------------------------------------------------------------------

    def resident_bytes(self, classes: Sequence[StateClass] | None = None) -> int:
        """Bytes of registered storages on the device now (0 for a fully paused class)."""
        total = 0
        for c in classes if classes is not None else list(self._sources):
            for st in self._storages(StateClass(c)).values():
                total += st.nbytes()
        return total

    # -- pause / resume -----------------------------------------------------------------------

    def defers(self, state_class: StateClass) -> bool:
        return self._mode(StateClass(state_class)) == "retain"

    def pause(self, classes: Sequence[StateClass], *, defer: Sequence[StateClass] = ()) -> MemoryReport:
        classes = self._check(classes, want_paused=False, op="pause")
        defer = {StateClass(c) for c in defer if self.defers(c)}
        self.settle(classes)
        report = MemoryReport(op="pause", backend=self.name)
        t0 = self._measure_before(report)
        if StateClass.ACTIVATIONS in classes and self._on_cuda:
            # Activations are what the last step left reachable only through reference cycles: collect
            # them so that their blocks go back to the driver with the cache. On a CPU device they are
            # plain heap memory that the trim below returns; a full collection (about a second with
            # torch and transformers loaded on a busy 2-core machine) would buy nothing there.
            gc.collect()
        for c in sorted(classes, key=lambda c: c in defer):  # deferred last: the others synchronise
            report.classes.append(self._pause_class(c, c in defer))
        self._return_free_memory(sync=not defer)
        return self._measure_after(report, t0)

    def resume(self, classes: Sequence[StateClass], *, defer: Sequence[StateClass] = ()) -> MemoryReport:
        classes = self._check(classes, want_paused=True, op="resume")
        defer = {StateClass(c) for c in defer if self.defers(c)}
        self.settle(classes)  # a deferred pause releases first
        if self._on_cuda:
            # An out-of-memory halfway through would leave a class half resumed; refuse up front.
            needed = sum(e.nbytes for c in classes for e in self._paused[c].entries.values())
            if _HAS_POOLS:
                # A class resumes into its own pool, which cannot use blocks cached by the shared one:
                # hand those back first and count only what the driver has free.
                torch.cuda.empty_cache()
                free, _ = torch.cuda.mem_get_info(self.device)
            else:
                free, _ = torch.cuda.mem_get_info(self.device)
                free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            self._check_room(classes, needed, free)
        report = MemoryReport(op="resume", backend=self.name)
        t0 = self._measure_before(report)
        for c in sorted(classes, key=lambda c: c in defer):  # deferred last: the others synchronise
            report.classes.append(self._resume_class(c, c in defer))
        self._return_free_memory(sync=not defer)
        return self._measure_after(report, t0)

    def host_view(self, tensor: torch.Tensor) -> HostView:
        t = local_tensor(tensor)
        key = t.untyped_storage()._cdata
        for paused in self._paused.values():
            entry = paused.entries.get(key)
            if entry is None:
                continue
            self.settle([paused.state_class])  # a deferred pause's copy is on the host once settled
            if entry.mode == "discard":
                raise ResidencyError(
                    f"{self.label}: host_view of a {paused.state_class.value} tensor, a class paused without "
                    "backup; its contents are gone"
                )
            if entry.host is None:  # disk backup: map the file privately, no anonymous copy
                entry.host = torch.UntypedStorage.from_file(str(entry.path), shared=False, nbytes=entry.nbytes)
            return make_host_view(entry.host, t, paused.token)
        raise ResidencyError(
            f"{self.label}: host_view of a tensor that is not paused (paused classes: "
            f"{', '.join(c.value for c in self._paused) or 'none'}); read the live tensor instead"
        )

    def close(self) -> None:
        """Drop retained host buffers and disk files (the backend must not be paused)."""
        self.settle()
        self._retained.clear()
        self._pools.clear()
        if self._disk_root is not None and self._disk_root.exists():
            shutil.rmtree(self._disk_root, ignore_errors=True)
        self._return_free_memory()

    # -- internals ----------------------------------------------------------------------------

    def _storages(self, c: StateClass) -> dict[int, torch.UntypedStorage]:
        found: dict[int, torch.UntypedStorage] = {}
        for source in self._sources.get(c, []):
            for t in source():
                if t is None:
                    continue
                t = local_tensor(t)
                if t.device != self.device:  # e.g. a CPU-offloaded tensor: nothing on this device
                    continue
                st = t.untyped_storage()
                found.setdefault(st._cdata, st)
        return found

    def _mode(self, c: StateClass) -> str:
        if not self.policy[c].backup:
            return "discard"
        if self.host_memory == "disk" and c is not StateClass.WEIGHTS:
            return "disk"
        if self.host_memory == "retain":
            return "retain"
        return "move" if (not self._on_cuda and CAN_SWAP) else "copy"

    def _host_buffer(self, nbytes: int) -> torch.UntypedStorage:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._on_cuda).untyped_storage()

    def _sync(self) -> None:
        if self._on_cuda:
            torch.cuda.synchronize(self.device)

    def _pause_class(self, c: StateClass, deferred: bool = False) -> ClassReport:
        """Back up and free one class; ``deferred`` (retain only): its copies out run on the copy stream (CUDA)
        and ``settle`` frees it."""
        t0 = time.perf_counter()
        mode = self._mode(c)
        paused = _Paused(state_class=c, token=ViewToken(f"{self.label} {c.value}"))
        retained = self._retained.setdefault(c, {}) if mode == "retain" else {}
        keep: dict[int, torch.UntypedStorage] = {}
        rep = ClassReport(state_class=c.value, deferred=deferred)
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host, device) bytes backed up by copying
        for key, st in self._storages(c).items():
            n = st.nbytes()
            if n == 0:  # already empty (e.g. FSDP's resharded full parameters): nothing to release
                continue
            entry = _Entry(storage=st, nbytes=n, mode=mode)
            if mode == "move":
                entry.host = torch.UntypedStorage(0)
                st._swap_data_ptr_(entry.host)  # the block itself becomes the backup: zero copy
            elif mode in ("copy", "retain"):
                host = retained.get(key)
                if host is None or host.nbytes() != n:
                    host = self._host_buffer(n)
                if mode == "retain":
                    keep[key] = host
                copies.append((u8(host), u8(st)))
                entry.host = host
            elif mode == "disk":
                entry.path = self._write_file(c, len(paused.entries), st)
            paused.entries[key] = entry
            rep.bytes += n
            if mode != "discard":
                rep.backup_bytes += n
        if mode == "retain":
            # Buffers of storages that no longer exist are dropped; the rest live on.
            self._retained[c] = keep
        self._paused[c] = paused
        copied = None
        if deferred and self._on_cuda:
            copied = self._copies.enqueue(copies)  # beside the caller's next work
        else:
            for dst, src in copies:
                dst.copy_(src, non_blocking=self._on_cuda)
        if deferred:
            self._deferred[c] = lambda: self._release(c, paused, copied, hand_back=True)
        else:
            self._release(c, paused)
        rep.seconds = time.perf_counter() - t0
        return rep

    def _release(self, c: StateClass, paused: _Paused, copied=None, hand_back: bool = False) -> None:
        """Free a paused class's storages once their copies out are done (``copied``: the event after them on
        the copy stream; else the device is synchronised), and drop its pool; ``hand_back``: give the freed
        blocks to the driver / OS now (a deferred pause's, settled outside ``pause``)."""
        if copied is not None:
            copied.synchronize()
        else:
            self._sync()  # device-to-host copies complete before their source is freed
        for entry in paused.entries.values():
            if entry.mode != "move":
                _free(entry.storage)
        # Every block of the class is free now: dropping its pool hands the pool's segments back.
        self._pools.pop(c, None)
        if hand_back:
            self._return_free_memory()

    def _resume_class(self, c: StateClass, deferred: bool = False) -> ClassReport:
        t0 = time.perf_counter()
        paused = self._paused[c]
        # Views die first: from here on their memory is handed back, rewritten or freed.
        paused.token.invalidate()
        rep = ClassReport(state_class=c.value, deferred=deferred)
        later: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []  # (device, host) copies deferred
        with self._in_pool(c):  # a fresh pool: the class's storages again share no segment with others
            for entry in paused.entries.values():
                st, n = entry.storage, entry.nbytes
                if entry.mode == "move":
                    st._swap_data_ptr_(entry.host)  # the backup block goes back; ``entry.host`` is empty now
                else:
                    _alloc(st, n)
                    if deferred:
                        later.append((st, entry.host))
                    elif entry.mode in ("copy", "retain"):
                        u8(st).copy_(u8(entry.host), non_blocking=self._on_cuda)
                    elif entry.mode == "disk":
                        self._read_file(entry.path, st)
                rep.bytes += n
                if entry.mode != "discard":
                    rep.backup_bytes += n
        if later:
            self._deferred[c] = self._copy_back_later(later)
        if not deferred:
            self._sync()
        for entry in paused.entries.values():
            freeable = CAN_SWAP or entry.host is None or entry.host.resizable()  # not once handed to numpy
            if (entry.mode == "copy" or (entry.mode == "disk" and entry.host is not None)) and freeable:
                # Release the buffer even if a stale view still references its storage object.
                _free(entry.host)
            if entry.mode == "disk":
                entry.path.unlink(missing_ok=True)
            if entry.mode != "retain":
                entry.host = None
        del self._paused[c]
        rep.seconds = time.perf_counter() - t0
        return rep

    def _copy_back_later(self, pairs: list[tuple[torch.UntypedStorage, torch.UntypedStorage]]):
        """A deferred resume's copies (device storage, retained host buffer): on CUDA enqueued now on a copy
        stream, ``settle`` waiting for their event; on a CPU device run by ``settle``, the storages holding 0xFF
        bytes until then (see the module docstring)."""

        if self._on_cuda:
            return self._wait_on(self._copies.enqueue((u8(st), u8(host)) for st, host in pairs))

        def copy_all() -> None:
            for st, host in pairs:
                u8(st).copy_(u8(host))

        for st, _ in pairs:
            u8(st).fill_(0xFF)
        return copy_all

    def _write_file(self, c: StateClass, index: int, st: torch.UntypedStorage) -> Path:
        assert self._disk_root is not None
        self._disk_root.mkdir(parents=True, exist_ok=True)
        path = self._disk_root / f"{c.value}-{index:06d}.bin"
        src = u8(st)
        with open(path, "wb") as f:
            if not self._on_cuda:
                f.write(memoryview(src.numpy()))
            else:
                stage = torch.empty(min(_DISK_CHUNK, src.numel()), dtype=torch.uint8, pin_memory=True)
                for lo in range(0, src.numel(), _DISK_CHUNK):
                    part = src[lo : lo + _DISK_CHUNK]
                    stage[: part.numel()].copy_(part)
                    f.write(memoryview(stage[: part.numel()].numpy()))
        return path

    def _read_file(self, path: Path, st: torch.UntypedStorage) -> None:
        dst = u8(st)
        with open(path, "rb", buffering=0) as f:
            if not self._on_cuda:
                if f.readinto(memoryview(dst.numpy())) != dst.numel():
                    raise RuntimeError(f"{path}: short read while resuming {self.label}")
            else:
                stage = torch.empty(min(_DISK_CHUNK, dst.numel()), dtype=torch.uint8, pin_memory=True)
                for lo in range(0, dst.numel(), _DISK_CHUNK):
                    n = min(_DISK_CHUNK, dst.numel() - lo)
                    if f.readinto(memoryview(stage[:n].numpy())) != n:
                        raise RuntimeError(f"{path}: short read while resuming {self.label}")
                    dst[lo : lo + n].copy_(stage[:n])

    def _return_free_memory(self, sync: bool = True) -> None:
        """Hand freed blocks back to the driver / OS so that the release is visible from outside (without
        waiting for the device when a deferred copy is running: it would wait for that copy too)."""
        if self._on_cuda:
            if sync:
                torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            host_empty = getattr(torch._C, "_host_emptyCache", None)
            if host_empty is not None:  # pinned blocks of released backups, cached by torch
                host_empty()
        trim_host_heap()
