"""Safe stops: SIGTERM (how schedulers preempt a job) ends a run at its next safe point.

A scheduler (Slurm, Kubernetes, a cloud's spot reclaim) sends SIGTERM and waits a grace period before
SIGKILL. ``StopSignal`` turns SIGTERM into a flag: the phase in flight (generate, train, sync) runs to
its end, and the loop, at the top of its next step, writes a checkpoint of the last finished step
when ``--save`` is set, stops every actor and exits with code 143 (128 + SIGTERM), printing one line.
A second SIGTERM stops at once (no checkpoint). Ctrl-C (SIGINT) keeps stopping at once with code 130.

Ray's driver installs its own SIGTERM handler (exit at once) in ``ray.init``, so the handler here is
installed after Ray has started and put back when the run ends.

Ray's own processes (raylet, GCS, workers) are started with SIGINT ignored (``shielded``): Ctrl-C in
a terminal signals the whole foreground process group, and then reaches only the driver, which stops
the actors itself, instead of interrupting every actor mid-call and printing their tracebacks. (Ray
workers install their own SIGTERM handler, so a SIGTERM to the whole process group still reaches
them; schedulers that signal the job's main process, as Kubernetes and ``kill PID`` do, get the safe
stop.)
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

SIGTERM_EXIT = 128 + signal.SIGTERM


class Stopped(Exception):
    """The run stopped on a signal; ``exit_code`` and a one-line message for the console."""

    def __init__(self, message: str, exit_code: int = SIGTERM_EXIT):
        super().__init__(message)
        self.exit_code = exit_code


class StopSignal:
    """SIGTERM -> ``requested``; the loop checks it between steps. A second SIGTERM raises ``Stopped`` at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None
        self._installed = False

    def install(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread() and not self._installed:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise Stopped("SIGTERM again: stopped at once, no checkpoint written")
        self.requested = True


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Ignore SIGINT while processes are spawned, so the children inherit "ignored" (Python keeps it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT,)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
