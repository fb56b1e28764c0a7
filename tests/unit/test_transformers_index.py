"""transformers' index of its lazy modules from a file (``tidal.cluster.transformers_index``).

Against transformers' own builder: the index of a small models folder is what the builder returns, comes back
from the file without building, as a fresh copy, with its subfolders' indexes too; a changed file builds it
again. In a fresh process (as the warm process imports), ``install`` wraps the builder and ``transformers`` then
exposes the same lazy modules and names as the test's own, unwrapped, import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import transformers.utils.import_utils as import_utils

from tidal.cluster.transformers_index import FUNCTION, Index


def _models(root):
    (root / "alpha").mkdir(parents=True)
    (root / "beta").mkdir()
    for path, text in {
        "__init__.py": "",
        "alpha/__init__.py": "",
        "alpha/configuration_alpha.py": '__all__ = ["AlphaConfig"]\n',
        "alpha/modeling_alpha.py": '__all__ = ["AlphaModel", "AlphaPreTrainedModel"]\n',
        "beta/__init__.py": "",
        "beta/configuration_beta.py": '__all__ = ["BetaConfig"]\n',
    }.items():
        (root / path).write_text(text)


def test_the_index_is_transformers_own_kept_in_a_file_and_rebuilt_when_a_file_changes(tmp_path, monkeypatch):
    builder = getattr(import_utils, FUNCTION)
    builder = getattr(builder, "__wrapped__", builder)
    if isinstance(builder, Index):  # this process imported transformers under the wrapper
        builder = builder.build
    builds = []

    def build(path):
        builds.append(os.path.basename(path))
        return builder(path)

    models = tmp_path / "models"
    _models(models)
    want = builder(str(models))
    assert want["alpha"] and want["beta"]  # the builder saw the folders' exports
    cache = tmp_path / "cache"

    def index() -> Index:  # in the builder's place, as install() puts it: its calls for subfolders come here too
        made = Index(build, str(cache))
        monkeypatch.setattr(import_utils, FUNCTION, made)
        return made

    assert index()(str(models)) == want
    assert sorted(builds) == ["alpha", "beta", "models"] and len(list(cache.iterdir())) == 1
    builds.clear()
    again = index()
    first = again(str(models / "__init__.py"))  # as models/__init__.py asks for it
    assert first == want and builds == []  # from the file
    second = again(str(models))
    assert second == want and second is not first  # a fresh copy at each call, as the builder makes one
    assert again(str(models / "alpha" / "__init__.py")) == builder(str(models / "alpha")) and builds == []
    (models / "beta" / "configuration_beta.py").write_text('__all__ = ["BetaConfig", "BetaExtra"]\n')
    changed = index()(str(models))
    assert "models" in builds and changed == builder(str(models)) != want


FRESH = textwrap.dedent(
    """
    import json, sys
    from tidal.cluster import transformers_index
    assert transformers_index.install()
    import transformers.models.llama.modeling_llama
    import transformers.utils.import_utils as import_utils
    assert isinstance(getattr(import_utils, transformers_index.FUNCTION), transformers_index.Index)
    lazy = sys.modules["transformers"]
    print(json.dumps({"classes": sorted(lazy._class_to_module.items()), "modules": sorted(lazy._modules)}))
    """
)


def test_a_process_that_installs_it_sees_the_lazy_modules_transformers_builds(tmp_path):
    import transformers

    env = {**os.environ, "TIDAL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["classes"] == [list(kv) for kv in sorted(transformers._class_to_module.items())]
    assert seen["modules"] == sorted(transformers._modules) and "models" in seen["modules"]
    assert [p.name.startswith("transformers-index-") for p in tmp_path.iterdir()] == [True]
