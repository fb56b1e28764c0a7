"""One rank of the CPU checks of the Megatron layout: ``python tests/megatron_cpu_rank.py RANK WORLD TP PP PORT OUT [ARCH,...]``.

Run by ``tests/unit/test_megatron_layout.py`` (one process per rank, gloo). For each tiny
architecture (Llama, Qwen2 with QKV bias and untied head, Qwen3 with q/k norms and a head_dim that is
not hidden/heads) it builds the Hugging Face model from the shared seed, builds Megatron-core's
``GPTModel`` stage of this rank with CPU initialisation, loads it through tidal's mapping, and checks:

1. the round trip: tidal's weight source (``iter_hf_weights``) over Megatron's own parameters gives
   every HF tensor back, bit for bit (rank 0);
   With TP = 2 the same processes then run as two pipeline stages for the untied models;
2. with PP = 1, the forward: Megatron's logits (vocabulary shards gathered here for the comparison
   only) equal the HF model's, and tidal's vocab-parallel log-probs and entropy on the shards equal
   the full-vocabulary ones (with their gradients w.r.t. the logits);
3. with TP > 1, for the first architecture: Megatron's process groups destroyed and rebuilt as around
   a pause (``tidal.trainer.megatron.groups``), no reference to an old group left, the same logits;
4. with TP = 2 over two ranks, the training path itself, in the same processes: ``MegatronTrainer.train``
   on ``tests/megatron_cpu_train.py``'s seeded ``tiny-qwen2`` (tied embeddings), sections and two
   rollouts, with a pause/resume between them (groups of two ranks destroyed and rebuilt), laid out
   as two data-parallel ranks, then TP = 2 (vocabulary-parallel log-probs, sharded QKV/MLP, the
   gradient norm over both shards), then two pipeline stages (activations sent between them, the
   tied embedding's gradient summed across the first and last stage), then two data-parallel ranks
   with the distributed optimizer (ZeRO-1: moments sharded, parameter buffers moved into WEIGHTS
   without torch's block swap; a checkpoint saved while paused loads back bit for bit); each
   layout's metrics.

Megatron's forward looks up ``torch.cuda.current_device()`` for its rotary table and forks its
CUDA RNG tracker around attention dropout; on a CPU-only host both are redirected (device "cpu", a
no-op fork: dropout is 0 here), which changes nothing the comparison depends on.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # megatron_cpu_train's sections and samples


def hf_models(only=None):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64)
    configs = {
        "llama": LlamaConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **common),
        "qwen2": Qwen2Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **common),
        "qwen3": Qwen3Config(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, **common
        ),
    }
    for name, cfg in configs.items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():  # nonzero norms and biases, so a misplaced one shows
            for p in model.parameters():
                if p.ndim == 1:
                    p.copy_(torch.randn_like(p))
        yield name, model


def check(name, hf, topo, tp, pp, group, rebuild=False):
    from megatron.core import parallel_state as ps

    from tidal.algos.logprobs import token_logprobs_and_entropy
    from tidal.trainer.megatron import mapping
    from tidal.trainer.megatron import model as mm
    from tidal.trainer.megatron.vocab import vocab_parallel_stats
    from tidal.trainer.megatron.weights import iter_hf_weights, shard_shapes

    arch = mapping.arch_from_hf(hf.config)
    tp_rank, _, _, pp_rank = topo.coords()
    assert (tp_rank, pp_rank) == (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    config = mm.transformer_config(arch, mm.Parallel(tp=tp, pp=pp), cpu_init=True, autocast=False)
    stage = mm.build_stage(arch, config, mm.layer_spec(arch, False), tp=tp, pp_rank=pp_rank, pp_size=pp)
    full = {n: p.detach() for n, p in hf.named_parameters()}
    mm.load_hf(stage, arch, full.__getitem__, tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp, te=False)
    local = dict(stage.named_parameters())
    shapes = shard_shapes(local, topo, group)
    got = dict(
        iter_hf_weights(
            local,
            arch,
            topo,
            shapes=shapes,
            dtype=None,
            read=lambda t: t,
            host=lambda t, d: t.to(d or t.dtype),
            group=group,
        )
    )
    out = {}
    if topo.rank == 0:
        out["names_equal"] = sorted(got) == sorted(full)
        out["bitwise"] = all(
            got[n].dtype == full[n].dtype
            and torch.equal(got[n].contiguous().view(torch.uint8), full[n].contiguous().view(torch.uint8))
            for n in full
        )
    if pp > 1:
        return out
    torch.manual_seed(1)
    ids = torch.randint(0, arch.vocab_size, (2, 9))
    mask = torch.triu(torch.ones(9, 9, dtype=torch.bool), 1)[None, None]
    logits = stage(ids, torch.arange(9).expand(2, 9), mask)  # [b, s, V/tp]
    ref = hf(ids).logits
    shards = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(shards, logits.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    gathered = torch.cat(shards, dim=-1)[..., : arch.vocab_size]
    out["logits_max_abs_diff"] = float((gathered - ref).abs().max())
    targets = torch.roll(ids, -1, 1)
    leaf = logits.detach().requires_grad_(True)
    per = leaf.shape[-1]
    lp, ent = vocab_parallel_stats(
        leaf, targets, vocab_start=tp_rank * per, vocab_size=arch.vocab_size, group=ps.get_tensor_model_parallel_group()
    )
    (lp.sum() + 0.5 * ent.sum()).backward()
    full_leaf = gathered.detach().requires_grad_(True)
    rlp, rent = token_logprobs_and_entropy(full_leaf, targets, with_entropy_grad=True, compile=False)
    (rlp.sum() + 0.5 * rent.sum()).backward()
    want_grad = torch.nn.functional.pad(full_leaf.grad, (0, arch.padded_vocab(tp) - arch.vocab_size))
    want_grad = want_grad[..., tp_rank * per : (tp_rank + 1) * per]
    out["logprob_max_abs_diff"] = float((lp - rlp).abs().max())
    out["entropy_max_abs_diff"] = float((ent - rent).abs().max())
    out["grad_max_abs_diff"] = float((leaf.grad - want_grad).abs().max())
    if rebuild:
        # Autograd graphs hold their process groups (Megatron's TP functions keep them in ``ctx``): drop them,
        # as a trainer has by the time it pauses.
        logits = logits.detach()
        del lp, ent, leaf
        out.update(release_and_rebuild(stage, lambda: stage(ids, torch.arange(9).expand(2, 9), mask), logits))
    return out


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def release_and_rebuild(stage, forward, logits) -> dict:
    """Megatron's groups (two ranks each here) destroyed and rebuilt as around a pause: no reference to an old
    group is left in the stage, Megatron's getters hand out the new ones, and the forward gives the same logits."""
    import sys

    from megatron.core import parallel_state as ps

    from tidal.trainer.megatron.groups import MegatronGroups

    groups = MegatronGroups(tp=ps.get_tensor_model_parallel_world_size(), pp=1, cp=1, device="cpu")
    groups.initialize()
    old = [g for g in ps._global_process_group_list if g is not None]
    names = {id(v): k for k, v in vars(ps).items() if any(v is g for g in old)}
    names = [names.get(id(g), "?") for g in old]
    released = groups.release()
    repointed = groups.rebuild([stage])
    return {
        "released": released,
        "repointed": repointed,
        "stale": [names[i] for i in range(len(old)) if sys.getrefcount(old[i]) > 2],
        "tp_group_new": all(ps.get_tensor_model_parallel_group() is not g for g in old),
        "rebuilt_logits_equal": torch.equal(_no_grad(forward), logits),
    }


