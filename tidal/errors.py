"""User-facing errors.

Anything the user can fix (a bad flag, a missing file, an unreadable dataset row, a reward function
that raises) is raised as ``UserError`` with one line that names the problem and the fix. The CLI
prints it as ``tidal: error: <message>`` and exits with code 2, without a traceback. Everything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """A problem the user can fix; the message is one line naming what was wrong and what to do."""

    exit_code = 2


class ConfigError(UserError):
    """A flag, config file or flag combination that cannot work."""


class ResidencyError(RuntimeError):
    """An illegal memory transition (double pause, sync into a released engine, ...).

    Raised before torch_memory_saver would terminate the process. This is a bug in the caller's
    order of operations, not a user error.
    """


class WeightSyncError(RuntimeError):
    """A weight sync that could not be completed or verified (checksum mismatch after retry, ...)."""


def ray_get(refs: Any) -> Any:
    """``ray.get`` that re-raises a UserError raised inside an actor as itself (printed as one line, not a
    remote traceback)."""
    import ray
    from ray.exceptions import RayTaskError

    try:
        return ray.get(refs)
    except RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, UserError):
            raise cause from None
        raise


class RunFailed(UserError):
    """The run cannot go on (engines that keep dying, a trainer rank that died); one line, exit 1.

    The message names what failed and how to continue (e.g. the checkpoint to ``--load`` from).
    """

    exit_code = 1


class EngineDiedError(RuntimeError):
    """A rollout engine that died, or stopped answering, mid-run: the driver restarts it and re-runs its work."""


def is_engine_death(exc: BaseException) -> bool:
    """An engine actor that died, or an HTTP engine whose server stopped answering."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, (RayActorError, EngineDiedError)):
        return True
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        return cause is not None and cause is not exc and is_engine_death(cause)
    return False


def last_line(e: BaseException) -> str:
    """The last line of an error's message (its type name when empty): the cause of a remote error,
    since Ray puts a traceback header before the message of an exception raised in an actor."""
    lines = str(e).strip().splitlines()
    return lines[-1] if lines else type(e).__name__
