"""Load user code named on the command line: ``--custom-rm-path``, ``--custom-generate-function-path``.

A path is ``package.module:function`` (preferred), ``package.module.function`` (the last dot
splits), or ``path/to/file.py:function`` for a file that is not on ``sys.path``. Attributes may be
nested after the colon (``module:Class.method``). Every failure is a ``UserError`` that names the
flag, what was missing and what to do, instead of an import traceback.

Signatures the rest of tidal calls:

* reward (``--custom-rm-path``): ``fn(prompt, response_text, label) -> float``, a plain (not async)
  function; ``prompt`` and ``label`` are the dataset row's values, ``response_text`` is the decoded
  response. See ``tidal.rollout.rewards``.
* generate (``--custom-generate-function-path``): ``fn(engine, samples, sampling) -> samples``,
  called inside the engine actor instead of ``engine.generate``; ``engine`` is the in-process
  ``tidal.rollout.embedded.EmbeddedEngine`` (only the embedded engine runs these), ``samples`` a
  list of ``Sample`` with ``prompt_ids`` set, ``sampling`` the ``SamplingParams``. It must return samples with response ids, log-probs, text and
  status filled (typically by calling ``engine.generate`` on some of them, possibly several times).
  Tokens it adds that the policy did not generate (tool output) get ``loss_mask`` 0 and a 0.0
  log-prob placeholder (``tidal.rollout.types.Sample``); they are not trained.

Because engines are Ray actors in other processes, a module path must be importable there too
(installed, or on ``PYTHONPATH``); a file path must exist at the same location on every host.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType

from tidal.errors import UserError


def _split(path: str, what: str) -> tuple[str, list[str]]:
    """(module or file, attribute chain) of a callable path."""
    if ":" in path:
        # A Windows drive letter ("C:\\x.py:f") would be a second colon; split at the last one.
        mod, _, attr = path.rpartition(":")
    elif "." in path and not path.endswith(".py"):
        mod, _, attr = path.rpartition(".")
    else:
        raise UserError(
            f"{what} {path!r}: expected module:function (e.g. my_rewards:score) or path/to/file.py:function"
        )
    if not mod or not attr:
        raise UserError(
            f"{what} {path!r}: expected module:function (e.g. my_rewards:score) or path/to/file.py:function"
        )
    return mod, attr.split(".")


def _import_file(file: str, what: str, path: str) -> ModuleType:
    if not os.path.isfile(file):
        raise UserError(
            f"{what} {path!r}: file {file} does not exist; give an existing .py file or an importable module"
        )
    name = "tidal_user_" + os.path.splitext(os.path.basename(file))[0]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise UserError(f"{what} {path!r}: cannot load {file} as a Python module; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's module failed while executing its top level
        sys.modules.pop(name, None)
        raise UserError(f"{what} {path!r}: running {file} failed with {type(e).__name__}: {e}; fix that file") from e
    return module


def _import_module(mod: str, what: str, path: str) -> ModuleType:
    try:
        return importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name and (mod == e.name or mod.startswith(e.name + ".")):
            raise UserError(
                f"{what} {path!r}: no module named {e.name!r}; install it or add its folder to PYTHONPATH"
            ) from e
        raise UserError(f"{what} {path!r}: importing {mod} failed: {e}; install what it imports") from e
    except Exception as e:
        raise UserError(f"{what} {path!r}: importing {mod} failed with {type(e).__name__}: {e}; fix that module") from e


def load_callable(path: str, what: str = "--custom-rm-path") -> Callable:
    """The callable named by ``path`` (see the module docstring for the accepted forms)."""
    if not isinstance(path, str) or not path.strip():
        raise UserError(f"{what}: empty path; expected module:function (e.g. my_rewards:score)")
    path = path.strip()
    mod, attrs = _split(path, what)
    module = _import_file(mod, what, path) if mod.endswith(".py") else _import_module(mod, what, path)
    obj: object = module
    for i, attr in enumerate(attrs):
        if not hasattr(obj, attr):
            owner = mod if i == 0 else ".".join([mod, *attrs[:i]])
            raise UserError(f"{what} {path!r}: {owner} has no attribute {attr!r}; check the spelling after the colon")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise UserError(
            f"{what} {path!r}: {'.'.join(attrs)} is a {type(obj).__name__}, not a function; name a function"
        )
    return obj
