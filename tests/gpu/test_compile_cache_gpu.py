"""torch.compile's caches under ``--compile-cache-dir``: a second process reuses what the first compiled.

Run on the GPU host: ``pytest -m gpu tests/gpu/test_compile_cache_gpu.py -s``. Two fresh processes
build the compiled fast decoder on tiny-qwen2 with the same empty cache folder (``tidal.compile_cache.use``)
and generate greedily: the first misses inductor's FX graph cache and fills the folder, the second
hits it for every graph and misses none, compiles in less time, and samples the same tokens.
(On the 2-core CPU machines one cold inductor compile of even a one-line function takes 1-2 minutes,
so this check runs here, where the decode step is compiled for real.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

_PROBE = r"""
import json, sys, time
from tidal.compile_cache import use
use(sys.argv[1])
import torch
from torch._dynamo.utils import counters
from tidal.model import build_model, resolve_model
from tidal.rollout.fast import FastDecoder

model = build_model(resolve_model("tiny-qwen2"), dtype=torch.float32, seed=0, device="cuda").eval().requires_grad_(False)
dec = FastDecoder(model, max_batch=16, max_seq_len=64, kv_block=32, compile=True)
prompts = [[3 + (i * 7 + j) % 60 for j in range(5 + i)] for i in range(12)]
t0 = time.perf_counter()
res = dec.generate(prompts, max_new_tokens=20, temperature=0)
print(json.dumps({
    "first_call_s": time.perf_counter() - t0,
    "compiled": res.stats["compiled"],
    "fallback": res.stats["compile_fallback_reason"],
    "hit": counters["inductor"]["fxgraph_cache_hit"],
    "miss": counters["inductor"]["fxgraph_cache_miss"],
    "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
    "tokens": res.tokens,
}))
"""


def _probe(cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_CACHE"))}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, cache], capture_output=True, text=True, env=env, timeout=300, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_second_process_reuses_the_compile_cache(tmp_path):
    cache = str(tmp_path / "compile")
    cold = _probe(cache)
    warm = _probe(cache)
    for tag, r in (("cold", cold), ("warm", warm)):
        print(
            f"[{tag}] first call {r['first_call_s']:.1f} s, fx graph hits {r['hit']} misses {r['miss']}, aot hits {r['aot_hit']}"
        )
    assert cold["compiled"] and warm["compiled"], (cold["fallback"], warm["fallback"])
    # The cold process compiles (misses) and may hit an entry it wrote itself a moment before (a graph compiled
    # twice in one process: 1 of 8 on the H200); the warm one misses nothing.
    assert cold["miss"] > 0 and cold["hit"] < warm["hit"]
    assert warm["hit"] >= cold["miss"] and warm["miss"] == 0
    assert os.listdir(os.path.join(cache, "inductor"))
    assert warm["tokens"] == cold["tokens"]
    assert warm["first_call_s"] < cold["first_call_s"]
