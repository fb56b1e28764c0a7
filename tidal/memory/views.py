"""Guarded zero-copy views of host backups.

While the trainer is paused, weight sync reads weights straight from their host backup without
copying them (torch_memory_saver's ``get_cpu_backup(zero_copy=True)``, or the portable backend's
backup storage). Such a view aliases memory that the next ``resume()`` hands back, overwrites
(retained backups) or frees (released backups). Reading it after that would return stale bytes or
crash the process, so every view is a ``HostView``: a CPU tensor subclass whose every torch
operation (arithmetic, copies, ``.numpy()``, ``.shape``, printing, ...) first checks a token that
the backend invalidates on resume, and raises ``ResidencyError`` once it is stale.

Results of operations are plain tensors, except results that still alias the backup (slices,
``view``, ``reshape``, a no-op ``.to()``): those are ``HostView`` with the same token, so an alias
cannot escape the guard through torch. What the guard cannot see: a raw ``data_ptr()`` or a NumPy
array taken while the view was valid; use those only within the sync that took them.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tidal.errors import ResidencyError


class ViewToken:
    """Validity of every view handed out for one pause of one state class."""

    __slots__ = ("what", "valid")

    def __init__(self, what: str):
        self.what = what
        self.valid = True

    def invalidate(self) -> None:
        self.valid = False


class HostView(torch.Tensor):
    """A CPU tensor aliasing a host backup; any use after the backend invalidated it raises."""

    _tidal_token: ViewToken

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        guarded: dict[int, ViewToken] = {}
        for a in flat:
            if isinstance(a, HostView):
                token = a._tidal_token
                if not token.valid:
                    raise ResidencyError(
                        f"host view of {token.what} used after resume (its backup is gone or rewritten); "
                        "take views only while paused and drop them before resume"
                    )
                with torch._C.DisableTorchFunctionSubclass():
                    guarded[a.untyped_storage()._cdata] = token
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not guarded:
            return out

        def rewrap(o):
            if isinstance(o, torch.Tensor) and o.device.type == "cpu" and not isinstance(o, HostView):
                token = guarded.get(o.untyped_storage()._cdata)
                if token is not None:
                    return _wrap(o, token)
            return o

        with torch._C.DisableTorchFunctionSubclass():
            return tree_map(rewrap, out)

    def __reduce_ex__(self, protocol):
        # Pickling (Ray, multiprocessing) copies the bytes: the copy is an ordinary tensor, unguarded.
        token = self._tidal_token
        if not token.valid:
            raise ResidencyError(f"host view of {token.what} pickled after resume; take views only while paused")
        with torch._C.DisableTorchFunctionSubclass():
            plain = self.as_subclass(torch.Tensor)
        return plain.__reduce_ex__(protocol)


def _wrap(t: torch.Tensor, token: ViewToken) -> HostView:
    view = t.as_subclass(HostView)
    view._tidal_token = token
    return view


def make_host_view(
    storage: torch.UntypedStorage, like: torch.Tensor, token: ViewToken, *, offset: int | None = None
) -> HostView:
    """A ``HostView`` over ``storage`` with ``like``'s dtype, shape, strides and storage offset."""
    base = torch.empty(0, dtype=like.dtype, device="cpu")
    base.set_(storage, like.storage_offset() if offset is None else offset, like.size(), like.stride())
    return _wrap(base, token)


def wrap_host_tensor(t: torch.Tensor, token: ViewToken) -> HostView:
    """Guard an existing CPU tensor that aliases a backup (torch_memory_saver's zero-copy backup)."""
    return _wrap(t, token)
