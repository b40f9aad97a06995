"""A first stage's split backward (no input to differentiate): I runs the layers' backward, W the rest.

I must stop at the lowest products (``split_backward.first_stage``), not be empty,
and I then W must equal one plain backward in float64, on both paths (the graph
split, and layers that defer their own weight gradients), with every hook once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from split_backward import ChunkSplit
from split_backward.graph_split import backward_input
from split_models import Block, float64  # noqa: F401  (float64: autouse)

TOLERANCE = 1e-12


class Hooked(nn.Module):
    """A layer whose output gets a tensor hook (x3) on every forward; ``calls`` counts them."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.calls = 0

    def forward(self, x):
        h = self.layer(x)
        if h.requires_grad:
            h.register_hook(self._hook)
        return h

    def _hook(self, grad):
        self.calls += 1
        return grad * 3


class Embedding(nn.Module):
    def __init__(self, vocab=11, dim=16):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(8, dim)

    def forward(self, ids):
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))


class TiedHead(nn.Module):
    """An embedding and a head sharing a weight, in one chunk (a one-stage language model)."""

    def __init__(self, vocab=11, dim=16):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.embedding(ids))))


class Halves(nn.Module):
    """A Linear whose output is chunked in two (a node of two outputs below the next layers)."""

    def __init__(self, dim=16):
        super().__init__()
        self.linear, self.left, self.right = nn.Linear(dim, 2 * dim), nn.Linear(dim, 3), nn.Linear(dim, 3)

    def forward(self, x):
        a, b = self.linear(x).chunk(2, -1)
        return self.left(torch.tanh(a)) * self.right(b)


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).sum(0)


class Custom(nn.Module):
    """A custom autograd.Function with a weight of its own, first in the stage."""

    def __init__(self, dim=16):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return Scale.apply(x, self.weight)


class Reentrant(nn.Module):
    """A Linear under ``checkpoint(use_reentrant=True)``, whose backward refuses named inputs."""

    def __init__(self, dim=16):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.linear, x, use_reentrant=True)


def _chain():
    return nn.Sequential(*[Hooked(nn.Linear(16, 16)) for _ in range(4)], nn.Tanh(), nn.Linear(16, 3))


def _module_hooked():
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    model[0].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    model[0].register_full_backward_pre_hook(lambda module, grad_out: (grad_out[0] * 2,))
    return model


def _tokens():
    return torch.randint(0, 11, (3, 8))


def _rows():
    return torch.randn(7, 16)


def _images():
    return torch.randn(2, 3, 6, 6)


MODELS = {
    "linear chain with hooked outputs": (_chain, _rows),
    "embeddings then blocks": (lambda: nn.Sequential(Embedding(), Block(), Block()), _tokens),
    "a tied embedding and head": (TiedHead, _tokens),
    "convolutions and batch norm": (lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3),
        nn.Flatten(), nn.Linear(64, 3)), _images),
    "a weight-normed first layer": (lambda: nn.Sequential(
        parametrizations.weight_norm(nn.Linear(16, 16)), nn.Tanh(), nn.Linear(16, 3)), _rows),
    "a chunked output": (lambda: nn.Sequential(Halves()), _rows),
    "a custom Function first": (lambda: nn.Sequential(Custom(), nn.Linear(16, 16), nn.Tanh(),
                                                      nn.Linear(16, 3)), _rows),
    "module backward hooks on the first layer": (_module_hooked, _rows),
    "a reentrant checkpoint above": (lambda: nn.Sequential(nn.Linear(16, 16), Reentrant(),
                                                           nn.Linear(16, 3)), _rows),
}


def _hook_calls(model):
    return [module.calls for module in model.modules() if isinstance(module, Hooked)]


def _post_accumulate(model):
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    return fired


def _plain(model, x):
    out = model(x)
    out.backward(torch.ones_like(out))


