"""Checkpoint manifests: a checksum per file, damaged folders named, the newest intact one loaded, pruning."""

from __future__ import annotations

import json
import os

from tidal.checkpoint.manifest import find_loadable, prune, verify, write_manifest


def _iteration(root, n, payload=b"x" * 1000):
    folder = root / f"iter_{n:07d}"
    folder.mkdir(parents=True)
    (folder / "model-00001.safetensors").write_bytes(payload)
    (folder / "meta.json").write_text(json.dumps({"rollout_id": n}))
    write_manifest(str(folder))
    return folder


def test_manifest_names_the_damaged_file(tmp_path):
    folder = _iteration(tmp_path, 1)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model-00001.safetensors", "meta.json"} and verify(str(folder)) is None
    weights = folder / "model-00001.safetensors"
    with open(weights, "r+b") as f:  # one flipped byte, same size
        f.seek(500)
        f.write(b"y")
    assert "model-00001.safetensors does not match its xxh3-128 checksum" in verify(str(folder))
    os.truncate(weights, 10)
    assert "model-00001.safetensors has 10 bytes, the manifest says 1000" in verify(str(folder))
    weights.unlink()
    assert verify(str(folder)) == "model-00001.safetensors is missing"


def test_find_loadable_falls_back_to_the_newest_intact_iteration(tmp_path):
    for n in (1, 2, 3):
        _iteration(tmp_path, n)
    (tmp_path / "latest").write_text("iter_0000003\n")
    assert find_loadable(str(tmp_path)).path == str(tmp_path / "iter_0000003")
    os.truncate(tmp_path / "iter_0000003" / "meta.json", 3)
    found = find_loadable(str(tmp_path))
    assert found.path == str(tmp_path / "iter_0000002")
    assert [(os.path.basename(p), "meta.json" in why) for p, why in found.skipped] == [("iter_0000003", True)]
    # One folder named directly is verified, never replaced by another.
    direct = find_loadable(str(tmp_path / "iter_0000003"))
    assert direct.path is None and direct.skipped[0][0] == str(tmp_path / "iter_0000003")
    # A checkpoint written before manifests (meta.json only) loads unverified.
    (tmp_path / "iter_0000002" / "manifest.json").unlink()
    assert find_loadable(str(tmp_path / "iter_0000002")).path == str(tmp_path / "iter_0000002")


def test_prune_keeps_the_newest(tmp_path):
    for n in (1, 2, 3, 4):
        _iteration(tmp_path, n)
    (tmp_path / ".tmp-iter_0000005-abcd").mkdir()  # a save in progress is not a checkpoint
    removed = prune(str(tmp_path), 2, str(tmp_path / "iter_0000004"))
    assert sorted(os.path.basename(p) for p in removed) == ["iter_0000001", "iter_0000002"]
    assert sorted(os.listdir(tmp_path)) == [".tmp-iter_0000005-abcd", "iter_0000003", "iter_0000004"]
    assert prune(str(tmp_path), 0, "") == []
