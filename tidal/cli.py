"""The ``tidal`` command.

    tidal train [flags]          run the loop (no flags: the embedded default, a tiny model on a built-in task)
    tidal train --dry-run ...    resolve and explain the configuration, start nothing
    tidal explain [flags]        the resolved configuration, where each value came from, derived sizes, memory plan
                                 (--assume-gpus N --assume-gpu-memory 80GiB plan for a machine you are not on)
    tidal export --load CKPT --out DIR [flags]   write a Hugging Face model folder from a checkpoint
    tidal serve [flags] [--host H] [--port P] [--api-key K]   the engine as an HTTP server (SGLang's API + OpenAI's)
    tidal bench NAME [args]      benchmarks: memory, weight-sync, delta-codec, rollout, sampling, attention, trainer, reward-curve, serve, multiturn, async, startup

User errors (bad flags, missing files, impossible combinations) print one line and exit with code 2.
"""

from __future__ import annotations

import importlib
import logging
import sys

from tidal.errors import UserError
from tidal.signals import Stopped

USAGE = __doc__.split("\n\n")[1]

BENCHES = {
    "memory": "tidal.bench.memory",
    "weight-sync": "tidal.bench.weight_sync",
    "delta-codec": "tidal.bench.delta_codec",
    "trainer": "tidal.bench.trainer",
    "rollout": "tidal.bench.rollout",
    "sampling": "tidal.bench.sampling",
    "attention": "tidal.bench.attention",
    "reward-curve": "tidal.bench.reward_curve",
    "serve": "tidal.bench.serve",
    "multiturn": "tidal.bench.multiturn",
    "async": "tidal.bench.async_modes",
    "startup": "tidal.bench.startup",
}


def _resolved(argv: list[str]):
    from tidal.config import parse, resolve

    cfg, prov = parse(argv)
    return resolve(cfg, prov), prov


def cmd_train(argv: list[str]) -> int:
    if "--dry-run" in argv:
        from tidal.config import explain_argv

        print(explain_argv([a for a in argv if a != "--dry-run"]))
        return 0
    import gc

    # No collections while the run starts (each full pass walks every object imported so far), then what
    # the start made is frozen out of the collector (``freeze_start``): the steps' full passes scan only
    # what the steps make (0.13-0.15 s each, 4-5 in the default run, on the driver's path, before).
    gc.disable()
    try:
        cfg, _ = _resolved(argv)
        logging.basicConfig(level=cfg.logging.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        from tidal.driver import train

        row = train(cfg, freeze_start=True)
    finally:
        gc.enable()
    if row:
        print(
            f"done: {row.get('step', -1) + 1} rollouts, last reward_mean {row.get('reward_mean', float('nan')):.3f}, {row.get('elapsed_s', 0):.0f} s"
        )
    return 0


def cmd_explain(argv: list[str]) -> int:
    from tidal.config import explain_argv

    print(explain_argv(argv))
    return 0


def cmd_export(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="tidal export", description="Write a Hugging Face folder from a tidal checkpoint.")
    p.add_argument("--load", required=True, help="checkpoint directory given to --save during training")
    p.add_argument("--out", required=True, help="output folder (must not exist)")
    args, rest = p.parse_known_args(argv)
    cfg, _ = _resolved(rest)
    path = export_checkpoint(args.load, args.out, cfg)
    print(f"exported {path}")
    return 0


def export_checkpoint(load_dir: str, out_dir: str, cfg) -> str:
    """Load the newest checkpoint under ``load_dir`` into a one-rank trainer of ``--train-backend`` in this
    process (no Ray) and write it as a Hugging Face folder at ``out_dir``."""
    import os
    import socket

    from tidal.checkpoint.store import find_latest
    from tidal.trainer.base import trainer_class

    if not os.path.isdir(load_dir) or find_latest(load_dir) is None:
        raise UserError(
            f"--load {load_dir}: no complete checkpoint there; pass the directory given to --save during training"
        )
    if os.path.exists(out_dir):
        raise UserError(f"--out {out_dir}: already exists; choose a new folder")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainer = trainer_class(cfg.trainer.train_backend)(
        0,
        1,
        "127.0.0.1",
        port,
        model=cfg.model,
        trainer=cfg.trainer,
        algorithm=cfg.algorithm,
        memory=cfg.memory,
        weight_sync=cfg.weight_sync,
        device=cfg.cluster.device,
    )
    try:
        trainer.init()
        trainer.load(load_dir)
        trainer.export(out_dir)
    finally:
        trainer.shutdown()
    return out_dir


def cmd_serve(argv: list[str]) -> int:
    from tidal.serve.server import main as serve_main

    return serve_main(argv)


def cmd_bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        raise UserError(f"tidal bench needs one of: {', '.join(BENCHES)}")
    mod = importlib.import_module(BENCHES[argv[0]])
    return int(mod.main(argv[1:]) or 0)


COMMANDS = {"train": cmd_train, "explain": cmd_explain, "export": cmd_export, "serve": cmd_serve, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        import difflib

        hint = difflib.get_close_matches(cmd, COMMANDS, n=1)
        print(
            f"tidal: error: unknown command {cmd!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else f"; use one of {', '.join(COMMANDS)}"),
            file=sys.stderr,
        )
        return 2
    try:
        return COMMANDS[cmd](rest)
    except UserError as e:
        print(f"tidal: error: {e}", file=sys.stderr)
        return e.exit_code
    except Stopped as e:
        print(f"tidal: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("tidal: interrupted; actors stopped", file=sys.stderr)
        return 130


def run() -> None:
    """The ``tidal`` command's process: ``main``, then, after ``tidal train``, out without the interpreter's teardown.

    A run leaves torch, transformers and Ray loaded, and freeing their modules cost ~0.7 s of CPU after
    everything was written and closed. The atexit handlers still run (a library's clean-up), and the
    streams and logging are flushed; other commands exit as usual."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] != ["train"]:
        sys.exit(code)
    import atexit
    import contextlib
    import os

    atexit._run_exitfuncs()
    logging.shutdown()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
