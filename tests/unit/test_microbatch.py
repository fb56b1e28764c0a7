"""The trainer's micro-batch on the host: tensor layout, host-side counts, and why no attention mask is needed.

Hand-made samples; the model check uses the tiny preset on the CPU (no Ray, no process group).
"""

from __future__ import annotations

import pytest
import torch

from tidal.algos.logprobs import token_logprobs
from tidal.algos.losses import loss_normalizer
from tidal.rollout.types import Sample
from tidal.trainer.microbatch import WIDTH_MULTIPLE, MicroBatch, MicroBatches, width_multiple


def _samples() -> list[Sample]:
    return [
        # prompt [5, 6], response [7, 8, 9]: targets at positions 1, 2, 3; engine log-probs given
        Sample(index=0, group=0, prompt="", prompt_ids=[5, 6], response_ids=[7, 8, 9], advantage=1.5,
               response_logprobs=[-0.1, -0.2, -0.3]),
        # prompt [10], response [11]: target at position 0; no engine log-probs
        Sample(index=1, group=0, prompt="", prompt_ids=[10], response_ids=[11], advantage=-0.5, reward=2.0),
        # per-token advantages (REINFORCE++) win over the sequence's one
        Sample(index=2, group=1, prompt="", prompt_ids=[12], response_ids=[13, 14], advantage=9.0,
               token_advantages=[0.25, 0.75]),
    ]  # fmt: skip


