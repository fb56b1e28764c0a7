"""The compiled decoder layers' dynamic sizes (``tidal.trainer.sharding.DynamicRowsForward``): one graph for every
micro-batch shape from the first call on, the same outputs as the eager layer.

Dynamo runs here with a backend that counts the graphs it is handed and runs them as traced (no inductor, so no
C++ compiler is needed); which graphs Dynamo makes, and when it makes another, do not depend on the backend."""

from __future__ import annotations

import pytest
import torch

from tidal.model.load import build_model, resolve_model
from tidal.trainer.sharding import DynamicRowsForward, marked_dims


class GraphCounter:
    """A Dynamo backend: counts the graphs and runs each as traced."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo's caches emptied before and after, so no graph counted here comes from, or stays for, another test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layer_calls(wrap, shapes):
    """Call the tiny model's first decoder layer (as its model calls it: rotary embeddings from position ids)
    at every (rows, length) of ``shapes``; the outputs and the eager layer's."""
    model = build_model(resolve_model("tiny"), seed=0)
    inner = model.model
    layer = inner.layers[0]
    eager = layer.forward
    layer.forward = wrap(eager)
    got, want = [], []
    for rows, length in shapes:
        hidden = torch.randn(rows, length, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
        position_ids = torch.arange(length).unsqueeze(0)
        rope = inner.rotary_emb(hidden, position_ids)
        with torch.no_grad():
            got.append(layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=rope))
            want.append(eager(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=rope))
    return got, want


@pytest.mark.parametrize("dynamic", [False, True])
def test_one_graph_serves_every_shape_when_marked(dynamic):
    counter = GraphCounter()

    def wrap(forward):
        compiled = torch.compile(forward, backend=counter)
        return DynamicRowsForward(compiled) if dynamic else compiled

    got, want = _layer_calls(wrap, [(2, 48), (5, 256), (4, 32), (3, 40)])
    # Unmarked: a graph for the first shape, a dynamic one from the second on. Marked: the first is dynamic.
    assert counter.graphs == (1 if dynamic else 2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_call_laid_out_otherwise_is_passed_on_unmarked():
    calls = []

    def forward(hidden, *args, **kwargs):
        calls.append([getattr(t, "_dynamo_weak_dynamic_indices", None) for t in (hidden, *kwargs.values())])
        return hidden

    wrapped = DynamicRowsForward(forward)
    wrapped(torch.zeros(2, 8, 4), position_ids=torch.zeros(1, 8))
    wrapped(torch.zeros(3, 16, 4), position_ids=torch.zeros(1, 16))
    wrapped(torch.zeros(3, 16, 4), position_ids=torch.zeros(1, 16), attention_mask=torch.zeros(3, 1, 16, 16))
    assert calls[0] == [{0, 1}, {1}]
    assert calls[1] == [{0, 1}, {1}]  # the first call's dimensions, at new sizes
    assert calls[2] == [None, None, None]
    by_name = []
    named = DynamicRowsForward(lambda hidden_states, **kw: by_name.append(hidden_states._dynamo_weak_dynamic_indices))
    named(hidden_states=torch.zeros(2, 8, 4))
    assert by_name == [{0, 1}]


def test_marked_dims_are_those_of_the_batch_and_length_sizes_above_one():
    leaves = [torch.zeros(4, 24, 64), torch.zeros(1, 24, 8), None, torch.zeros(24), 3]
    assert marked_dims(leaves, (4, 24)) == [(0, 1), (1,), (), (0,), ()]
    assert marked_dims([torch.zeros(1, 24, 64)], (1, 24)) == [(1,)]
