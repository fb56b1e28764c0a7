"""A pause request for the embedded engine that arrives on its ``k``-th check of ``paused``: a pause from another
thread, made deterministic. Shared by ``tests/unit/test_engine.py`` (CPU) and ``tests/gpu/test_async_gpu.py``
(CUDA); importable from both as ``serve_process`` is (the folder of ``tests/conftest.py`` is on the path)."""

from __future__ import annotations


class PauseAfter:
    """Stands in for the engine's ``paused`` event: ``is_set()`` is true from its ``k``-th call on."""

    def __init__(self, k: int):
        self.k, self.calls = k, 0

    def is_set(self) -> bool:
        self.calls += 1
        return self.calls >= self.k
