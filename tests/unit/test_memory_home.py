"""``tidal.memory.home``: storages moved into a region after they were allocated, each once, sharing kept, with
and without torch's in-place block swap (torch 2.11 lacks ``UntypedStorage._swap_data_ptr_``)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tidal.errors import UserError
from tidal.memory import home
from tidal.memory.home import Adopter, rehome, storage_users


class _Region:
    """A region that counts its entries (CPU has no allocator tags)."""

    def __init__(self):
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self):
        self.entered += 1
        yield


@pytest.fixture(params=[True, False], ids=["swap", "no-swap"])
def can_swap(request, monkeypatch):
    if request.param and not home.CAN_SWAP:
        pytest.skip("this torch has no UntypedStorage._swap_data_ptr_")
    monkeypatch.setattr(home, "CAN_SWAP", request.param)
    return request.param


def test_rehome_repoints_every_given_tensor_and_keeps_sharing(can_swap):
    region = _Region()
    a = torch.arange(12, dtype=torch.float32)
    view = a[3:7]  # shares a's storage
    b = torch.ones(5)
    assert storage_users(a) == 2 and storage_users(b) == 1
    before = (a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr())
    expect_a, expect_b = a.clone(), b.clone()
    assert rehome([a, view, b, a], region) == 12 * 4 + 5 * 4
    assert region.entered == 2, "one fresh allocation per distinct storage, each inside its own region context"
    assert (a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()) != before
    assert torch.equal(a, expect_a) and torch.equal(b, expect_b) and torch.equal(view, expect_a[3:7])
    assert view.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() and storage_users(a) == 2
    view.fill_(-1)  # the view still aliases a
    assert torch.equal(a[3:7], torch.full((4,), -1.0))
    rehome([b], region, zero=True)
    assert torch.equal(b, torch.zeros(5))


def test_a_rehomed_parameter_keeps_its_gradient_hooks(can_swap):
    """Megatron's DDP re-points each parameter into a flat buffer and accumulates its gradient from a hook on the
    parameter's gradient accumulator: moving the buffer must keep that accumulator (``Tensor.set_`` would not)."""
    flat = torch.arange(10, dtype=torch.float32)
    p = torch.nn.Parameter(torch.zeros(4))
    p.data = flat[2:6]
    grads = []
    accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
    accumulator.register_hook(lambda *_: grads.append(p.grad.clone()))
    assert rehome([flat, p], _Region()) == 40
    assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() and p.storage_offset() == 2
    (p * torch.arange(4.0)).sum().backward()
    assert len(grads) == 1 and torch.equal(grads[0], torch.arange(4.0)), "the hook still fires"
    assert p.expand_as(p).grad_fn.next_functions[0][0] is accumulator


def test_a_storage_with_users_not_given_is_swapped_or_refused(can_swap):
    """A view held elsewhere would silently stop sharing if only ``a`` were re-pointed: with the swap the whole
    storage moves (the view follows); without it nothing moves and one line says why."""
    region = _Region()
    a, other = torch.arange(6.0), torch.ones(3)
    hidden = a[1:3]
    ptrs = (a.untyped_storage().data_ptr(), other.untyped_storage().data_ptr())
    if can_swap:
        assert rehome([other, a], region) == 3 * 4 + 6 * 4
        hidden.fill_(7)
        assert a[1:3].tolist() == [7.0, 7.0] and a.untyped_storage().data_ptr() != ptrs[0]
    else:
        with pytest.raises(UserError, match="may use \\(2 tensors use a storage of 24 bytes, 1 given.*_swap_data_ptr_"):
            rehome([other, a], region)
        assert region.entered == 0
        assert (a.untyped_storage().data_ptr(), other.untyped_storage().data_ptr()) == ptrs, "nothing moved"


def _train(adopter: Adopter | None, steps: int) -> tuple[list[torch.Tensor], list[tuple[list[int], list[int]]]]:
    """A few AdamW steps of a small seeded model, its state adopted after each; the final parameters and the
    state's data pointers before and after each adoption."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 6), torch.randn(16, 2)
    ptrs = []
    for _ in range(steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
        before = [t.untyped_storage().data_ptr() for t in state]
        if adopter is not None:
            adopter.adopt(state)
        ptrs.append((before, [t.untyped_storage().data_ptr() for t in state]))
    return [p.detach().clone() for p in model.parameters()], ptrs


def test_adopted_optimizer_state_trains_bit_for_bit_like_state_left_in_place(can_swap):
    """The first step's moments (AdamW: two per parameter, no views) move into the region, once; training goes
    on bit for bit as without the move."""
    region = _Region()
    adopter = Adopter(region)
    expect, _ = _train(None, 4)
    got, ptrs = _train(adopter, 4)
    assert all(torch.equal(g, e) for g, e in zip(got, expect))
    assert region.entered == 8, "4 parameters x 2 moments, each moved once"
    before, after = ptrs[0]
    assert len(after) == 8 and all(a != b for a, b in zip(after, before)), "the first step's state got new blocks"
    assert all(p == (after, after) for p in ptrs[1:]), "adopted state is not moved again"
    replaced = [torch.zeros(3)]  # state replaced (a checkpoint load makes new tensors) is adopted again
    assert adopter.adopt(replaced) == 12 and adopter.adopt(replaced) == 0


def test_a_torch_without_use_counts_moves_only_by_swapping(can_swap, monkeypatch):
    """Where torch cannot count a storage's users, re-pointing could break sharing unseen: swap, or refuse."""
    monkeypatch.setattr(home, "_HAS_USE_COUNT", False)
    state = torch.ones(4)
    if can_swap:
        assert rehome([state], _Region()) == 16 and torch.equal(state, torch.ones(4))
    else:
        with pytest.raises(UserError, match="an unknown number of tensors"):
            rehome([state], _Region())
