"""Configuration on a real GPU host: detection, resolution, and the memory plan against measured memory.

pytest -m gpu tests/gpu/test_config_gpu.py -s
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from tidal.config import Environment, explain, parse, resolve
from tidal.config.plan import build_plan, model_shape

pytestmark = pytest.mark.gpu


def test_detect_sees_the_gpu():
    env = Environment.detect()
    _, total = torch.cuda.mem_get_info()
    assert env.cuda_available and env.device_count == torch.cuda.device_count()
    assert env.device_memory == total
    assert env.tms_available == (importlib.util.find_spec("torch_memory_saver") is not None)
    print(env.describe())


def test_the_driver_probe_counts_as_torch_does_without_importing_it():
    """``Environment.detect`` in a fresh process asks the CUDA driver (``cuda_without_torch``): the devices and
    the first one's memory that torch reports here, and torch is still not imported after it."""
    code = (
        "import json, sys\n"
        "from tidal.config.environment import Environment, cuda_without_torch\n"
        "probed = cuda_without_torch()\n"
        "env = Environment.detect()\n"
        "print(json.dumps([probed, env.cuda_available, env.device_count, env.device_memory, 'torch' in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    probed, cuda, count, memory, imported = json.loads(out.stdout.strip().splitlines()[-1])
    expected = [torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory]
    assert probed == expected and (cuda, count, memory) == (True, *expected) and not imported, out.stdout


def test_default_resolves_to_cuda_without_offload():
    env = Environment.detect()
    cfg, prov = parse([])
    cfg = resolve(cfg, prov, env)
    assert (cfg.cluster.device, cfg.trainer.param_dtype) == ("cuda", "bf16")
    assert cfg.memory.memory_backend == ("tms" if env.tms_available else "portable")
    assert (cfg.memory.offload_train, cfg.memory.offload_rollout) == (False, False)
    assert cfg.weight_sync.update_weight_transport == "tensor"


def test_record_memory_history_is_accepted_on_cuda(tmp_path):
    cfg, prov = parse(["--record-memory-history", "--output-dir", str(tmp_path)])
    cfg = resolve(cfg, prov, Environment.detect())
    assert cfg.memory.memory_snapshot_dir == str(tmp_path / "memory-snapshots")


def test_explain_qwen_05b_on_this_gpu():
    env = Environment.detect()
    cfg, prov = parse(["--preset", "qwen2.5-0.5b-1gpu"])
    cfg = resolve(cfg, prov, env)
    text = explain(cfg, prov, env)
    print(text.split("memory plan")[1])
    assert "offload: NOT NEEDED" in text  # 0.5B fits side by side on an 80 GiB or larger GPU


def test_trainer_estimate_bounds_measured_peak():
    """The plan's trainer peak bounds what tidal's own trainer (``TrainerActor``: one CUDA rank, the 0.5B
    preset's kernels) allocates in a rollout of full micro-batches, measured after its first rollout (AdamW
    state allocated, layers compiled). The plan counts what this path keeps (compute-dtype logits, chunked
    log-prob kernels, compiled layers' saved tensors), so a naive transformers loop over fp32 logits is not
    its measure; an estimate far above the peak would offload for nothing."""
    import socket

    from tidal.config.schema import MemoryConfig
    from tidal.rollout.types import Sample
    from tidal.trainer.actor import TrainerActor

    env = Environment.detect()
    tokens, prompt, response = 4096, 256, 256
    argv = ["--preset", "qwen2.5-0.5b-1gpu", "--max-tokens-per-gpu", str(tokens)]
    argv += ["--rollout-max-response-len", str(response), "--rollout-max-prompt-len", str(prompt)]
    cfg, prov = parse(argv)
    cfg = resolve(cfg, prov, env)
    plan = build_plan(cfg, model_shape(cfg), env)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    actor = TrainerActor(
        0, 1, "127.0.0.1", port, model=cfg.model, trainer=cfg.trainer, algorithm=cfg.algorithm,
        memory=MemoryConfig(), weight_sync=cfg.weight_sync, device="cuda",
    )  # fmt: skip
    actor.init()
    actor.warm_up()
    vocab = actor.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = 4 * (tokens // (prompt + response))  # four full micro-batches

    def batch():
        ids = torch.randint(4, vocab, (rows, prompt + response), generator=gen).tolist()
        return [
            Sample(index=i, group=i // 8, prompt="", prompt_ids=r[:prompt], response_ids=r[prompt:],
                   advantage=1.0 if i % 2 else -1.0, response_logprobs=[-1.0] * response)
            for i, r in enumerate(ids)
        ]  # fmt: skip

    actor.train(batch(), 0)
    torch.cuda.reset_peak_memory_stats()
    actor.train(batch(), 1)
    measured = torch.cuda.max_memory_allocated() - base
    estimate = plan.trainer_peak
    actor.shutdown()
    print(
        f"trainer peak: measured {measured / 2**30:.2f} GiB, estimated {estimate / 2**30:.2f} GiB, "
        f"ratio {estimate / measured:.2f}"
    )
    assert measured <= estimate, "the plan underestimates the trainer: offload decisions would be unsafe"
    assert estimate <= 2 * measured, "the plan overestimates the trainer by more than 2x: it would offload for nothing"
