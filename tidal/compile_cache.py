"""Where torch.compile keeps what it compiled, so that a run after the first skips most of it.

The decode step and the log-prob kernels go through ``torch.compile``; the first run on a host pays
for inductor's code generation and triton's kernel builds (seconds to tens of seconds). torch keeps
the results in caches keyed by the graph, the inputs' shapes and the environment: the FX graph
cache and the AOTAutograd cache under ``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_<user>``,
which a reboot or a fresh machine empties) and triton's kernels under it too, unless
``TRITON_CACHE_DIR`` says otherwise. ``--compile-cache-dir`` (default ``~/.cache/tidal/compile``)
points them at a folder that lives as long as the user's home, and turns both graph caches on.

``cache_env(path)`` is the environment for the actors' processes (the session adds it to a local
cluster's worker environment, so it is set before any of them imports torch); ``use(path)`` applies
it to the current process (benchmarks that compile in-process). An empty path leaves torch's
defaults alone. A variable already set in the environment wins: the user chose it.

``freeze_if_compiled(before)``: what a compiled call leaves behind (graphs, guards, caches) lives for the
whole run; after a call that compiled it leaves the garbage collector's generations, so that a later
``gc.collect()`` (every trainer pause with offload runs one) does not walk it again.
"""

from __future__ import annotations

import gc
import os

DEFAULT = "~/.cache/tidal/compile"


def cache_env(path: str | None) -> dict[str, str]:
    """The variables that point torch.compile's caches at ``path`` (none for an empty path)."""
    if not path:
        return {}
    root = os.path.abspath(os.path.expanduser(path))
    wanted = {
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }
    return {k: os.environ.get(k, v) for k, v in wanted.items()}


def use(path: str | None) -> dict[str, str]:
    """Apply ``cache_env(path)`` to this process (before its first compile); returns what was set."""
    env = cache_env(path)
    os.environ.update(env)
    if env:
        os.makedirs(env["TORCHINDUCTOR_CACHE_DIR"], exist_ok=True)
    return env


def compile_seconds() -> tuple[float, float]:
    """Seconds this process has spent in ``torch.compile`` so far: in all (Dynamo's tracing, the backend and
    guards) and in the backend alone (AOTAutograd and inductor: code generation, or reading this module's
    caches). Taken from torch's own compile-time counters, so a difference of two readings says how much of
    a span was compiling; (0, 0) where torch does not keep them."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as metrics
    except ImportError:
        return 0.0, 0.0
    return (
        float(sum(metrics.get("_compile.compile_inner", ()))),
        float(sum(metrics.get("OutputGraph.call_user_compiler", ()))),
    )


def freeze_if_compiled(before: float) -> bool:
    """When this process has compiled since ``compile_seconds()[0]`` read ``before``: collect the garbage, then
    freeze what survived (``gc.freeze``), and return True. The survivors are mostly the compiled graphs, their
    guards and caches, which live for the whole run; left in the collector, every later ``gc.collect()`` walks
    them again (a trainer that compiled its layers on the 2-core CPU: 129k objects, 62-93 ms a collect,
    against 0 frozen). A call that compiled nothing changes nothing."""
    if compile_seconds()[0] <= before:
        return False
    gc.collect()
    gc.freeze()
    return True
