"""CUDA graphs of the decode step: capture once per (batch bucket, KV length, sampling mode), replay.

A decode step of a small model is hundreds of small kernels; launched from Python one by one, the
launches, not the GPU, set the pace. A captured graph launches them all at once. What makes a step
capturable (see ``tidal.rollout.fast.decode``): every input and output lives in a static buffer
that the step reads and writes in place, shapes depend only on the key, nothing reads a tensor value
on the host.

Capture runs the step twice on a side stream first (cuBLAS and allocator warm-up, the documented
recipe); those runs really execute and mutate the decoder state, so the state tensors are copied
before and restored after, and the device RNG state too, so that a call samples the same tokens
whether its graphs were captured during the call or before it. All graphs share one memory pool:
their temporaries never outlive a replay and steps never run concurrently, so one pool sized by
the largest step serves them all.

Validity: a graph holds raw device addresses (weights, cache, state buffers). ``GraphSet`` keeps a
signature of those addresses; when it changes (a memory backend freed and re-allocated them) every
graph is dropped and recaptured on demand. A pause that keeps virtual addresses (torch_memory_saver)
keeps the graphs.

A failed capture turns graphs off for good with one log line; the reason is kept for the benchmark.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Sequence

import torch

log = logging.getLogger(__name__)


class GraphSet:
    """Captured decode steps by key, on one CUDA device."""

    def __init__(
        self,
        device: torch.device,
        *,
        warmup: int = 2,
        rehearse: bool = False,
        generator: torch.Generator | None = None,
        region: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        self.device = device
        self.warmup = warmup
        # Without CUDA: run the capture's warm-up and restore (not the capture) before the first
        # eager step of each key, so that CPU tests check that the restore leaves no trace.
        self.rehearse = rehearse
        self.generator = generator
        self.rehearsed: set[Hashable] = set()
        # Captures run inside this context (a memory backend's kv_cache region), so that with
        # torch_memory_saver the graphs' pool pauses with the cache (see FastDecoder.graphs_in_region).
        self.region = region or contextlib.nullcontext
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.signature: tuple[int, ...] = ()
        self.enabled = device.type == "cuda"
        self.fallback_reason: str | None = None if self.enabled else f"device {device.type} has no CUDA graphs"
        self.captures = 0
        self.capture_s = 0.0

    def clear(self) -> None:
        """Drop every graph and the pool (their memory returns to the allocator)."""
        self.graphs.clear()
        self.rehearsed.clear()
        self.pool = None
        self.signature = ()

    def check(self, signature: tuple[int, ...]) -> None:
        """Drop graphs captured against addresses that no longer hold the same tensors."""
        if self.graphs and signature != self.signature:
            log.info(
                "fast decode: %d CUDA graphs dropped (device memory was re-allocated); recapturing", len(self.graphs)
            )
            self.clear()
        self.signature = signature

    def disable(self, reason: str) -> None:
        if self.enabled:
            log.warning("fast decode: CUDA graphs off, decoding eagerly (%s)", reason)
        self.enabled = False
        self.fallback_reason = reason
        self.clear()

    def run(self, key: Hashable, step: Callable[[], None], state: Sequence[torch.Tensor]) -> None:
        """Replay the graph of ``key``, capturing it first; eager ``step()`` when graphs are off."""
        if not self.enabled:
            if self.rehearse and key not in self.rehearsed:
                restore, rng = self._snapshot(state)
                for _ in range(self.warmup):
                    step()
                    restore()
                self._set_rng(rng)
                self.rehearsed.add(key)
            step()
            return
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(key, step, state)
            if graph is None:
                step()
                return
        graph.replay()

    def _snapshot(self, state: Sequence[torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """A function that puts ``state`` back as it is now, and the RNG state now."""
        saved = [t.clone() for t in state]

        def restore() -> None:
            for dst, src in zip(state, saved):
                dst.copy_(src)

        if self.generator is not None:
            return restore, self.generator.get_state()
        return restore, torch.cuda.get_rng_state(self.device)

    def _set_rng(self, rng: torch.Tensor) -> None:
        if self.generator is not None:
            self.generator.set_state(rng)
        else:
            torch.cuda.set_rng_state(rng, self.device)

    def _capture(self, key: Hashable, step: Callable[[], None], state: Sequence[torch.Tensor]):
        t0 = time.perf_counter()
        restore, rng = self._snapshot(state)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    step()
                    restore()
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with self.region(), torch.cuda.graph(graph, pool=self.pool):
                step()
        except Exception as exc:  # any failure: decode eagerly, keep the reason for the report
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # a broken capture may leave an error pending; eager steps will surface it
                pass
            restore()
            self._set_rng(rng)
            self.disable(
                f"capture of {key} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            )
            return None
        restore()
        self._set_rng(rng)
        torch.cuda.synchronize(self.device)
        self.graphs[key] = graph
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return graph
