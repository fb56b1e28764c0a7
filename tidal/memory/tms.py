"""The torch_memory_saver backend (CUDA): pause unmaps physical pages, the virtual addresses stay.

Each state class is one torch_memory_saver tag (``<label>.<class>``, e.g. ``trainer.optimizer``). Allocations of a class must happen inside
``region(state_class)``, which opens a tms region with that class's policy: CPU backup for
backed-up classes (disk backup for the optimizer state under ``--offload-host-memory disk``), no
backup for discarded ones. In preload mode every other ``cudaMalloc`` of the process is a tms
allocation too, under the tag ``default`` with CPU backup (``TMS_INIT_ENABLE_CPU_BACKUP=1``); that
tag is never paused (see ``_tags``), so what must be released is allocated inside a region.

torch_memory_saver terminates the process on a double pause, on resuming an active tag, or on
reading the backup of an unbacked allocation. This wrapper tracks each class's state and raises
``ResidencyError`` first. It never sets a memory margin: the margin guard was removed from tidal's
flags (slime PR #2249) and torch_memory_saver's default, 0, leaves admission to the CUDA allocator.

Host-memory policy: ``release`` (torch_memory_saver's default: pinned shadow allocated at pause,
freed at resume), ``retain`` (``retain_cpu_backup``: the pinned shadow is kept and reused, so
only the first pause pays for pinning), ``disk`` (optimizer state spills to ``disk_dir``).

Under ``retain`` the optimizer state's backup is tidal's own (``tidal.memory.shadow``): its region has
no torch_memory_saver backup, a pause copies the registered storages to a kept host buffer on a
stream of their own and unmaps the tag once they are there, and a resume maps the tag and enqueues
the copies back, so that a deferred pause or resume (``defers``) returns before they finish. Only the
optimizer's region can be handled so: it holds exactly the registered state
(``tidal.memory.home.Adopter`` moves each state tensor in; the step's temporaries stay out), where
the weights' region also holds what the model allocated while it was sharded (buffers), which only a
backup of the whole tag keeps.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import os
import time
from collections.abc import Iterator, Sequence

import torch
from typing_extensions import Unpack

from tidal.errors import ConfigError, ResidencyError
from tidal.memory.base import Backing, ClassPolicy, ClassReport, HostBackedBackend, MemoryReport, StateClass
from tidal.memory.portable import local_tensor
from tidal.memory.preload import check_allocator_conf
from tidal.memory.shadow import Shadow
from tidal.memory.views import HostView, ViewToken, wrap_host_tensor


class TmsBackend(HostBackedBackend):
    """Pause/resume through torch_memory_saver tags, one per state class."""

    name = "tms"

    def __init__(
        self,
        policy: dict[StateClass, ClassPolicy],
        *,
        device: str | torch.device = "cuda",
        hook_mode: str = "torch",
        **backing: Unpack[Backing],
    ):
        super().__init__(policy, device=device, **backing)
        if hook_mode not in ("torch", "preload"):
            raise ConfigError(f"--tms-hook-mode {hook_mode!r} is not torch or preload; pick one")
        check_allocator_conf(os.environ)
        if hook_mode == "preload" and "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""):
            raise ConfigError(
                "--tms-hook-mode preload but this process has no torch_memory_saver LD_PRELOAD; start the actor "
                "with tidal.memory.preload.actor_env() or use --tms-hook-mode torch"
            )
        from torch_memory_saver import torch_memory_saver

        self._tms = torch_memory_saver
        self._pin_cuda_index()
        self.hook_mode = hook_mode
        # The hook mode must be chosen before torch_memory_saver's first use in this process.
        if getattr(self._tms, "_impl", None) is None:
            self._tms.hook_mode = hook_mode
        if self.host_memory == "retain":
            self._tms.retain_cpu_backup = True
        if self.host_memory == "disk":
            self._tms.set_disk_backup_dir(str(self.disk_dir))
        self._torch_hooks = _torch_mode_impl(self._tms) is not None
        if self._torch_hooks:
            _allow_pool_frees(self._tms)
            _register_exit_teardown(self._tms)
        self._paused: dict[StateClass, ViewToken] = {}
        self._owner: dict[int, StateClass] = {}  # storage identity -> its paused class (host_view lookups)
        # Classes backed up by tidal (see the module docstring), each with its shadow and, while paused, the
        # storages to copy back into.
        own = self.host_memory == "retain" and self.policy.get(StateClass.OPTIMIZER, ClassPolicy(False)).backup
        self._shadows = {StateClass.OPTIMIZER: Shadow(self.device, f"{self.label} optimizer")} if own else {}
        self._saved: dict[StateClass, dict[int, torch.UntypedStorage]] = {}

    def defers(self, state_class: StateClass) -> bool:
        return StateClass(state_class) in self._shadows

    def _on_disk(self, c: StateClass) -> bool:
        return self.host_memory == "disk" and self.policy[c].backup and c is not StateClass.WEIGHTS

    @contextlib.contextmanager
    def region(self, state_class: StateClass) -> Iterator[None]:
        c = StateClass(state_class)
        if c in self._paused:
            raise ResidencyError(f"{self.label}: allocation in region {c.value} while it is paused")
        disk = self._on_disk(c)
        tms_backup = self.policy[c].backup and not disk and c not in self._shadows
        with self._tms.region(tag=self._tag(c), enable_cpu_backup=tms_backup, enable_disk_backup=disk):
            yield

    @contextlib.contextmanager
    def unmanaged(self) -> Iterator[None]:
        """Allocations inside are ordinary (freed at once, CUDA-IPC exportable): weight-sync temporaries."""
        if self.hook_mode == "preload":
            with self._tms.disable():
                yield
        else:
            yield  # in torch mode only region() allocations are tms allocations

    def _class_storages(self, c: StateClass) -> dict[int, int]:
        """Storage identity -> bytes of the class's registered CUDA tensors."""
        return {k: st.nbytes() for k, st in self._storage_objects(c).items()}

    def _storage_objects(self, c: StateClass) -> dict[int, torch.UntypedStorage]:
        """Storage identity -> storage of the class's registered CUDA tensors."""
        seen: dict[int, torch.UntypedStorage] = {}
        for source in self._sources.get(c, []):
            for t in source():
                if t is None:
                    continue
                t = local_tensor(t)
                if t.device.type == "cuda":
                    st = t.untyped_storage()
                    seen.setdefault(st._cdata, st)
        return seen

    def _class_bytes(self, c: StateClass) -> int:
        return sum(self._class_storages(c).values())

    def _tag(self, c: StateClass) -> str:
        # The label keeps two backends of one process (a trainer and an engine in one benchmark) apart.
        return f"{self.label}.{c.value}"

    def _tags(self, c: StateClass) -> list[str]:
        # Only class tags are paused, never the preload mode's ``default`` tag: torch_memory_saver
        # terminates the process when resume meets an active allocation of the tag, and any CUDA
        # allocation made outside a region while paused (a sync temporary, a library workspace) would
        # be one. Memory of a class must therefore be allocated inside ``region(class)``.
        return [self._tag(c)]

    def pause(self, classes: Sequence[StateClass], *, defer: Sequence[StateClass] = ()) -> MemoryReport:
        classes = self._check(classes, want_paused=False, op="pause")
        defer = {StateClass(c) for c in defer if self.defers(c)}
        self.settle(classes)
        report = MemoryReport(op="pause", backend=self.name)
        torch.cuda.synchronize(self.device)
        if StateClass.ACTIVATIONS in classes:
            gc.collect()
        # Free cached blocks first: in preload mode they would otherwise be backed up for nothing.
        if self._torch_hooks:
            _allow_pool_frees(self._tms)  # empty_cache may hand tms pool segments back (see _allow_pool_frees)
        torch.cuda.empty_cache()
        t0 = self._measure_before(report)
        # Deferred classes last: unmapping the others could wait for the device, their copy included.
        for c in sorted(classes, key=lambda c: c in defer):
            tc = time.perf_counter()
            storages = self._storage_objects(c)
            nbytes = sum(st.nbytes() for st in storages.values())
            if c in self._shadows:
                self._saved[c] = storages
                copied = self._shadows[c].save(storages)
                self._deferred[c] = functools.partial(self._release_saved, c, copied)
                if c not in defer:
                    self.settle([c])
            else:
                self._release(c)
            self._paused[c] = ViewToken(f"{self.label} {c.value}")
            self._owner.update(dict.fromkeys(storages, c))
            report.classes.append(self._class_report(c, nbytes, tc))
            report.classes[-1].deferred = c in defer
        return self._measure_after(report, t0)

    def _release(self, c: StateClass) -> None:
        for tag in self._tags(c):
            self._tms.pause(tag)

    def _release_saved(self, c: StateClass, copied: torch.cuda.Event) -> None:
        """A class with tidal's own backup: its pages go once its copy to the host is done."""
        copied.synchronize()
        self._release(c)

    def _class_report(self, c: StateClass, nbytes: int, t0: float) -> ClassReport:
        """One class's figures: tms backs up a class whole (or nothing), so its backup bytes are all or none."""
        return ClassReport(
            state_class=c.value,
            bytes=nbytes,
            backup_bytes=nbytes if self.policy[c].backup else 0,
            seconds=time.perf_counter() - t0,
        )

    def resume(self, classes: Sequence[StateClass], *, defer: Sequence[StateClass] = ()) -> MemoryReport:
        classes = self._check(classes, want_paused=True, op="resume")
        defer = {StateClass(c) for c in defer if self.defers(c)}
        self.settle(classes)  # a deferred pause releases first
        # torch_memory_saver terminates the process when a resume cannot map its pages; refuse first.
        needed = sum(self._class_bytes(c) for c in classes)
        free, _ = torch.cuda.mem_get_info(self.device)
        self._check_room(classes, needed, free)
        report = MemoryReport(op="resume", backend=self.name)
        t0 = self._measure_before(report)
        # Deferred classes last: the synchronisation after each other class would wait for their copies too.
        for c in sorted(classes, key=lambda c: c in defer):
            tc = time.perf_counter()
            self._paused.pop(c).invalidate()  # before the shadow is freed or rewritten
            self._owner = {k: v for k, v in self._owner.items() if v is not c}
            for tag in self._tags(c):
                self._tms.resume(tag)
            if c in self._shadows:
                self._deferred[c] = self._wait_on(self._shadows[c].restore(self._saved.pop(c)))
                if c not in defer:
                    self.settle([c])
            if c not in defer:
                torch.cuda.synchronize(self.device)
            nbytes = self._class_bytes(c)
            report.classes.append(self._class_report(c, nbytes, tc))
            report.classes[-1].deferred = c in defer
        return self._measure_after(report, t0)

    def close(self) -> None:
        """Drop the host buffers tidal keeps (a paused class's stays: it holds the only copy)."""
        self.settle()
        for c, shadow in self._shadows.items():
            if c not in self._paused:
                shadow.close()

    def host_view(self, tensor: torch.Tensor) -> HostView:
        t = local_tensor(tensor)
        c = self._owner.get(t.untyped_storage()._cdata)
        if c is not None:
            token = self._paused[c]
            if c in self._shadows:
                self.settle([c])  # a deferred pause's bytes are on the host once it is settled
                return self._shadows[c].view(t.untyped_storage()._cdata, t, token)
            if not self.policy[c].backup or self._on_disk(c):
                raise ResidencyError(
                    f"{self.label}: host_view of a {c.value} tensor, which is paused without a host backup"
                )
            backup = self._tms.get_cpu_backup(t, zero_copy=True)
            if backup is None:
                raise ResidencyError(f"{self.label}: torch_memory_saver holds no host backup for this {c.value} tensor")
            return wrap_host_tensor(backup, token)
        raise ResidencyError(f"{self.label}: host_view of a tensor that is not paused; read the live tensor instead")


