"""The run directory: resolved config, one JSON line of metrics per step, plots, TensorBoard.

Layout of ``--output-dir`` (default ``runs/<time>-<model>``)::

    config.yaml       the resolved configuration (what ran, after every rule)
    metrics.jsonl     one JSON object per step: step, reward_mean, elapsed_s, phase times, ...
    curves.png        reward and phase times over steps (rewritten as the run goes)
    memory.png        host and device memory across the phases of the first steps
    samples.jsonl     --log-samples responses per step: prompt, response, label, reward, ... (observe.samples)
    tb/               TensorBoard events when --use-tensorboard

Every line of metrics.jsonl is written and flushed when its step ends, so a crash loses nothing
that was already reported. A run continued with ``--load`` into the same folder keeps the earlier rows of
rollouts before the one it resumes at and drops the rest (``resume_at``: those rollouts run again), so each
step has one row; a new run into a folder that holds steps is refused before anything starts
(``config.run_rules.output_dir``).
"""

from __future__ import annotations

import json
import math
import os
import time
from datetime import datetime

import psutil
import yaml

from tidal.config.schema import LoggingConfig, TidalConfig
from tidal.observe.rows import keep_before
from tidal.observe.samples import SampleLog


def default_output_dir(model: str) -> str:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-._" else "-" for c in os.path.basename(os.path.normpath(model)))
    return os.path.join("runs", f"{stamp}-{safe}")


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):
        return v.item()
    return v


class RunDir:
    def __init__(self, cfg: TidalConfig):
        log_cfg: LoggingConfig = cfg.logging
        self.path = log_cfg.output_dir or default_output_dir(cfg.model.model)
        os.makedirs(self.path, exist_ok=True)
        tmp = os.path.join(self.path, "config.yaml.tmp")
        with open(tmp, "w") as f:
            yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
        os.replace(tmp, os.path.join(self.path, "config.yaml"))
        self.metrics_path = os.path.join(self.path, "metrics.jsonl")
        self.history: list[dict] = keep_before(self.metrics_path, None)[0]
        self._metrics = open(self.metrics_path, "a")
        self.samples = SampleLog(self.path, log_cfg.log_samples)
        # elapsed_s counts from the start of the process, so Ray and actor start-up are included.
        self.t0 = psutil.Process().create_time()
        self._tb = None
        if log_cfg.use_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                from tidal.errors import UserError

                raise UserError(
                    "--use-tensorboard needs the tensorboard package: pip install 'tidal[tensorboard]'"
                ) from e
            self._tb = SummaryWriter(os.path.join(self.path, "tb"))

    def elapsed(self) -> float:
        return time.time() - self.t0

    def log_step(self, step: int, metrics: dict) -> dict:
        row = {"step": step, "elapsed_s": round(self.elapsed(), 3)}
        row.update({k: _jsonable(v) for k, v in metrics.items()})
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        self.history.append(row)
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        return row

    def resume_at(self, step: int) -> int:
        """A continued run starts at rollout ``step``: the rows of metrics.jsonl and samples.jsonl from ``step`` on
        (an earlier process's, past its last checkpoint) are dropped, since those rollouts run again. Returns how
        many metrics rows were dropped."""
        self._metrics.close()
        self.history, dropped = keep_before(self.metrics_path, step)
        self._metrics = open(self.metrics_path, "a")
        self.samples.resume_at(step)
        return dropped

    def close(self) -> None:
        self._metrics.close()
        self.samples.close()
        if self._tb is not None:
            self._tb.close()
