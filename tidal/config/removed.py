"""Flags that tidal no longer accepts, with the version that removed them and what to use instead.

Removing a flag is the moment stale scripts go wrong: slime's PR #2249 dropped
``--train-memory-margin-bytes`` and every old launch script kept passing it, silently ignored.
tidal rejects a removed flag (on the command line or as a key of a config file) with the message
recorded here, and a unit test checks that no doc, example, preset or script still uses one.

To remove a flag: delete the field from ``schema.py``, add an entry below, run
``python -m tidal.config.docs --write`` to refresh the generated docs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemovedFlag:
    flag: str  # "--kebab-case" as users typed it
    version: str  # tidal version that removed it
    reason: str
    instead: str  # what to do now

    @property
    def key(self) -> str:
        """The config-file key (snake_case) of the flag."""
        return self.flag.lstrip("-").replace("-", "_")

    def message(self) -> str:
        return f"{self.flag} was removed in tidal {self.version}: {self.reason}; {self.instead}"


REMOVED: tuple[RemovedFlag, ...] = (
    RemovedFlag(
        flag="--train-memory-margin-bytes",
        version="0.1.0",
        reason="torch_memory_saver's allocation margin guard is off by default and tidal checks device memory budgets before start instead",
        instead="delete the flag (run `tidal explain` to see the memory plan per rank)",
    ),
    RemovedFlag(
        flag="--train-grads-backup",
        version="0.1.0",
        reason="it changed nothing: gradients are zeroed at the start of every step, so a paused trainer never backs them up",
        instead="delete the flag",
    ),
)


def find_removed(name: str) -> RemovedFlag | None:
    """The registry entry for a flag (``--x-y``) or config key (``x_y`` / ``x-y``), if it was removed."""
    key = name.split("=", 1)[0].lstrip("-").replace("-", "_")
    for entry in REMOVED:
        if entry.key == key:
            return entry
    return None
