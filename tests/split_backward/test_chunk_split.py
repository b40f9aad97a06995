"""Linear layers that defer their own weight gradients (``ChunkSplit``), against a plain backward.

Each case runs micro-batches through a ``ChunkSplit`` as a chunk does (forward, I,
W), the first before the layers are switched on (the graph split), the others
with them, and compares in float64 the input gradients and each micro-batch's
``.grad`` with a plain backward of a copy; hooks are counted and read.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from split_backward import ChunkSplit, WeightGradients
from split_backward.switched_layers import _AttentionForward, _LinearForward
from split_models import float64  # noqa: F401  (autouse: this module runs in float64)

TOLERANCE = 1e-10


class TiedHead(nn.Module):
    """A soft embedding reading the head's weight, then the head: a tie inside one chunk."""

    def __init__(self, width=16, vocab=5):
        super().__init__()
        self.head = nn.Linear(width, vocab)
        self.vocab = vocab

    def forward(self, x):
        h = x + torch.softmax(x[..., :self.vocab], -1) @ self.head.weight
        return self.head(torch.tanh(h))


class Twice(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return self.linear(torch.tanh(self.linear(x)))


class Attention(nn.Module):
    """A pre-norm self-attention block with an MLP; ``cross`` attends to a projection of the
    input instead; ``tied`` reads the out-projection's weight once more."""

    def __init__(self, width=16, heads=2, dropout=0.0, batch_first=True, need_weights=False,
                 masked=False, cross=False, tied=False, kdim=None, bias=True):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, bias=bias,
                                               batch_first=batch_first, kdim=kdim, vdim=kdim)
        self.memory = nn.Linear(width, kdim or width)
        self.mlp = nn.Linear(width, width)
        self.options = dict(need_weights=need_weights, masked=masked, cross=cross, tied=tied)

    def forward(self, x):
        options = self.options
        h = self.norm(x)
        kv = self.memory(torch.tanh(x)) if options["cross"] else h
        length = x.shape[1] if self.attention.batch_first else x.shape[0]
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool), 1) if options["masked"] else None
        a, _ = self.attention(h, kv, kv, need_weights=options["need_weights"], attn_mask=mask)
        x = x + a
        if options["tied"]:
            x = x + torch.tanh(x) @ self.attention.out_proj.weight
        return x + self.mlp(x)


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 16))


def _step(split, model, x, microbatch, grad_input=True):
    leaf = x.detach().requires_grad_(grad_input)
    with split.forwarding(microbatch):
        out = model(leaf)
    found, weights = split.backward_input([out], [torch.ones_like(out)], [leaf] if grad_input else [],
                                          microbatch)
    return found, weights


def _reference(model, x, grad_input=True):
    model.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_(grad_input)
    out = model(leaf)
    out.backward(torch.ones_like(out))
    return leaf.grad


def _compare(build, mode="layers", microbatches=3, rows=6, grad_input=True, shape=(16,),
             hooks=None):
    """Per micro-batch: input gradient and every ``.grad`` equal the plain backward's; returns
    the ``WeightGradients`` of the last micro-batch and the hook readings of both copies."""
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    readings = [hooks(m) for m in (model, reference)] if hooks else None
    split = ChunkSplit(model, mode)
    weights = None
    for microbatch in range(microbatches):
        x = torch.randn(rows, *shape)
        model.zero_grad(set_to_none=True)
        seed = torch.seed()  # the same dropout draws in both forwards
        found, weights = _step(split, model, x, microbatch, grad_input)
        weights.run()
        torch.manual_seed(seed)
        expected = _reference(reference, x, grad_input)
        if grad_input:
            assert (found[0] - expected).abs().max() < TOLERANCE
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if q.grad is None:  # a parameter this model leaves unused
                assert p.grad is None, name
                continue
            assert p.grad is not None, name
            assert (p.grad - q.grad).abs().max() < TOLERANCE, name
    return split, weights, readings


def _records_of_last(build, mode="layers", rows=6, grad_input=True, shape=(16,)):
    """The records micro-batch 1 (the layers on) leaves for W, and whether I left .grad."""
    torch.manual_seed(0)
    model = build()
    split = ChunkSplit(model, mode)
    for microbatch in range(2):
        model.zero_grad(set_to_none=True)
        _, weights = _step(split, model, torch.randn(rows, *shape), microbatch, grad_input)
        if microbatch == 1:
            return model, weights
        weights.run()