def test_layout_and_host_counts():
    mb = MicroBatch(_samples(), [0, 1], pad_id=0, device=torch.device("cpu"))
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9], [10, 11, 0, 0, 0]]
    assert mb.next_ids.tolist() == [[6, 7, 8, 9, 0], [11, 0, 0, 0, 0]]  # target of every position
    assert mb.targets.tolist() == [[6, 7, 8, 9], [11, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert mb.mask.tolist() == [[False, True, True, True], [True, False, False, False]]
    assert mb.has_engine_logprobs.tolist() == [[False, True, True, True], [False] * 4]
    assert torch.allclose(mb.engine_logprobs, torch.tensor([[0.0, -0.1, -0.2, -0.3], [0.0] * 4]))
    # one advantage per target position, 0 off the response; rewards per row (for the critic's returns)
    assert mb.advantages.tolist() == [[0.0, 1.5, 1.5, 1.5], [-0.5, 0, 0, 0]]
    assert mb.rewards.tolist() == [0.0, 2.0]
    tok = MicroBatch(_samples(), [2], pad_id=0, device=torch.device("cpu"))
    assert tok.advantages.tolist() == [[0.25, 0.75]]
    assert (mb.tokens, mb.num_response_tokens, mb.num_engine_logprobs) == (7, 4, 3)
    assert torch.equal(mb.host_mask, mb.mask.cpu())
    assert float(loss_normalizer(mb.host_mask, "seq-mean-token-mean")) == 2.0
    filler = MicroBatch(_samples(), [], pad_id=0, device=torch.device("cpu"))
    assert filler.empty and filler.num_response_tokens == 0 and not filler.mask.any()
    filler8 = MicroBatch(_samples(), [], pad_id=0, device=torch.device("cpu"), multiple=WIDTH_MULTIPLE)
    assert filler8.input_ids.shape == (1, 8) and filler8.advantages.shape == (1, 7) and filler8.tokens == 0


def test_widths_round_up_on_cuda_only():
    assert width_multiple(torch.device("cuda")) == WIDTH_MULTIPLE == 8
    assert width_multiple(torch.device("cpu")) == 1


def test_right_padded_rows_need_no_attention_mask():
    # Causal attention: a real token only sees earlier positions, all real in a right-padded row, and
    # positions count from 0 either way. So the log-probs of real targets are the same without the mask.
    from tidal.model.load import build_model, resolve_model

    model = build_model(resolve_model("tiny"), seed=0)
    mb = MicroBatch(_samples(), [0, 1], pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        masked = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        plain = model(input_ids=mb.input_ids).logits
        alone = model(input_ids=mb.input_ids[1:, :2]).logits  # row 1 without its padding
    lp_masked = token_logprobs(masked, mb.next_ids)[:, :-1]
    lp_plain = token_logprobs(plain, mb.next_ids)[:, :-1]
    real = mb.mask
    torch.testing.assert_close(lp_plain[real], lp_masked[real], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(plain[1, :2], alone[0], rtol=1e-6, atol=1e-6)
    # Rounded up to CUDA's width multiple: more pad columns, the same log-probs at every trained position.
    wide = MicroBatch(_samples(), [0, 1], pad_id=0, device=torch.device("cpu"), multiple=WIDTH_MULTIPLE)
    with torch.no_grad():
        lp_wide = token_logprobs(model(input_ids=wide.input_ids).logits, wide.next_ids)[:, :-1]
    assert wide.input_ids.shape[1] == 8 > mb.input_ids.shape[1]
    torch.testing.assert_close(lp_wide[wide.mask], lp_plain[real], rtol=1e-6, atol=1e-6)


def _reference_rows(s: Sample, t: int) -> tuple[list, list, list, list, float]:
    """One row over ``t`` target positions written out position by position: response mask, engine
    log-prob positions, engine log-probs, advantages, reward (0 for an empty response)."""
    p, n = len(s.prompt_ids), len(s.response_ids)
    mask, has_lp, lp, adv = [False] * t, [False] * t, [0.0] * t, [0.0] * t
    for k in range(n):
        j = p - 1 + k  # target position of response token k
        mask[j] = bool(s.loss_mask[k]) if s.loss_mask else True
        adv[j] = s.token_advantages[k] if len(s.token_advantages) == n else s.advantage
        if len(s.response_logprobs) == n:
            lp[j], has_lp[j] = s.response_logprobs[k], mask[j]
    return mask, has_lp, lp, adv, s.reward if n else 0.0


def _random_samples():
    import random

    rng = random.Random(3)
    samples = []
    for i in range(12):
        p, n = rng.randint(1, 6), rng.choice([0, 1, 3, 7])
        samples.append(
            Sample(
                index=i,
                group=i // 4,
                prompt="",
                prompt_ids=[rng.randint(1, 50) for _ in range(p)],
                response_ids=[rng.randint(1, 50) for _ in range(n)],
                advantage=rng.uniform(-2, 2),
                reward=rng.uniform(0, 1),
                response_logprobs=[-rng.random() for _ in range(n)] if i % 3 else [],
                token_advantages=[rng.uniform(-1, 1) for _ in range(n)] if i % 4 == 1 else [],
                loss_mask=[rng.randint(0, 1) for _ in range(n)] if i % 2 else [],
            )
        )
    return samples


@pytest.mark.parametrize("multiple", [1, WIDTH_MULTIPLE])
def test_every_field_matches_a_position_by_position_build(multiple):
    samples = _random_samples()
    idx = [11, 0, 5, 3, 8, 1, 2]
    mb = MicroBatch(samples, idx, pad_id=99, device=torch.device("cpu"), multiple=multiple)
    rows = [samples[i] for i in idx]
    longest = max(s.total_len for s in rows)
    # CUDA's default: rounded up to a multiple of 8 (the compiled layers' attention guards on it); here 10 -> 16
    width = -(-longest // multiple) * multiple
    assert multiple == 1 or width > longest
    ids = [s.prompt_ids + s.response_ids + [99] * (width - s.total_len) for s in rows]
    assert mb.input_ids.tolist() == ids
    assert mb.next_ids.tolist() == [r[1:] + [99] for r in ids]
    assert mb.attention_mask.tolist() == [[int(j < s.total_len) for j in range(width)] for s in rows]
    ref = [_reference_rows(s, width - 1) for s in rows]
    assert mb.mask.tolist() == [r[0] for r in ref]
    assert mb.has_engine_logprobs.tolist() == [r[1] for r in ref]
    f32 = torch.float32
    assert torch.equal(mb.engine_logprobs, torch.tensor([r[2] for r in ref], dtype=f32))
    assert torch.equal(mb.advantages, torch.tensor([r[3] for r in ref], dtype=f32))
    assert torch.equal(mb.rewards, torch.tensor([r[4] for r in ref], dtype=f32))
    assert mb.tokens == sum(s.total_len for s in rows)
    assert mb.num_response_tokens == sum(sum(r[0]) for r in ref)
    assert mb.num_engine_logprobs == sum(sum(r[1]) for r in ref)
    # the trained positions in the flattened [B, W] grid of the model's outputs
    assert mb.trained_positions.tolist() == [
        b * width + j for b, r in enumerate(ref) for j, on in enumerate(r[0]) if on
    ]


def test_a_steps_micro_batches_are_built_on_first_use_with_the_normaliser_known_before():
    samples = _random_samples()
    batches = [[11, 0, 5], [3, 8, 1, 2], [], [4, 6, 7, 9, 10]]
    mbs = MicroBatches(samples, batches, pad_id=99, device=torch.device("cpu"))
    for agg in ("token-mean", "seq-mean-token-mean"):
        want = sum(
            float(loss_normalizer(MicroBatch(samples, b, 99, torch.device("cpu")).host_mask, agg)) for b in batches
        )
        assert mbs.normalizer(agg) == want
    assert mbs._built == {}  # the normaliser built nothing
    assert len(mbs) == 4 and mbs[1] is mbs[1] and mbs[-1] is mbs[3] and list(mbs._built) == [1, 3]
    assert [mb.indices for mb in mbs] == batches and mbs[2].empty
    with pytest.raises(ValueError, match="aggregation"):
        mbs.normalizer("sum")


def test_old_logprobs_pass_builds_micro_batches_only_when_it_computes_something():
    """Nothing to compute before the training pass (no recompute, reference or critic): no micro-batch is built
    there, so the training loop builds each one while the device runs the one before. With a reference model
    every micro-batch is built and gets its reference log-probs."""
    from types import SimpleNamespace

    from tidal.model.load import build_model, resolve_model
    from tidal.trainer.actor import TrainerActor

    def steps():
        return [MicroBatches(_samples(), [[0, 1], [2]], pad_id=0, device=torch.device("cpu"))]

    rank = SimpleNamespace(ref_model=None, critic=None, _stats_kw={}, _sync=lambda: None)
    idle = steps()
    TrainerActor._old_logprobs(rank, idle, None, None, recompute=False)
    assert idle[0]._built == {}
    rank.ref_model = build_model(resolve_model("tiny"), seed=0).eval()
    with_ref = steps()
    TrainerActor._old_logprobs(rank, with_ref, None, None, recompute=False)
    assert sorted(with_ref[0]._built) == [0, 1]
    assert [tuple(mb.ref_logprobs.shape) for mb in with_ref[0]] == [(2, 4), (1, 2)]


def test_a_staging_slot_sends_its_arrays_whole_and_is_reused():
    """A staging slot packs arrays of every dtype the micro-batch sends (aligned, in one buffer) and gives them
    back equal, shaped and typed as they were; refilled with larger arrays it grows, with smaller ones it keeps
    its buffer, and what it gave before does not change when it is refilled (on the CPU, copies)."""
    import numpy as np

    from tidal.trainer.microbatch import HostStaging, StagingSlot

    rng = np.random.default_rng(0)

    def arrays(n):
        return (
            rng.integers(0, 1000, (3, 2, n), dtype=np.int64),
            rng.random((2, 2, n - 1)) < 0.5,
            rng.random((2, 2 * n - 1), dtype=np.float32),
            np.flatnonzero(rng.random(n) < 0.5),
        )

    staging = HostStaging()
    slot = staging.slot(2)
    assert len(staging.slots) == 3 and staging.slot(2) is slot and isinstance(slot, StagingSlot)
    sent = []
    for n in (5, 40, 7):
        a = arrays(n)
        out = slot.send(a, torch.device("cpu"))
        sent.append((a, out))
        if n == 40:
            big = slot.host.numel()
        if n == 7:
            assert slot.host.numel() == big  # kept, not shrunk
    for a, out in sent:
        for x, t in zip(a, out):
            assert t.dtype == torch.from_numpy(x).dtype and tuple(t.shape) == x.shape
            assert np.array_equal(t.numpy(), x)
