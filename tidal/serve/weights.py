"""Weight updates in SGLang's wire forms, applied to the embedded engine: tensor payloads, broadcast groups, folders.

``/update_weights_from_tensor`` carries ``serialized_named_tensors``: one base64 string per TP rank
(tidal serves one rank, so one string), each the bytes of ``multiprocessing.reduction.ForkingPickler``
over either a list of ``(name, tensor)`` pairs (``load_format`` null or ``direct``) or a dict
``{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata(name, shape, dtype,
start_idx, end_idx, numel), ...]}`` (``flattened_bucket``). ForkingPickler sends tensors by handle,
never by value: a CUDA tensor as a CUDA IPC handle (same host, any GPU of it), a CPU tensor as a
shared-memory segment (the sender must use ``torch.multiprocessing.set_sharing_strategy("file_system")``:
the default file-descriptor strategy only works between a parent and its children). The bytes are
read with an unpickler that resolves only torch's tensor-rebuild functions, dtypes and storages:
an HTTP body never gets to name an arbitrary callable. SGLang's patched CUDA rebuild (device
given by UUID, ``_rebuild_cuda_tensor_modified``) is mapped to a local equivalent.

``/init_weights_update_group`` joins a process group of ``world_size`` ranks as rank
``rank_offset`` the way SGLang does (the trainer is rank 0 and hosts the TCPStore at
``master_address:master_port``; keys in torch's custom-group layout, ``<group_name>/`` then
``cpu/`` or ``cuda/``; no probe broadcast).
``/update_weights_from_distributed`` then receives one broadcast from rank 0 per name, in the
order given, each a contiguous tensor of its dtype and shape (gloo: CPU tensors; NCCL: CUDA), or
with ``load_format: flattened_bucket`` one uint8 broadcast of all their bytes back to back.

Everything received is checked against the engine's parameters (name, shape, dtype) and, when the
request carries tidal's ``checksums`` extension, against the sender's xxh3-128 of each tensor,
before a single byte is applied: a refused update leaves the engine as it was.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import pickle
from collections.abc import Iterable

import torch

from tidal.dtypes import WIRE_NAMES
from tidal.dtypes import dtype_of as wire_dtype
from tidal.errors import UserError, WeightSyncError
from tidal.weight_sync.checksum import tensor_checksum

_REBUILDS = {
    "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
    "rebuild_storage_filename", "rebuild_storage_fd", "rebuild_storage_empty", "rebuild_event",
}  # fmt: skip
_ALLOWED = {
    "torch.multiprocessing.reductions": _REBUILDS,
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch._utils": {"_rebuild_tensor_v2", "_rebuild_tensor"},
    "torch.nn.parameter": {"Parameter"},
    "collections": {"OrderedDict"},
    "multiprocessing.resource_sharer": {"DupFd"},
}
_TORCH_NAMES = {"Tensor", "Size", "device", "UntypedStorage"} | set(WIRE_NAMES)


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket (SGLang's ``weight_sync.tensor_bucket`` record, by field)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _rebuild_cuda_tensor_by_uuid(*args):
    """SGLang's patched CUDA rebuild: argument 6 is the device UUID instead of the sender's index."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(args)
    dev = args[6]
    if isinstance(dev, str):
        found = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == dev]
        if not found:
            raise WeightSyncError(f"CUDA tensor on device {dev}, which this server cannot see")
        args[6] = found[0]
    return rebuild_cuda_tensor(*args)


class _WeightUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name == "FlattenedTensorMetadata":
            return FlattenedTensorMetadata
        if name == "_rebuild_cuda_tensor_modified":
            return _rebuild_cuda_tensor_by_uuid
        if (module == "torch" and name in _TORCH_NAMES) or name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a tensor-rebuild global")


def deserialize(data: str):
    """SGLang's ``MultiprocessingSerializer.deserialize`` of a base64 string, restricted to tensors."""
    import torch.multiprocessing.reductions  # noqa: F401 - registers torch's reducers and rebuilds

    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise UserError(f"serialized_named_tensors: not base64 ({e})") from None
    try:
        return _WeightUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as e:
        raise UserError(f"serialized_named_tensors: refused ({e})") from None
    except (EOFError, RuntimeError, OSError) as e:
        raise UserError(f"serialized_named_tensors: could not rebuild the tensors ({type(e).__name__}: {e})") from None


