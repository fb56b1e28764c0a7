"""A checkpoint written by an earlier tidal (format 1, ``fixtures/checkpoint_v1``) still loads and continues.

The fixture was saved by a 2-rank tiny trainer after one rollout; ``expected.json`` holds the
checksums of its fp32 weights and AdamW moments at the save and the metrics of the two rollouts the
saving trainer trained next. Loading must give back exactly those bytes, and training the same
samples must follow the same curve (to float tolerance: the fixture may come from another CPU).
"""

from __future__ import annotations

import json
import math
import os
import shutil

from test_trainer import call, make_samples, start_group

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "checkpoint_v1")


def test_format1_checkpoint_loads_and_continues_the_curve(ray_cluster, tmp_path):
    ray = ray_cluster
    with open(os.path.join(FIXTURE, "expected.json")) as f:
        expected = json.load(f)
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(FIXTURE, "ckpt"), ckpt)

    b = start_group(ray)
    try:
        extra = call(ray, b, "load", ckpt)[0]
        assert extra["data"] == {"epoch": 0, "offset": 8} and extra["rollout_id"] == 0
        state = call(ray, b, "state_checksums")[0]
        assert state == expected["state"], [k for k in expected["state"] if expected["state"][k] != state.get(k)]
        curve = [call(ray, b, "train", make_samples(seed), rid)[0] for rid, seed in ((1, 11), (2, 12))]
    finally:
        for x in b:
            ray.kill(x)
    for rid, (want, got) in enumerate(zip(expected["curve"], curve), start=1):
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=1e-4, abs_tol=1e-6), (rid, key, got[key], value)