# -- torch hook mode: where torch hands pool memory back ---------------------------------------------
#
# In torch hook mode torch_memory_saver serves ``region()`` from torch MemPools whose pluggable
# allocator frees through ``tms_torch_free``, and that function terminates the process (exit code 1,
# "only support interesting region") unless the calling thread's ``interesting_region`` flag is set
# (csrc/entrypoint.cpp). The flag is set only inside ``region()``, but torch frees pool segments
# elsewhere: ``torch.cuda.empty_cache()`` releases the segments of pools no longer in use (a dropped
# CUDA graph's pool), and a MemPool's destructor empties its cache, which for torch_memory_saver's
# pools (held by its process-wide singleton) happens at interpreter teardown, outside any region.
# In torch mode the flag has no other effect (allocations only reach torch_memory_saver through
# its pools, entered by ``region()``, which saves and restores the flag), so tidal sets it on the
# threads that may free, and tears the pools down at exit while CUDA is still up. Preload mode hooks
# cudaFree, which has no such check, and there the flag routes every cudaMalloc: it is left alone.


def _torch_mode_impl(tms):
    """torch_memory_saver's initialised implementation when it hooks in torch mode, else None."""
    tms._ensure_initialized()
    impl = getattr(tms, "_impl", None)
    return impl if getattr(impl, "_hook_mode", None) == "torch" else None


def _allow_pool_frees(tms) -> None:
    """Let this thread hand torch_memory_saver pool segments back (torch hook mode only)."""
    impl = _torch_mode_impl(tms)
    if impl is not None:
        impl._binary_wrapper.cdll.tms_set_interesting_region(True)


_exit_teardown_registered = False


def _register_exit_teardown(tms) -> None:
    global _exit_teardown_registered
    if not _exit_teardown_registered:
        atexit.register(_exit_teardown, tms)
        _exit_teardown_registered = True


def _exit_teardown(tms) -> None:
    """Destroy torch_memory_saver's pools now, each freeing its cached segments through torch_memory_saver.

    atexit runs on the main thread before module teardown, while the CUDA runtime is alive; segments
    of tensors still alive return to their (released) pool and are reclaimed with the process.
    """
    impl = _torch_mode_impl(tms)
    if impl is None:
        return
    impl._binary_wrapper.cdll.tms_set_interesting_region(True)
    impl._mem_pools.clear()
