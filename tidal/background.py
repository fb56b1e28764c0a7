"""One call run in a daemon thread, its value or exception handed back through a future.

The driver overlaps slow work it does not wait for at once (reading the inputs beside Ray's start,
matplotlib's import, chart redraws, the run directory's last charts) with the run; each is one such
call. A daemon thread, so that a call still running never holds up the process's exit.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable


def in_background(fn: Callable[..., object], *args, name: str = "tidal-background") -> concurrent.futures.Future:
    """``fn(*args)`` in a daemon thread named ``name``; ``.result()`` returns its value or raises its exception."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller of .result()
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