def test_linear_layers_defer_and_the_rest_stays_in_i():
    model, weights = _records_of_last(_mlp)
    assert len(weights.records) == 2 and not weights.captures and not weights.keeps_graph
    assert model[0].weight.grad is None and model[3].bias.grad is None   # left for W
    assert model[1].weight.grad is not None                              # the norm's, in I
    weights.run()
    assert model[0].weight.grad is not None and model[3].bias.grad is not None


def test_mlp_exact_under_every_mode():
    for mode in ("layers", "auto", "graph"):
        _compare(_mlp, mode)


def test_first_chunk_without_input_gradient_still_splits():
    model, weights = _records_of_last(_mlp, grad_input=False)
    assert len(weights.records) == 2 and model[1].weight.grad is not None
    _compare(_mlp, grad_input=False)


def test_three_dimensional_inputs():
    _compare(_mlp, rows=3, shape=(5, 16))


def _record_post_accumulate(model):
    """Per parameter name, each gradient its post-accumulate hook saw."""
    calls = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, seen=calls.setdefault(name, []): seen.append(p.grad.clone()))
    return calls


def test_linear_used_twice_and_tied_weights_accumulate_once():
    def tied():
        first, second = nn.Linear(16, 16), nn.Linear(16, 16)
        second.weight = first.weight
        return nn.Sequential(first, nn.Tanh(), second, Twice())

    _, _, (mine, theirs) = _compare(tied, microbatches=3, hooks=_record_post_accumulate)
    assert list(mine) == list(theirs) and len(mine) == 5  # the tied weight once
    for name in mine:  # once per micro-batch, each seeing the whole gradient
        assert len(mine[name]) == len(theirs[name]) == 3, name
        for found, expected in zip(mine[name], theirs[name]):
            assert (found - expected).abs().max() < TOLERANCE, name


def test_a_tied_head_read_elsewhere_in_the_chunk_leaves_its_whole_gradient_to_w():
    """The head's weight is also read by the soft embedding: a plain I would accumulate that
    share in I and W would accumulate again (hooks twice); the graph split takes that share
    to W, where the recorded product joins it."""
    def hooks(model):
        calls = []
        model.head.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
        model.head.weight.register_hook(lambda g: calls.append(-g))  # a tensor hook: once, too
        return calls

    model, weights = _records_of_last(TiedHead)
    assert len(weights.records) == 1 and model.head.weight.grad is None
    _, _, (mine, theirs) = _compare(TiedHead, microbatches=3, hooks=hooks)
    assert len(mine) == len(theirs) == 6
    for found, expected in zip(mine, theirs):
        assert (found - expected).abs().max() < TOLERANCE


def test_tensor_hook_on_a_deferred_weight_runs_once_on_its_whole_gradient():
    def hooks(model):
        calls = []
        model[3].weight.register_hook(lambda g, calls=calls: calls.append(1) or 3 * g)
        return calls

    _, _, (mine, theirs) = _compare(_mlp, microbatches=3, hooks=hooks)
    assert len(mine) == len(theirs) == 3


def test_a_whole_backward_runs_the_records_at_once():
    torch.manual_seed(0)
    model = _mlp()
    reference = copy.deepcopy(model)
    split = ChunkSplit(model, "layers")
    split.install()
    x = torch.randn(6, 16)
    with split.forwarding(0):
        out = model(x.requires_grad_())
    (found,) = split.backward([out], [torch.ones_like(out)], [x], 0)
    assert found is x.grad
    _reference(reference, x)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad - q.grad).abs().max() < TOLERANCE
    assert not split.records


def test_non_reentrant_checkpoint_inside_the_chunk():
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = _mlp()

        def forward(self, x):
            return checkpoint(self.mlp, x, use_reentrant=False)

    model, weights = _records_of_last(Checkpointed)
    assert len(weights.records) == 2
    _compare(Checkpointed)


