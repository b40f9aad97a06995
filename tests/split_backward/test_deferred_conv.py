"""Convolutions that defer their own weight gradients (``deferred_conv``), against a plain backward.

As in ``test_chunk_split``: micro-batches through a ``ChunkSplit`` (the first by the
graph split, the others with the layers switched on), each input gradient and
``.grad`` equal to a plain backward's in float64; hooks counted.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_chunk_split import TOLERANCE, _compare, _records_of_last, float64  # noqa: F401
from torch import nn

from split_backward import ChunkSplit


def _block(**options):
    options = {"padding": 1, **options}

    def build():
        return nn.Sequential(nn.Conv2d(4, 8, 3, **options), nn.BatchNorm2d(8),
                             nn.ReLU(inplace=True), nn.Conv2d(8, 4, 1, bias=False))
    return build


class Twice(nn.Module):
    """One convolution called twice, and one whose weight a second convolution shares."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.tied = nn.Conv2d(4, 4, 3, padding=1)
        self.tied.weight = self.conv.weight

    def forward(self, x):
        return self.tied(torch.tanh(self.conv(torch.tanh(self.conv(x)))))


def test_convolutions_leave_their_weight_gradients_to_w():
    model, weights = _records_of_last(_block(), rows=2, shape=(4, 6, 6))
    assert len(weights.records) == 2 and not weights.captures
    assert model[0].weight.grad is None and model[0].bias.grad is None and model[3].weight.grad is None
    assert model[1].weight.grad is not None  # BatchNorm's, in I
    weights.run()
    assert model[0].weight.grad is not None and model[0].bias.grad is not None


@pytest.mark.parametrize("options", [
    {}, {"stride": 2}, {"dilation": 2, "padding": 2}, {"groups": 2}, {"padding_mode": "reflect"},
    {"padding_mode": "circular", "stride": (1, 2)}, {"bias": False}],
    ids=["plain", "stride", "dilation", "groups", "reflect", "circular", "no bias"])
def test_conv2d_is_exact(options):
    _compare(_block(**options), rows=2, shape=(4, 6, 6))


def test_conv1d_and_conv3d_are_exact():
    _compare(lambda: nn.Sequential(nn.Conv1d(3, 5, 3, stride=2), nn.Tanh(), nn.Conv1d(5, 2, 1)),
             rows=2, shape=(3, 9))
    _compare(lambda: nn.Sequential(nn.Conv3d(2, 3, 2), nn.Tanh(), nn.Conv3d(3, 2, 1)),
             rows=2, shape=(2, 4, 4, 4))


def test_same_padding_and_unbatched_inputs_stay_native():
    model, weights = _records_of_last(lambda: nn.Sequential(nn.Conv2d(4, 4, 3, padding="same")),
                                      rows=2, shape=(4, 5, 5))
    assert not weights.records and weights.captures  # the graph split, for want of a record
    _compare(lambda: nn.Sequential(nn.Conv2d(4, 4, 3, padding="same")), rows=2, shape=(4, 5, 5))
    model, weights = _records_of_last(lambda: nn.Sequential(nn.Conv1d(4, 4, 3)), rows=4, shape=(7,))
    assert not weights.records and weights.captures  # (channels, length): no batch dimension
    _compare(lambda: nn.Sequential(nn.Conv1d(4, 4, 3)), rows=4, shape=(7,))


def test_first_chunk_without_input_gradient():
    model, weights = _records_of_last(_block(), rows=2, shape=(4, 6, 6), grad_input=False)
    assert len(weights.records) == 2
    _compare(_block(), rows=2, shape=(4, 6, 6), grad_input=False)


def test_a_convolution_called_twice_and_a_shared_weight_accumulate_once():
    def hooks(model):
        calls = {}
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, seen=calls.setdefault(name, []): seen.append(p.grad.clone()))
        return calls

    model, weights = _records_of_last(Twice, rows=2, shape=(4, 5, 5))
    assert len(weights.records) == 3
    _, _, (mine, theirs) = _compare(Twice, rows=2, shape=(4, 5, 5), hooks=hooks)
    assert list(mine) == list(theirs) and len(mine) == 3  # the shared weight once
    for name in mine:
        assert len(mine[name]) == len(theirs[name]) == 3, name
        for found, expected in zip(mine[name], theirs[name]):
            assert (found - expected).abs().max() < TOLERANCE, name


def test_auto_leaves_convolutions_to_the_graph_split():
    """They measured no faster deferred by their layers (the ResNet stage); "layers" defers them."""
    wide = lambda: nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.Linear(16, 64))  # noqa: E731
    model, weights = _records_of_last(wide, mode="auto", rows=2, shape=(32, 16, 16))
    assert len(weights.records) == 1 and weights.records[0].weight is model[1].weight
    assert model[0].weight.grad is not None  # in the plain I, as the Linear deferred
    _compare(wide, mode="auto", rows=2, shape=(32, 16, 16))


def test_bf16_autocast_matches_the_plain_backward_under_autocast():
    torch.manual_seed(0)
    model = _block()().float()
    reference = copy.deepcopy(model)
    split = ChunkSplit(model, "layers")
    split.install()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float32)
    leaf = x.clone().requires_grad_()
    with split.forwarding(0), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(leaf)
    (found,), weights = split.backward_input([out], [torch.ones_like(out)], [leaf], 0)
    assert len(weights.records) == 2
    weights.run()
    reference_leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference_out = reference(reference_leaf)
    reference_out.backward(torch.ones_like(reference_out))
    assert out.dtype == reference_out.dtype
    scale = max(1.0, reference_leaf.grad.abs().max())
    assert found.dtype == torch.float32 and (found - reference_leaf.grad).abs().max() < 2e-2 * scale
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32
        assert (p.grad - q.grad).abs().max() <= 2e-2 * max(1.0, q.grad.abs().max())
