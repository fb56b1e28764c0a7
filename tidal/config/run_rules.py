"""Resolution rules of the run's files and start: checkpoints to save and load, prompt data and plug-in
paths, the output folder, the memory-history snapshots, the warm-up before the first rollout.

Plain functions over ``tidal.config.validate.Context``; ``validate`` registers them last in its
ordered rule list, so they run in the one resolve pass and appear in docs/configuration.md with
their ids and summaries. Each raises ``ConfigError`` with one line: the flags involved and the fix.
Kept apart from ``validate`` so that module stays the pass itself and the device, cluster and batch
rules.
"""

from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING

from tidal.checkpoint.manifest import is_checkpoint, iterations
from tidal.config.args import flag_of
from tidal.errors import ConfigError

if TYPE_CHECKING:
    from tidal.config.validate import Context

# A plug-in path: ``module:function`` or ``file.py:function`` (also read by ``algorithm_rules``).
PLUGIN_PATH = re.compile(r"^(?:[A-Za-z_][\w.]*|.+\.py):[A-Za-z_][\w.]*$")


def _f(name: str) -> str:
    return flag_of(name)


def checkpoint(ctx: Context) -> None:
    ck = ctx.cfg.checkpoint
    for name in ("save_interval", "keep_checkpoints"):
        if ctx.get(name) and not ck.save:
            raise ConfigError(f"{_f(name)} {ctx.get(name)} needs --save DIR (where checkpoints go)")
    if not ck.load:
        return
    if ck.save and os.path.abspath(ck.load) == os.path.abspath(ck.save):
        return  # the auto-resume idiom: nothing there yet means a fresh start (said at start-up)
    if not os.path.isdir(ck.load):
        raise ConfigError(
            f"--load {ck.load}: no such directory; check the path, or pass the same folder to --save and --load "
            "to start fresh and resume from it later"
        )
    if not is_checkpoint(ck.load) and not iterations(ck.load):
        raise ConfigError(
            f"--load {ck.load}: holds no checkpoint (no iter_* folder with a meta.json); point it at the folder given to --save"
        )


def data(ctx: Context) -> None:
    from tidal.model.load import PRESETS  # presets without --tokenizer use the character tokenizer

    d, m = ctx.cfg.data, ctx.cfg.model
    if d.prompt_data is None and d.task == "mental-math" and m.model in PRESETS and not m.tokenizer:
        raise ConfigError(
            f"--task mental-math asks chat questions in words; --model {m.model} has a character tokenizer and no "
            "chat template; use --preset smollm2-135m-cpu (or another instruct model), or --task digit-sum / arith"
        )
    if d.prompt_data is not None:
        if not d.prompt_data.endswith((".jsonl", ".parquet")):
            raise ConfigError(f"--prompt-data {d.prompt_data}: expected a .jsonl or .parquet file")
        if not os.path.isfile(d.prompt_data):
            raise ConfigError(f"--prompt-data {d.prompt_data}: no such file")
    for name in ("custom_rm_path", "custom_generate_function_path"):
        value = ctx.get(name)
        if value is not None and not PLUGIN_PATH.match(value):
            raise ConfigError(
                f"{_f(name)} {value}: expected module:function or file.py:function, e.g. my_pkg.rewards:score"
            )
        if value is not None and value.split(":")[0].endswith(".py") and not os.path.isfile(value.rsplit(":", 1)[0]):
            raise ConfigError(f"{_f(name)} {value}: no such file {value.rsplit(':', 1)[0]}")