def test_auto_leaves_small_products_native_beside_large_ones():
    model, weights = _records_of_last(_mlp, mode="auto")
    # 6 x 16 x 32 multiply-adds, and nothing larger in the chunk: deferred all the same (else
    # the graph split would take them, which costs more than the deferring Function)
    assert len(weights.records) == 2
    wide = lambda: nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))  # noqa: E731
    model, weights = _records_of_last(wide, mode="auto", rows=8, shape=(256,))
    assert len(weights.records) == 1  # 8 x 256 x 256 deferred, 8 x 256 x 8 not
    assert model[2].weight.grad is not None and model[0].weight.grad is None
    # A small product ahead of the first large one defers until the large one has run once.
    torch.manual_seed(0)
    small_first = nn.Sequential(nn.Linear(4, 256), nn.Tanh(), nn.Linear(256, 256))
    split = ChunkSplit(small_first, "auto")
    counts = []
    for microbatch in range(3):
        _, weights = _step(split, small_first, torch.randn(8, 4), microbatch, True)
        counts.append(len(weights.records))
        weights.run()
    assert counts == [0, 2, 1]  # before the switch, the first switched forward, then on


def test_graph_mode_never_switches_a_layer():
    model, weights = _records_of_last(_mlp, mode="graph")
    assert not weights.records and "forward" not in model[0].__dict__


def test_layers_outside_the_split_stay_themselves():
    """State dict keys, parameter objects, copies and pickles are unchanged; outside a chunk's
    forward the layer is nn.Linear's own forward (its gradient in the backward)."""
    torch.manual_seed(0)
    model = _mlp()
    keys, parameters = list(model.state_dict()), list(model.parameters())
    split = ChunkSplit(model, "layers")
    split.install()
    assert isinstance(model[0].__dict__["forward"], _LinearForward)
    assert list(model.state_dict()) == keys
    assert all(p is q for p, q in zip(model.parameters(), parameters))
    copied = copy.deepcopy(model)
    assert copied[0].forward.module is copied[0]
    loaded = pickle.loads(pickle.dumps(model))
    assert loaded[0].forward.module is loaded[0]
    out = model(torch.randn(4, 16))
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters()) and not split.records


def test_subclasses_with_their_own_forward_and_parametrized_weights_stay_native():
    class Lora(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    def build():
        layer = nn.Linear(16, 16)
        nn.utils.parametrizations.weight_norm(layer)
        return nn.Sequential(Lora(16, 16), nn.Tanh(), layer)

    model, weights = _records_of_last(build)
    assert not weights.records and "forward" not in model[0].__dict__
    assert "forward" not in model[2].__dict__
    _compare(build)


def test_a_parametrization_with_state_runs_once_a_forward():
    """Spectral norm steps its power iteration on every read of the weight: the split must not
    read it again (its vectors would differ from a plain forward's)."""
    def build():
        return nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16)), nn.Tanh(),
                             nn.Linear(16, 16))

    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    split = ChunkSplit(model, "layers")
    split.install()
    for microbatch in range(3):
        x = torch.randn(6, 16)
        with split.forwarding(microbatch):
            model(x)
        reference(x)
        for a, b in zip(model.buffers(), reference.buffers()):
            assert torch.equal(a, b)


def test_bf16_autocast_matches_the_plain_backward_under_autocast():
    torch.manual_seed(0)
    model = _mlp().float()
    reference = copy.deepcopy(model)
    split = ChunkSplit(model, "layers")
    split.install()
    x = torch.randn(6, 16, dtype=torch.float32)
    leaf = x.clone().requires_grad_()
    with split.forwarding(0), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(leaf)
    (found,), weights = split.backward_input([out], [torch.ones_like(out)], [leaf], 0)
    assert len(weights.records) == 2
    weights.run()
    ref_leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = reference(ref_leaf)
    ref_out.backward(torch.ones_like(ref_out))
    assert found.dtype == torch.float32 and (found - ref_leaf.grad).abs().max() < 1e-2
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32
        assert (p.grad - q.grad).abs().max() <= 1e-2 * max(1.0, q.grad.abs().max())


