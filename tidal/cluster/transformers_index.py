"""transformers' index of its lazy modules, read from a file instead of rebuilt by every process that imports it.

``import transformers`` (and so any of its model modules) builds from the source of every file under
``transformers/models`` (~3,300 files) which names each module exports:
``transformers.utils.import_utils.create_import_structure_from_path`` reads them all and matches their
``__all__``. Two calls need it (``transformers/__init__.py`` and ``transformers/models/__init__.py``), and its
in-memory cache holds 128 folders, fewer than the ~450 model folders, so the second call reads everything
again: ~0.6 s of CPU per import on a small host, on the start's critical path in the warm process
(``tidal.cluster.warm``), whose imports the first step waits for.

``install()`` (before transformers is imported) wraps that function once ``import_utils`` is loaded: a
folder's index is kept in memory for the process, and the index of a top-level folder in a file under
``$TIDAL_CACHE`` (default ``~/.cache/tidal``) with the size and modification time of every file and folder
it was built from; any difference (another transformers, an edited file) builds it again. The wrapper
returns what transformers' own function returns; should a release rename or change it, nothing is wrapped.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import pickle
import sys
import tempfile

log = logging.getLogger(__name__)

MODULE = "transformers.utils.import_utils"
FUNCTION = "create_import_structure_from_path"
FORMAT = 1  # bump when what the file holds changes


def cache_folder() -> str:
    return os.environ.get("TIDAL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tidal")


def fingerprint(folder: str) -> str:
    """A digest of the name, size and modification time of every file and folder under ``folder`` (without
    ``__pycache__``): what the index is built from."""
    digest = hashlib.blake2b(digest_size=16)
    stack = [folder]
    while stack:
        here = stack.pop()
        with os.scandir(here) as entries:
            for e in sorted(entries, key=lambda e: e.name):
                if e.name == "__pycache__":
                    continue
                st = e.stat(follow_symlinks=False)
                digest.update(f"{e.path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
    return digest.hexdigest()


class Index:
    """The wrapped function. A top-level folder's index comes from its file (or is built and saved), as a fresh
    copy at each call, as transformers' own function builds one; subfolders' are kept in memory for the process."""

    def __init__(self, build, folder: str | None = None):
        self.build = build  # transformers' own function, its lru_cache left out
        self.folder = folder or cache_folder()
        self.memo: dict[str, object] = {}  # subfolders (built, or parts of a top-level folder's first copy)
        self.saved: dict[str, bytes] = {}  # top-level folders: their pickled index
        self.prints: dict[str, str] = {}
        self.depth = 0  # > 0 while building: the recursive calls for subfolders

    def __call__(self, module_path):
        path = os.path.abspath(os.fspath(module_path))
        if os.path.isfile(path):
            path = os.path.dirname(path)
        if self.depth or (path in self.memo and path not in self.saved):
            return self.memo[path] if path in self.memo else self._build(path)
        blob = self.saved.get(path) or self._read(path)
        if blob is None:
            structure = self._build(path)
            blob = pickle.dumps(structure, protocol=pickle.HIGHEST_PROTOCOL)
            self._write(path, blob)
            self.saved[path] = blob
            return structure
        first = path not in self.saved
        self.saved[path] = blob
        structure = pickle.loads(blob)
        if first:
            self._remember(path, structure)
        return structure

    def _build(self, path: str):
        self.depth += 1
        try:
            out = self.build(path)
        finally:
            self.depth -= 1
        self.memo[path] = out
        return out

    def _remember(self, path: str, structure) -> None:
        """The subfolders' indexes are parts of their parent's (the same objects, as transformers builds them)."""
        for name, sub in structure.items():
            if isinstance(name, str) and isinstance(sub, dict) and os.path.isdir(os.path.join(path, name)):
                self.memo[os.path.join(path, name)] = sub
                self._remember(os.path.join(path, name), sub)

    def _fingerprint(self, path: str) -> str:
        if path not in self.prints:
            self.prints[path] = fingerprint(path)
        return self.prints[path]

    def _file(self, path: str) -> str:
        name = hashlib.blake2b(path.encode(), digest_size=8).hexdigest()
        return os.path.join(self.folder, f"transformers-index-{name}.pkl")

    def _read(self, path: str) -> bytes | None:
        try:
            with open(self._file(path), "rb") as f:
                saved = pickle.load(f)
            if (saved["format"], saved["path"], saved["fingerprint"]) == (FORMAT, path, self._fingerprint(path)):
                return saved["index"]
        except (OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError):
            pass
        return None

    def _write(self, path: str, blob: bytes) -> None:
        """Whole or not at all (another process may read it meanwhile); a folder that cannot be written: no file."""
        tmp = None
        try:
            os.makedirs(self.folder, exist_ok=True)
            saved = {"format": FORMAT, "path": path, "fingerprint": self._fingerprint(path), "index": blob}
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".transformers-index-")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(saved, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self._file(path))
        except OSError:
            log.debug("transformers index not saved", exc_info=True)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


def wrap(module) -> bool:
    """Put an ``Index`` in place of ``module``'s function (True), unless it is not the one this wraps."""
    fn = getattr(module, FUNCTION, None)
    build = getattr(fn, "__wrapped__", fn)  # transformers' lru_cache around it
    try:
        params = list(inspect.signature(build).parameters)
    except (TypeError, ValueError):
        return False
    if not callable(build) or params != ["module_path"] or isinstance(fn, Index):
        return False
    setattr(module, FUNCTION, Index(build))
    return True


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``import_utils`` as Python would, and wraps its function right after the module runs."""

    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            wrap(module)

        loader.exec_module = exec_module
        return spec


def install() -> bool:
    """Wrap transformers' index builder when it is first imported (False: transformers is already imported)."""
    if MODULE in sys.modules or "transformers" in sys.modules:
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