def named_tensors_from_payload(serialized: list[str], load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of an ``update_weights_from_tensor`` request (one TP rank)."""
    if len(serialized) != 1:
        raise UserError(
            f"serialized_named_tensors has {len(serialized)} entries; tidal serve runs one TP rank: send one"
        )
    obj = deserialize(serialized[0])
    if load_format in (None, "direct"):
        if not isinstance(obj, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in obj
        ):
            raise UserError("serialized_named_tensors: expected a list of (name, tensor) pairs for load_format direct")
        return [(n, t) for n, t in obj]
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
            raise UserError("serialized_named_tensors: flattened_bucket needs a dict of flattened_tensor and metadata")
        flat = obj["flattened_tensor"]
        return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in obj["metadata"]]
    raise UserError(f"load_format {load_format!r}: use null, direct or flattened_bucket")


def dtype_of(name: str) -> torch.dtype:
    """A dtype named in a request (``torch.`` prefix allowed); one the wire format does not know is a user error."""
    wire = name.removeprefix("torch.")
    if wire not in WIRE_NAMES:
        raise UserError(f"dtype {name!r}: use one of {', '.join(WIRE_NAMES)}")
    return wire_dtype(wire)


def receive_broadcast(pg, names, dtypes, shapes, device, *, flat: bool) -> tuple[list, torch.Tensor | None]:
    """Receive the tensors of ``/update_weights_from_distributed`` from rank 0 of ``pg``.

    One broadcast per tensor, in order; or, with ``flat`` (SGLang's ``flattened_bucket``), one
    broadcast of a uint8 tensor holding every tensor's bytes back to back in the order named.
    ``device`` None means host tensors (gloo). Returns the pairs and the flat buffer (None without ``flat``).
    """
    from tidal.weight_sync.group import broadcast

    dev = device if device is not None else torch.device("cpu")
    if not flat:
        pairs = []
        for name, dt, shape in zip(names, dtypes, shapes):
            t = torch.empty(shape, dtype=dt, device=dev)
            broadcast(pg, t)
            pairs.append((name, t))
        return pairs, None
    sizes = [int(torch.Size(shape).numel()) * dt.itemsize for dt, shape in zip(dtypes, shapes)]
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
    broadcast(pg, buf)
    pairs, at = [], 0
    for name, dt, shape, nb in zip(names, dtypes, shapes, sizes):
        pairs.append((name, buf[at : at + nb].view(dt).reshape(shape)))
        at += nb
    return pairs, buf


class WeightApplier:
    """Checks and applies complete named tensors to the engine; tracks which weights are fresh.

    After a release of the weights, every parameter must be rewritten before the engine may generate
    again: the applier marks the engine synced once the names applied since the last resume cover
    all of its parameters (an update of a few tensors into resident weights needs nothing more).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.params = dict(engine.model.named_parameters(remove_duplicate=False))
        self._unique = {n for n, _ in engine.model.named_parameters()}
        self._all = {id(p) for p in self.params.values()}
        self._fresh: set[int] = set()  # ids of parameters rewritten since the last resume
        self.groups: dict[str, object] = {}

    def check(self, pairs: Iterable[tuple[str, torch.Tensor]], checksums: dict[str, str] | None) -> None:
        seen = set()
        for name, t in pairs:
            p = self.params.get(name)
            if p is None:
                raise UserError(f"weight {name!r} is not a parameter of the served model")
            if tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
                raise UserError(
                    f"weight {name!r}: got {t.dtype} of shape {tuple(t.shape)}, the engine holds {p.dtype} of shape {tuple(p.shape)}"
                )
            if checksums is not None:
                want = checksums.get(name)
                if want is None:
                    raise UserError(f"checksums has no entry for {name!r}; give one per tensor or none")
                got = tensor_checksum(t, "xxh3-128")
                if got != want:
                    raise WeightSyncError(f"weight {name!r}: checksum {got} != sent {want}; nothing applied")
            seen.add(name)
        if checksums is not None and set(checksums) - seen:
            extra = sorted(set(checksums) - seen)
            raise UserError(f"checksums names {extra[:3]} that were not sent")

    def apply(
        self,
        pairs: list[tuple[str, torch.Tensor]],
        checksums: dict[str, str] | None = None,
        bucket_checksum: str | None = None,
        flat: torch.Tensor | None = None,
    ) -> int:
        """Check, then copy into the engine. ``bucket_checksum``: tidal's ``buffer_checksum`` of ``flat``
        (the received flat buffer) or, without one, of the tensors' bytes back to back."""
        self.check(pairs, checksums)
        if bucket_checksum is not None:
            from tidal.weight_sync.bucket import buffer_checksum

            if flat is None:
                flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in pairs])
            got = buffer_checksum(flat)
            if got != bucket_checksum:
                raise WeightSyncError(f"bucket checksum {got} != sent {bucket_checksum}; nothing applied")
        self.engine.residency.require_sync()
        self.engine.flush_cache()
        nbytes = self.engine.load_weights(pairs)
        self._fresh.update(id(self.params[n]) for n, _ in pairs)
        if not self.engine.residency.weights_valid and self._all <= self._fresh:
            self.engine.residency.mark_synced()
        return nbytes

    def weights_resumed(self) -> None:
        self._fresh = set()

    # ------------------------------------------------------------------ folders

    def load_folder(self, path: str) -> int:
        """A Hugging Face safetensors folder (any shard layout): every parameter must be in it."""
        from safetensors import safe_open

        if not os.path.isdir(path):
            raise UserError(f"model_path {path}: no such directory")
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise UserError(f"model_path {path}: no .safetensors files in it")
        where: dict[str, str] = {}
        for f in files:
            with safe_open(os.path.join(path, f), framework="pt") as st:
                for k in st.keys():
                    where[k] = f
        covered = {id(self.params[a]) for a in where if a in self.params}
        missing = sorted(n for n in self._unique if id(self.params[n]) not in covered)
        if missing:
            raise UserError(f"model_path {path}: {len(missing)} weights of the model are missing, e.g. {missing[:3]}")
        total = 0
        for f in files:
            with safe_open(os.path.join(path, f), framework="pt") as st:
                pairs = []
                for k in st.keys():
                    if k not in self.params:
                        continue  # buffers and extras a checkpoint may hold (rotary inv_freq, ...)
                    t = st.get_tensor(k)
                    pairs.append((k, t.to(self.params[k].dtype)))
            total += self.apply(pairs)
        return total


def is_tidal_folder(path: str) -> bool:
    """A folder tidal's disk transport wrote: a host-local checkpoint brought up to date by ``pull_weights``,
    or a published version whose index metadata names its checksums (or a delta). The engine's own
    loader takes these: it verifies every tensor against its checksum."""
    from tidal.weight_sync import disk_format as fmt
    from tidal.weight_sync.local_checkpoint import is_local_checkpoint

    if not os.path.isdir(path):
        return False
    if is_local_checkpoint(path):
        return True
    meta = fmt.index_metadata(path) or {}
    return "checksum_format" in meta or "delta_encoding" in meta