# name: (tensor, pipeline, distributed optimizer)
TRAIN_LAYOUTS = {"dp2": (1, 1, False), "tp2": (2, 1, False), "pp2": (1, 2, False), "dp2-zero1": (1, 1, True)}


def train_layouts(rank: int, port: int, ckpt: str) -> dict:
    """Step 4 of the module docstring: rank 0's metrics of two rollouts per layout (other ranks: empty), and for
    the distributed optimizer whether a checkpoint saved while paused loads back bit for bit."""
    from megatron.core import parallel_state as ps
    from megatron_cpu_train import _metrics, _redirect_cuda_devices, _samples, _sections

    from tidal.memory import home
    from tidal.trainer.megatron.trainer import MegatronTrainer

    _redirect_cuda_devices()  # Megatron's DDP, optimizer and schedule ask for CUDA in a few more places
    home.CAN_SWAP = False  # memory moved into its regions as on torch 2.11
    out = {}
    for name, (tp, pp, zero1) in TRAIN_LAYOUTS.items():
        ps.destroy_model_parallel()
        sections = _sections("megatron")
        sections["trainer"].tensor_model_parallel_size = tp
        sections["trainer"].pipeline_model_parallel_size = pp
        sections["trainer"].use_distributed_optimizer = zero1
        tr = MegatronTrainer(rank, 2, "127.0.0.1", port, release_process_groups=True, **sections)
        tr._place()
        tr._parallel_state()
        tr.build()
        rows = []
        for i, gbs in enumerate((None, 8)):  # as megatron_cpu_train: one optimizer step, then two
            tr.cfg.global_batch_size = gbs
            if i:
                tr.resume()
            m = tr.train(_samples(i), i)
            rows.append(_metrics(m) if rank == 0 else {})  # rank 0 returns the metrics reduced over ranks
            tr.pause()
        if zero1:  # each rank holds half of the moments: saved while paused, reloaded after another rollout
            state = tr.state_checksums()
            tr.save(ckpt, {"rollout_id": 1})
            tr.resume()
            tr.train(_samples(5), 2)
            tr.load(ckpt)
            loaded = tr.state_checksums()  # collective: every rank
            out[f"{name}/load_bit_exact"] = loaded == state if rank == 0 else None
        else:
            tr.resume()
        out[name] = rows
        del tr
    return out


def main() -> None:
    rank, world, tp, pp, port, out_path = sys.argv[1:7]
    only = sys.argv[7].split(",") if len(sys.argv) > 7 else None
    rank, world, tp, pp = int(rank), int(world), int(tp), int(pp)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # see the module docstring
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)

    from tidal.trainer.megatron.weights import Topology

    topo = Topology(rank=rank, tp=tp, cp=1, dp=world // (tp * pp), pp=pp)
    results = {
        name: check(name, hf, topo, tp, pp, dist.group.WORLD, rebuild=i == 0 and pp == 1 and tp > 1)
        for i, (name, hf) in enumerate(hf_models(only))
    }
    if tp == world and pp == 1 and world == 2:
        # The same two processes again as two pipeline stages (untied models: Megatron ties a split
        # embedding through a CUDA-only all-reduce): the weight source's stage-to-rank-0 path.
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
        stages = Topology(rank=rank, tp=1, cp=1, dp=1, pp=2)
        for name, hf in hf_models([n for n in (only or ["llama", "qwen2"]) if n != "qwen3"]):
            results[f"{name}/pp2"] = check(name, hf, stages, 1, 2, dist.group.WORLD)
        results["train"] = train_layouts(rank, int(port), os.path.join(os.path.dirname(out_path), "ckpt-zero1"))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