def output_dir(ctx: Context) -> None:
    """A fresh folder by default. A named folder that holds an earlier run's steps is refused unless ``--load``
    continues a run (its rows from the resumed rollout on are then dropped: ``RunDir.resume_at``): appending a new
    run's steps to another run's ``metrics.jsonl`` would mix two curves in one file."""
    out = ctx.cfg.logging.output_dir
    if out is None:
        name = re.sub(r"[^\w.-]+", "-", ctx.shape().name)
        ctx.derive(
            "output_dir",
            os.path.join("runs", f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"),
            "output-dir",
            "a fresh run folder",
        )
        return
    metrics = os.path.join(out, "metrics.jsonl")
    if ctx.cfg.checkpoint.load is None and os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        raise ConfigError(
            f"--output-dir {out} already holds a run's steps (metrics.jsonl); choose another folder (or remove this "
            "one), or continue that run with --load <its --save folder>"
        )


def warm_up(ctx: Context) -> None:
    """``--warm-up`` left unset: on where the first rollout would otherwise compile or capture (CUDA: the fast
    decode step compiled or captured, or the trainer's layers or log-prob kernels compiled) and both sides stay
    resident, since the warm-ups run at once on every actor (after the offload decision)."""
    c, r, t, m = ctx.cfg.cluster, ctx.cfg.rollout, ctx.cfg.trainer, ctx.cfg.memory
    if c.warm_up is not None:
        return
    engine = r.rollout_engine == "embedded" and r.rollout_fast_decode and (r.rollout_compile or r.rollout_cuda_graphs)
    trainer = t.compile_layers or t.compile_logprobs
    if c.device != "cuda":
        on, why = False, f"nothing compiles or captures on {c.device}"
    elif r.debug_rollout_only:
        on, why = False, "rollout only: no trainer to warm beside the engines"
    elif m.offload_train or m.offload_rollout:
        on, why = False, "offload: trainer and engines do not stay resident together"
    elif not (engine or trainer):
        on, why = False, "nothing compiles or captures"
    else:
        on, why = True, "CUDA, " + " and ".join(n for n, x in (("decode step", engine), ("trainer", trainer)) if x)
    ctx.derive("warm_up", on, "warm-up", why)


def warm_process(ctx: Context) -> None:
    """``--warm-process on`` forks a local cluster's actors: it means nothing where no local cluster starts here
    (``--ray-address``) or where the engines are servers (``--rollout-engine sglang``), so it is refused there."""
    c, r = ctx.cfg.cluster, ctx.cfg.rollout
    if c.warm_process != "on":
        return
    if c.ray_address:
        raise ConfigError(
            "--warm-process on forks the actors of a cluster started here; with --ray-address the cluster's own "
            "workers host them; drop one of the two"
        )
    if r.rollout_engine != "embedded":
        raise ConfigError(
            f"--warm-process on forks embedded engines and trainers; --rollout-engine {r.rollout_engine} runs "
            "servers; drop --warm-process"
        )


def profile_rollouts(ctx: Context) -> None:
    ids = ctx.cfg.logging.profile_rollouts
    if not ids:
        return
    n = ctx.cfg.rollout.num_rollout
    for v in ids:
        if not str(v).isdigit():
            raise ConfigError(
                f"--profile-rollouts {v!r}: not a rollout id; give whole numbers, e.g. --profile-rollouts 2 3"
            )
        if int(v) >= n:
            raise ConfigError(
                f"--profile-rollouts {v}: this run's rollouts are 0-{n - 1} (--num-rollout {n}); pick one of them"
            )
    if ctx.cfg.rollout.async_mode != "off":
        raise ConfigError(
            f"--profile-rollouts profiles the synchronous loop's calls, not --async {ctx.cfg.rollout.async_mode}'s; "
            "drop one of them"
        )


def memory_history(ctx: Context) -> None:
    m = ctx.cfg.memory
    if not m.record_memory_history:
        if m.memory_snapshot_dir is not None:
            raise ConfigError(
                "--memory-snapshot-dir is only used with --record-memory-history; add that flag or drop the folder"
            )
        return
    if ctx.cfg.cluster.device != "cuda":
        raise ConfigError("--record-memory-history needs CUDA (it records the CUDA allocator); drop it on this CPU run")
    if m.memory_snapshot_dir is None:
        ctx.derive(
            "memory_snapshot_dir",
            os.path.join(ctx.cfg.logging.output_dir, "memory-snapshots"),
            "memory-history",
            "under the run folder",
        )
