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
