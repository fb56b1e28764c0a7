"""``tidal.memory.home``: storages moved into a region in place, each once (optimizer state after its first step)."""

from __future__ import annotations

import contextlib

import torch

from tidal.memory.home import Adopter, rehome


def test_rehome_moves_each_storage_once_and_keeps_views():
    entered = []

    @contextlib.contextmanager
    def region():
        entered.append(1)
        yield

    a = torch.arange(12, dtype=torch.float32)
    view = a[3:7]  # shares a's storage
    b = torch.ones(5)
    before = (a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr())
    expect_a, expect_b = a.clone(), b.clone()
    assert rehome([a, view, b], region) == a.untyped_storage().nbytes() + b.untyped_storage().nbytes()
    assert len(entered) == 2, "one fresh allocation per distinct storage, each inside its own region context"
    assert (a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()) != before
    assert torch.equal(a, expect_a) and torch.equal(b, expect_b)
    view.fill_(-1)  # the view still aliases a
    assert torch.equal(a[3:7], torch.full((4,), -1.0))
    rehome([b], region, zero=True)
    assert torch.equal(b, torch.zeros(5))


def test_adopter_moves_new_state_only():
    adopter = Adopter(contextlib.nullcontext)
    first = [torch.randn(4), torch.randn(3)]
    assert adopter.adopt(first) == 4 * 4 + 3 * 4
    ptr = first[0].untyped_storage().data_ptr()
    later = torch.randn(2)  # state created by a later step
    assert adopter.adopt([*first, later]) == 2 * 4
    assert first[0].untyped_storage().data_ptr() == ptr, "adopted storages are not moved again"
    assert adopter.adopt([*first, later]) == 0


def test_without_the_swap_the_step_runs_inside_the_region_and_rehome_refuses(monkeypatch):
    """torch releases without ``UntypedStorage._swap_data_ptr_`` (2.11): the optimizer step runs inside the
    region (its state is born there), adopt moves nothing, and rehome stops with one clear line."""
    import pytest

    from tidal.errors import UserError
    from tidal.memory import home

    entered = []

    @contextlib.contextmanager
    def region():
        entered.append(1)
        yield

    monkeypatch.setattr(home, "CAN_SWAP", False)
    adopter = Adopter(region)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    with adopter.stepping():
        opt.step()
    assert entered == [1], "the step ran inside the region"
    state = [v for v in opt.state[p].values() if torch.is_tensor(v) and v.dim()]
    assert adopter.adopt(state) == 0
    assert rehome([], region) == 0
    with pytest.raises(UserError, match="_swap_data_ptr_"):
        rehome([torch.ones(2)], region)
    monkeypatch.setattr(home, "CAN_SWAP", True)
    with Adopter(region).stepping():
        pass
    assert entered == [1], "with the swap the step runs outside any region"