@pytest.mark.parametrize("name", list(MODELS))
def test_graph_split_of_a_first_stage_equals_a_plain_backward(name):
    build, make_input = MODELS[name]
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    fired, expected_fired = _post_accumulate(model), _post_accumulate(reference)
    x = make_input()
    _plain(reference, x)
    out = model(x)
    found, weights = backward_input([out], [torch.ones_like(out)], [])
    assert found == ()
    weights.run()
    for (key, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, key
        assert (p.grad - q.grad).abs().max() < TOLERANCE, key
    assert sorted(fired) == sorted(expected_fired)  # once each
    assert _hook_calls(model) == _hook_calls(reference)


def test_i_runs_the_backward_through_every_layer_and_leaves_the_products_to_w():
    """Before, I was empty: every hook on a layer's output ran in W. Now they run in I (the
    lowest layer's at the capture where I stops), and no weight gradient is computed there."""
    torch.manual_seed(0)
    model = _chain()
    out = model(_rows())
    _, weights = backward_input([out], [torch.ones_like(out)], [])
    assert _hook_calls(model) == [1, 1, 1, 1]
    assert all(p.grad is None for p in model.parameters())
    assert not weights.keeps_graph and len(weights.captures) == 5  # each product's rule
    weights.run()
    assert _hook_calls(model) == [1, 1, 1, 1]
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("mode", ["layers", "auto", "graph"])
def test_a_chunk_split_of_a_tied_embedding_and_head_on_a_first_stage(mode):
    """The head defers its weight gradient and the embedding reads the same weight: I takes
    the graph split, which had no input chain, so the head's record was made in W and lost
    (its weight got only the embedding's share)."""
    torch.manual_seed(0)
    model, reference = TiedHead(), None
    reference = copy.deepcopy(model)
    fired, expected_fired = _post_accumulate(model), _post_accumulate(reference)
    split = ChunkSplit(model, mode)
    split.install()
    for microbatch in range(3):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        x = _tokens()
        with split.forwarding(microbatch):
            out = model(x)
        _, weights = split.backward_input([out], [torch.ones_like(out)], [], microbatch)
        weights.run()
        _plain(reference, x)
        for (key, p), q in zip(model.named_parameters(), reference.parameters()):
            assert p.grad is not None and (p.grad - q.grad).abs().max() < TOLERANCE, key
    assert sorted(fired) == sorted(expected_fired)


@pytest.mark.parametrize("mode", ["auto", "graph"])
def test_a_first_stage_of_small_layers_splits_too(mode):
    """Products below ``MIN_PRODUCT`` and nothing larger: ``"auto"`` defers them all the same
    (cheaper than the graph split), ``"graph"`` stops at the lowest product instead of
    leaving I empty. Either way I runs every layer's backward once, W the weights'."""
    torch.manual_seed(0)
    model = _chain()
    reference = copy.deepcopy(model)
    x = _rows()
    _plain(reference, x)
    split = ChunkSplit(model, mode)
    split.install()
    with split.forwarding(0):
        out = model(x)
    _, weights = split.backward_input([out], [torch.ones_like(out)], [], 0)
    assert len(weights.records) == (5 if mode == "auto" else 0)
    assert _hook_calls(model) == [1, 1, 1, 1]
    assert all(p.grad is None for p in model.parameters()), "a weight gradient in I"
    weights.run()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad - q.grad).abs().max() < 1e-12


class TracedConv1D(nn.Module):
    """A traced GPT-2 projection (``aten.addmm`` pointed at ``traced_linears.addmm``, its
    weight stored (in, out)) first in the stage, its weight read again by a product."""

    def __init__(self, dim=16):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / 4)
        self.bias = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        from split_backward.traced_linears import addmm

        return torch.tanh(addmm(self.bias, x, self.weight)) @ self.weight.t()


def test_a_traced_product_below_the_stops_still_records_in_i():
    """A deferring node below every weight rule: I must still run it (its record is taken
    in I), so the stops lie below it, at its anchor."""
    torch.manual_seed(0)
    model = TracedConv1D()
    reference = copy.deepcopy(model)
    split = ChunkSplit(model, "layers")
    split.install()
    for microbatch in range(2):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        x = _rows()
        with split.forwarding(microbatch):
            out = model(x)
        _, weights = split.backward_input([out], [torch.ones_like(out)], [], microbatch)
        assert len(weights.records) == 1
        weights.run()
        _plain(reference, x)
        for (key, p), q in zip(model.named_parameters(), reference.parameters()):
            assert p.grad is not None and (p.grad - q.grad).abs().max() < TOLERANCE, key


def test_an_input_no_path_reaches_is_a_first_stage_too():
    """An input the outputs do not depend on: its gradient is None, and I still stops at the
    lowest products."""
    torch.manual_seed(0)
    model = _chain()
    reference = copy.deepcopy(model)
    x = _rows()
    unused = torch.randn(3, requires_grad=True)
    out = model(x)
    found, weights = backward_input([out], [torch.ones_like(out)], [unused])
    assert found == (None,) and _hook_calls(model) == [1, 1, 1, 1]
    weights.run()
    _plain(reference, x)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad - q.grad).abs().max() < TOLERANCE
