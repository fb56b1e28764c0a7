"""Multi-turn generation throughput with and without prefix reuse, on one in-process embedded engine.

Run: ``tidal bench multiturn`` (CPU default: tiny preset, 32 trajectories x 4 turns, 64-token
prompts, 16-token observations, 8 new tokens a turn), or on a GPU ``tidal bench multiturn --shape
qwen2.5-0.5b-shape --trajectories 256 --turns 4 --prompt-len 512 --obs-len 128 --new-tokens 64``.

The agent loop (``tidal.rollout.agent``) drives the engine against a synthetic environment that
answers every policy turn with ``--obs-len`` random token ids and never ends a trajectory early, so
every trajectory runs ``--turns`` turns and the context grows by ``new + obs`` tokens a turn. Each
round is timed twice on the same engine, the same prompts and the same seeds: with the fast path's
prefix store off (every turn prefills its whole context) and on (``--rollout-prefix-cache-mb``:
each turn prefills only the previous response and the observation). One warm-up round each first
(compilation, CUDA graphs), then ``--repeats`` rounds in turns, so a change of load hits both alike;
the fastest of each counts.

Prints one JSON line: ``policy_tokens_per_s_reuse`` / ``_no_reuse`` (policy tokens generated over
the wall time of the whole agent loop), ``speedup`` (reuse over no reuse), the engine's prefill
seconds of each (``prefill_s_*``, summed over the turns), the fraction of context tokens whose
prefill was skipped (``reused_frac``), and ``same_tokens``: whether both produced the same
trajectories (greedy decoding; bf16 on CUDA may differ in a late token, which is reported, not
raised).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from tidal.rollout.env import Environment, StepResult


class RandomReplies(Environment):
    """Replies with ``obs_len`` random ids (seeded by trajectory and turn); never done."""

    role = "env"
    obs_len = 16
    pool: list[int] = []

    def reset(self, sample):
        self.index = sample.index
        return None

    def step(self, action):
        gen = torch.Generator().manual_seed(1000 * self.index + action.turn)
        pick = torch.randint(len(self.pool), (self.obs_len,), generator=gen)
        return StepResult([self.pool[i] for i in pick.tolist()], 0.0, False)


def _engine(args, device: str):
    from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig
    from tidal.rollout.embedded import EmbeddedEngine

    rollout = RolloutConfig(
        rollout_max_batch=args.trajectories,
        rollout_compile=None if device.startswith("cuda") and not args.no_compile else False,
        rollout_prefix_cache_mb=args.prefix_cache_mb,
    )
    return EmbeddedEngine(ModelConfig(model=args.shape), rollout, MemoryConfig(), device=device)


def _loop(args, engine):
    from tidal.config.schema import TidalConfig
    from tidal.rollout.agent import AgentLoop

    cfg = TidalConfig()
    cfg.rollout = dataclasses.replace(
        cfg.rollout, max_turns=args.turns, max_trajectory_tokens=args.turns * (args.new_tokens + args.obs_len)
    )
    cfg.data = dataclasses.replace(cfg.data, apply_chat_template=False)
    text = engine.model.config.get_text_config()
    return AgentLoop("bench", RandomReplies, cfg, engine.tokenizer, text.max_position_embeddings, text.vocab_size)


def _samples(args, pool: list[int]):
    from tidal.rollout.types import Sample

    gen = torch.Generator().manual_seed(args.seed)
    return [
        Sample(index=i, group=i, prompt="", prompt_ids=[pool[j] for j in torch.randint(len(pool), (args.prompt_len,), generator=gen).tolist()])
        for i in range(args.trajectories)
    ]  # fmt: skip


def _round(args, engine, loop, pool, store) -> dict:
    from tidal.rollout.types import SamplingParams

    dec = engine._decoder()
    dec.prefixes = store
    if store is not None:
        store.clear()
        store.hits = store.lookups = store.reused_tokens = store.prefilled_tokens = 0
    prefill = [0.0]

    def generate(reqs, sp):
        out = engine.generate(reqs, sp)
        prefill[0] += dec.last_stats.get("prefill_s", 0.0)
        return out

    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, stop_token_ids=[], seed=args.seed)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = loop.run(generate, _samples(args, pool), sp)
    seconds = time.perf_counter() - t0
    policy = sum(x.num_policy_tokens for x in out)
    return {
        "seconds": seconds,
        "tokens_per_s": policy / seconds,
        "prefill_s": prefill[0],
        "reused_frac": store.stats()["prefix/reused_frac"] if store is not None else 0.0,
        "ids": [x.response_ids for x in out],
        "policy_tokens": policy,
    }


def measure(args) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(args.threads)
    engine = _engine(args, device)
    vocab = engine.model.config.get_text_config().vocab_size
    specials = set(engine.tokenizer.all_special_ids)
    pool = [i for i in range(min(vocab, 32000)) if i not in specials]
    RandomReplies.obs_len, RandomReplies.pool = args.obs_len, pool
    loop = _loop(args, engine)
    store = engine._decoder().prefixes
    if store is None:
        raise SystemExit("the engine has no prefix store: fast decode is off for this model (see the log)")
    best = {"reuse": None, "no_reuse": None}
    for r in range(args.repeats + 1):  # round 0 warms both up
        for name, s in (("no_reuse", None), ("reuse", store)):
            res = _round(args, engine, loop, pool, s)
            if r and (best[name] is None or res["seconds"] < best[name]["seconds"]):
                best[name] = res
    a, b = best["reuse"], best["no_reuse"]
    return {
        "shape": args.shape,
        "device": device,
        "trajectories": args.trajectories,
        "turns": args.turns,
        "prompt_len": args.prompt_len,
        "obs_len": args.obs_len,
        "new_tokens": args.new_tokens,
        "compiled": engine._decoder()._compiled_forward is not None,
        "policy_tokens": a["policy_tokens"],
        "policy_tokens_per_s_reuse": round(a["tokens_per_s"], 1),
        "policy_tokens_per_s_no_reuse": round(b["tokens_per_s"], 1),
        "speedup": round(a["tokens_per_s"] / b["tokens_per_s"], 3),
        "seconds_reuse": round(a["seconds"], 3),
        "seconds_no_reuse": round(b["seconds"], 3),
        "prefill_s_reuse": round(a["prefill_s"], 3),
        "prefill_s_no_reuse": round(b["prefill_s"], 3),
        "reused_frac": round(a["reused_frac"], 3),
        "same_tokens": a["ids"] == b["ids"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tidal bench multiturn", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny", help="model preset")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--obs-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--prefix-cache-mb", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="decode steps uncompiled (CUDA graphs stay on)")
    print(json.dumps(measure(p.parse_args(argv))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
