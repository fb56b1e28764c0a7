"""``tidal serve``: build the embedded engine from the usual model/rollout flags and serve it over HTTP.

    tidal serve [model and rollout flags] [--host 127.0.0.1] [--port 30000] [--api-key KEY]

The key may come from the environment instead, ``TIDAL_SERVE_API_KEY`` (so that it does not show in
``ps``; the servers a run starts get it that way).

The engine is built exactly as a rollout engine actor builds it (same model spec, seed and dtype
rules), so a trainer started with the same ``--model`` and ``--seed`` holds the same weights. The
server prints one line, ``tidal serve: listening on http://HOST:PORT``, once the socket is bound
(``--port 0`` picks a free port), then serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys

from tidal.config.schema import TidalConfig
from tidal.errors import UserError

log = logging.getLogger(__name__)

KEEP_ALIVE_S = 120  # uvicorn closes idle connections after 5 s by default


def build_engine(cfg: TidalConfig):
    from tidal.rollout.embedded import EmbeddedEngine

    device = cfg.cluster.device
    if device == "cuda":
        import torch

        torch.cuda.set_device(0)
        device = "cuda:0"
    return EmbeddedEngine(cfg.model, cfg.rollout, cfg.memory, cfg.weight_sync, device=device, seed=cfg.trainer.seed)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(
            f"--host {host} --port {port}: cannot listen there ({e.strerror}); pick another --port"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_state(cfg: TidalConfig, engine):
    from tidal.rollout.server import API_KEY_ENV
    from tidal.serve.app import ServerState

    name = cfg.serve.served_model_name or cfg.model.model
    return ServerState(
        engine,
        model_path=cfg.model.model,
        served_model_name=name,
        api_key=cfg.serve.serve_api_key or os.environ.get(API_KEY_ENV) or None,
        batch_wait_s=cfg.serve.serve_batch_wait_ms / 1000,
    )


def serve(cfg: TidalConfig) -> int:
    import uvicorn

    from tidal.serve.app import build_app

    sock = bind(cfg.serve.serve_host, cfg.serve.serve_port)
    engine = build_engine(cfg)
    state = make_state(cfg, engine)
    app = build_app(state)
    # What is alive now (modules, the model's objects, the tokenizer) lives as long as the server: keep it out of
    # the garbage collector's full passes, which otherwise walk all of it while every thread, decode included, waits.
    gc.freeze()
    # The engine thread, woken when a burst is queued, waits for the GIL until the event loop blocks or the switch
    # interval passes (5 ms by default: it showed as the queue wait before a step); the two threads rarely compete.
    sys.setswitchinterval(0.001)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"tidal serve: listening on http://{shown}:{port}", flush=True)
    level = cfg.logging.log_level if cfg.logging.log_level != "info" else "warning"
    # Keep idle connections longer than a training step lasts, so a client reuses them from rollout to rollout.
    # No access log, no proxy-header rewriting (the server binds where it is told; no proxy in front is trusted)
    # and no Server header: three per-request costs of uvicorn's default stack that /generate does not need.
    config = uvicorn.Config(
        app,
        log_level=level,
        timeout_keep_alive=KEEP_ALIVE_S,
        access_log=False,
        proxy_headers=False,
        server_header=False,
    )
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        state.worker.close()
        sock.close()
    return 0


def main(argv: list[str]) -> int:
    from tidal.config import parse, resolve

    cfg, prov = parse(argv)
    cfg = resolve(cfg, prov)
    logging.basicConfig(level=cfg.logging.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