def test_attention_projections_defer_their_weight_gradients():
    """MultiheadAttention calls linear on its own parameters (the packed in-projection, the
    out-projection): their weight gradients are left for W, with the MLP's."""
    model, weights = _records_of_last(Attention, rows=3, shape=(5, 16))
    assert len(weights.records) == 3 and not weights.captures
    attention = model.attention
    assert attention.in_proj_weight.grad is None and attention.out_proj.weight.grad is None
    assert attention.in_proj_bias.grad is None and model.norm.weight.grad is not None
    weights.run()
    assert attention.in_proj_weight.grad is not None and attention.out_proj.bias.grad is not None


@pytest.mark.parametrize("options", [
    {}, {"need_weights": True}, {"batch_first": False}, {"masked": True},
    {"dropout": 0.3}, {"dropout": 0.3, "need_weights": True, "masked": True}],
    ids=["plain", "weights", "sequence first", "causal mask", "dropout", "dropout weights mask"])
def test_attention_is_exact(options):
    _compare(lambda: Attention(**options), rows=3, shape=(5, 16), microbatches=3)


def test_cross_attention_defers_the_out_projection_and_leaves_the_sliced_ones():
    """Query apart from key and value: torch slices the packed weight (w.split), a view that
    cannot defer; the out-projection still does."""
    model, weights = _records_of_last(lambda: Attention(cross=True), rows=3, shape=(5, 16))
    assert len(weights.records) == 3  # memory, out-projection, mlp
    assert model.attention.in_proj_weight.grad is not None
    assert model.attention.out_proj.weight.grad is None
    _compare(lambda: Attention(cross=True), rows=3, shape=(5, 16))


def test_separate_projection_weights_defer():
    build = lambda: Attention(cross=True, kdim=8, bias=False)  # noqa: E731
    model, weights = _records_of_last(build, rows=3, shape=(5, 16))
    assert len(weights.records) == 6  # memory, q, k, v, out-projection, mlp
    assert model.attention.q_proj_weight.grad is None
    _compare(build, rows=3, shape=(5, 16))


def test_attention_weight_read_elsewhere_and_attention_called_twice_accumulate_once():
    for build in (lambda: Attention(tied=True), lambda: nn.Sequential(*[Attention()] * 2)):
        _, _, (mine, theirs) = _compare(build, rows=3, shape=(5, 16),
                                        hooks=_record_post_accumulate)
        assert list(mine) == list(theirs)
        for name in mine:
            wanted = 0 if "memory" in name else 3  # unused without cross-attention
            assert len(mine[name]) == len(theirs[name]) == wanted, name
            for found, expected in zip(mine[name], theirs[name]):
                assert (found - expected).abs().max() < TOLERANCE, name


def test_attention_outside_the_split_is_its_own():
    torch.manual_seed(0)
    model = Attention()
    split = ChunkSplit(model, "layers")
    split.install()
    assert isinstance(model.attention.__dict__["forward"], _AttentionForward)
    copied = pickle.loads(pickle.dumps(model))
    assert copied.attention.forward.module is copied.attention
    model(torch.randn(3, 5, 16)).sum().backward()
    assert all(p.grad is not None for name, p in model.named_parameters()
               if not name.startswith("memory")) and not split.records


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'auto', 'layers', 'graph', got 'layer'"):
        ChunkSplit(_mlp(), "layer")


def test_empty_weight_gradients_have_nothing_to_do():
    assert WeightGradients([], []).empty


def test_a_whole_backward_of_a_tied_head_accumulates_once():
    """B after a deferring forward, where the deferred weight is read elsewhere too (DualPipe-V
    runs B and I/W in one chunk): an I then its W, one post-accumulate hook call."""
    torch.manual_seed(0)
    model = TiedHead()
    reference = copy.deepcopy(model)
    calls = []
    model.head.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    split = ChunkSplit(model, "layers")
    split.install()
    x = torch.randn(6, 16)
    leaf = x.clone().requires_grad_()
    with split.forwarding(0):
        out = model(leaf)
    (found,) = split.backward([out], [torch.ones_like(out)], [leaf], 0)
    expected = _reference(reference, x)
    assert (found - expected).abs().max() < TOLERANCE
    assert len(calls) == 1 and (calls[0] - reference.head.weight.grad).abs().max() < TOLERANCE
