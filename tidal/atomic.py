"""Atomic publication of files and folders: a reader sees the old version or the new one, never a mix.

Everything is written under a temporary name next to its target, fsynced, then renamed into place
(``os.replace`` is atomic on one filesystem); the parent directory is fsynced after the rename so
the new name survives a crash. Checkpoints, weight-sync versions and run files publish this way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a filesystem that cannot fsync directories is left as it is)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_bytes_atomic(path: str, data: bytes | memoryview) -> None:
    """Write ``path`` through a temp file and ``os.replace`` (readers see the old or the new bytes)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def write_text_atomic(path: str, text: str) -> None:
    """``write_bytes_atomic`` of UTF-8 text."""
    write_bytes_atomic(path, text.encode())


def publish_dir(tmp: str, final: str) -> None:
    """Move a finished temp folder to ``final``, replacing an older folder of that name.

    The temp folder is fsynced first; an older ``final`` is moved aside (``.old-<name>-<random>``)
    before the rename and deleted after, so ``final`` always names a complete folder.
    """
    fsync_path(tmp)
    old = None
    if os.path.exists(final):
        old = os.path.join(os.path.dirname(final), f".old-{os.path.basename(final)}-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))
    if old:
        shutil.rmtree(old, ignore_errors=True)
