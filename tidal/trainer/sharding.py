"""Building and sharding the FSDP2 models of a trainer rank: the policy, the reference and the critic.

Every rank builds the model from the same seed (so the shards agree without a broadcast): on the
host, or with ``--init-on-device`` a preset on the rank's device (its generator draws the same
numbers on every rank of the same GPU model, in a fraction of the host's time), then
``fully_shard`` wraps every decoder layer and the root over the rank's mesh, with fp32 master
parameters and, when the compute dtype is lower, a mixed-precision policy whose all-gathered copy is
in that dtype (gradients reduced in fp32). Only the sharding runs inside the memory backend's
weights region: the full model built on the device is a temporary, freed once the shards exist.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten

from tidal.errors import ConfigError


def mixed_precision(compute_dtype: torch.dtype):
    """FSDP2's policy for a compute dtype: None for fp32, else that dtype gathered and fp32 reduced."""
    if compute_dtype == torch.float32:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def shard(
    model: torch.nn.Module,
    mesh,
    mp,
    model_name: str,
    compile_layers: bool = False,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """FSDP2 on a host model: every decoder layer, then the root (policy, reference and critic alike).

    ``compile_layers``: each layer's ``forward`` goes through ``torch.compile`` (one graph shared by
    every layer: their code is the same and parameters are graph inputs), its inputs' batch and length
    dimensions marked dynamic (``DynamicRowsForward``). Only ``forward`` is replaced, so FSDP2's hooks
    around it (all-gather before, reshard after) stay eager.
    ``reshard_after_forward`` False keeps each layer's gathered compute copy from its forward to its
    backward instead of gathering it again (the trainer's choice on one rank, where the copy is the
    whole model in the compute dtype).
    """
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kw["mp_policy"] = mp
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ConfigError(
            f"--model {model_name}: found no decoder layers to shard (_no_split_modules is empty); "
            "use a transformers causal LM"
        )
    for layer in layers:
        if compile_layers:
            layer.forward = DynamicRowsForward(torch.compile(layer.forward))
        fully_shard(layer, **kw)
    fully_shard(model, **kw)  # moves the remaining (root) parameters onto the device too
    return model


class DynamicRowsForward:
    """A compiled layer ``forward`` whose inputs' batch and length dimensions are marked dynamic at every call
    (``torch._dynamo.maybe_mark_dynamic``), so that its first graph already serves every micro-batch shape.

    Without it Dynamo specialises the first call's graph to that call's sizes and compiles a dynamic one at
    the second shape: the trainer's warm-up paid a whole layer compile (forward and backward) for a graph no
    real micro-batch uses. Which dimensions: at the first call, those of every tensor input (tuples such as
    the rotary ``position_embeddings`` included) whose size is the hidden states' batch or length (the first
    argument, or ``hidden_states`` by name; sizes above 1: Dynamo specialises 0 and 1 anyway). The same
    dimensions are marked at every later call, as Dynamo's guards require (a tensor marked with dimensions its
    graph was not compiled with compiles again); a call whose inputs are laid out otherwise (another argument
    given, one left out) is passed on unmarked. A marked dimension that the graph must specialise (a size equal
    to the model's own) stays specialised, without error."""

    def __init__(self, forward: Callable):
        self.forward = forward
        self.spec = None
        self.dims: list[tuple[int, ...]] = []

    def __call__(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")  # transformers' layers: the first argument
        leaves, spec = tree_flatten((args, kwargs))
        if self.spec is None and isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
            self.spec, self.dims = spec, marked_dims(leaves, tuple(hidden.shape[:2]))
        if spec == self.spec:
            for leaf, dims in zip(leaves, self.dims):
                if dims:
                    torch._dynamo.maybe_mark_dynamic(leaf, list(dims))
        return self.forward(*args, **kwargs)


def marked_dims(leaves: list, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """For each leaf: the dimensions of a tensor whose size is one of ``sizes`` and above 1; () otherwise."""
    wanted = {n for n in sizes if n > 1}
    return [
        tuple(d for d, n in enumerate(leaf.shape) if n in wanted) if isinstance(leaf, torch.Tensor) else ()
        for leaf in leaves
    ]


def build_sharded(
    build_model: Callable,
    spec,
    shard_fn: Callable[[torch.nn.Module], torch.nn.Module],
    *,
    seed: int,
    trainable: bool,
    gradient_checkpointing: bool,
    init_device: str | torch.device = "cpu",
    region: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> torch.nn.Module:
    """Build from the shared seed on ``init_device`` (a preset; a folder loads on the host), then shard
    with ``shard_fn`` inside ``region``; a frozen model is in eval mode."""
    device = init_device if spec.is_preset else "cpu"
    model = build_model(spec, dtype=torch.float32, seed=seed, device=device)
    model.config.use_cache = False
    if trainable and gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    with region():
        sharded = shard_fn(model)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the full model's blocks, now that the shards hold their own copies
    return sharded
