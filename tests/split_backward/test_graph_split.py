"""The split backward (I then W) against one plain backward, on the layers real models use.

Every case compares, in float64, the input gradients I returns and the ``.grad``
W leaves with those of ``torch.autograd.backward`` on a copy of the module; the
counting cases check that W runs no input-side work and fires hooks once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from split_backward.graph_split import backward_input
from split_models import Block, float64  # noqa: F401  (float64: autouse)


def _outputs(value):
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in value if isinstance(t, torch.Tensor) and t.requires_grad]


def _compare(module, make_input, grad_input=True, loss=None, seed=0, accumulate=False,
             hooks=None, expect_calls=None):
    """``hooks(model)`` registers hooks on either copy and returns its call counts (a list);
    ``expect_calls(model)`` reads counts the model keeps itself: both must match the plain
    backward's, each at least 1."""
    torch.manual_seed(seed)
    reference = copy.deepcopy(module)  # tensor hooks are not copied: ``hooks`` registers them
    counts = [hooks(model) for model in (reference, module)] if hooks else None
    x = make_input()
    if accumulate:
        for parameters in (module.parameters(), reference.parameters()):
            for p in parameters:
                if p.requires_grad:
                    p.grad = torch.ones_like(p)

    def run(model):
        leaf = x.detach().clone().requires_grad_(grad_input)
        torch.manual_seed(seed + 1)
        outs = _outputs(model(leaf))
        if loss is not None:
            outs = [loss(*outs)]
        torch.manual_seed(seed + 2)
        grads = [None if t.dim() == 0 else torch.randn_like(t) for t in outs]
        return leaf, outs, grads

    leaf, outs, grads = run(reference)
    torch.autograd.backward(outs, [torch.ones_like(t) if g is None else g for t, g in zip(outs, grads)])
    expected_input = leaf.grad
    leaf, outs, grads = run(module)
    found, weights = backward_input(outs, grads, [leaf] if grad_input else [])
    if grad_input:
        assert (found[0] is None and expected_input is None) or torch.allclose(found[0], expected_input, atol=1e-12)
    weights.run()
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            assert p.grad is not None, f"{name} got no gradient"
            assert torch.allclose(p.grad, q.grad, atol=1e-12), f"{name}: {(p.grad - q.grad).abs().max()}"
    for read in [lambda model: counts[model is module]] if counts else []:
        assert read(module) == read(reference) and all(count >= 1 for count in read(reference))
    if expect_calls is not None:
        assert expect_calls(module) == expect_calls(reference) and min(expect_calls(reference)) >= 1


class Bottleneck(nn.Module):
    def __init__(self, channels=8):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, 4, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
            nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
            nn.Conv2d(4, channels, 1, bias=False), nn.BatchNorm2d(channels),
        )

    def forward(self, x):
        return torch.relu(self.body(x) + x)


def tokens():
    return torch.randn(3, 5, 16)


def test_linear_chain():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)], nn.Tanh(), nn.Linear(16, 3))
    _compare(model, lambda: torch.randn(7, 16))


def test_transformer_blocks():
    _compare(nn.Sequential(Block(), Block()), tokens)


def test_resnet_bottleneck():
    _compare(Bottleneck(), lambda: torch.randn(2, 8, 5, 5))


def test_first_stage_input_without_grad_gets_all_in_w():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    _compare(model, lambda: torch.randn(7, 16), grad_input=False)


class Repeat(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        h = self.linear(x)
        return h, h


class Derived(Repeat):
    def forward(self, x):
        h = self.linear(x)
        return h, h.mean(1)


@pytest.mark.parametrize("layer", [Repeat, Derived])
def test_outputs_that_repeat_or_derive(layer):
    _compare(layer(), lambda: torch.randn(7, 16))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def test_weight_tied_inside_a_chunk():
    _compare(Tied(), lambda: torch.randn(7, 16))


def test_one_block_at_several_positions():
    block = Block()
    _compare(nn.Sequential(block, nn.Linear(16, 16), block, block), tokens)


class Scale(nn.Module):
    """A parameter used directly at two places of the chain, through an op without a rule."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(16) + 1)
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return torch.div(self.linear(torch.div(x, self.scale)), self.scale)


def test_parameter_used_twice_through_the_engine():
    _compare(Scale(), lambda: torch.randn(7, 16))


class Positional(nn.Module):
    def __init__(self):
        super().__init__()
        self.position = nn.Parameter(torch.randn(5, 16))
        self.bias = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return x + self.position, self.bias * 3.0


def test_parameters_whose_path_never_meets_the_input():
    _compare(Positional(), tokens)


class Temperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(0.3))

    def forward(self, logits):
        return (logits * self.log_scale.exp()).logsumexp(1).mean()


def test_loss_with_a_parameter():
    loss = Temperature()
    model = nn.ModuleDict({"layer": nn.Linear(16, 6), "loss": loss})
    _compare(model, lambda: torch.randn(7, 16), loss=None) if False else None
    wrapper = nn.Sequential(nn.Linear(16, 6))

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.loss = wrapper, loss

        def forward(self, x):
            return self.loss(self.body(x))

    _compare(WithLoss(), lambda: torch.randn(7, 16))


def test_parametrizations_and_frozen_parameters():
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))
    parametrizations.weight_norm(model[0])
    parametrizations.orthogonal(model[2])
    model[3].weight.requires_grad_(False)
    _compare(model, lambda: torch.randn(7, 16))


def test_accumulates_into_existing_gradients():
    _compare(nn.Sequential(Block()), tokens, accumulate=True)


def test_complex_parameters():
    model = nn.Sequential(nn.Linear(16, 16, dtype=torch.complex128), nn.Linear(16, 4, dtype=torch.complex128))
    _compare(model, lambda: torch.randn(7, 16, dtype=torch.complex128))


class Counted(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        Counted.calls += 1
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).sum(0)


class CustomLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16))
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(Counted.apply(x, self.weight))


def test_custom_function_runs_its_backward_once():
    Counted.calls = 0
    _compare(CustomLayer(), lambda: torch.randn(7, 16))
    assert Counted.calls == 2  # once for the reference backward, once for I + W


def test_post_accumulate_hooks_fire_once_per_w():
    model = Tied()
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    x = torch.randn(7, 16, requires_grad=True)
    out = model(x)
    _, weights = backward_input([out], [torch.ones_like(out)], [x])
    assert fired == []
    weights.run()
    assert sorted(fired) == sorted(name for name, _ in model.named_parameters())


def test_a_compiled_region_runs_its_backward_once_and_lets_i_free_the_graph():
    """A compiled block is one autograd.Function whose backward computes every gradient, and
    one that donates its buffers refuses a kept graph: I takes its weight gradients as they
    come, and frees the graph."""
    torch._dynamo.reset()
    block = Block()
    compiled = torch.compile(copy.deepcopy(block), backend="aot_eager")
    _compare(nn.Sequential(compiled, nn.Linear(16, 4)), tokens)


@pytest.mark.parametrize("make_norm", [lambda: nn.LayerNorm(16), lambda: nn.BatchNorm1d(16),
                                       lambda: nn.GroupNorm(4, 16)],
                         ids=["layer", "batch", "group"])
def test_a_norm_gives_its_weight_gradients_in_i_and_w_never_reruns_it(make_norm):
    """A norm's weight gradients are reductions its input gradient computes anyway: I takes
    them in the same kernel call, W only accumulates them (no norm backward in W), and what
    waits for W is those small gradients, not the activation-sized one entering the norm."""
    from torch.profiler import ProfilerActivity, profile

    norm = make_norm()
    model = nn.Sequential(nn.Linear(16, 16), norm, nn.Tanh(), nn.Linear(16, 16))
    _compare(model, lambda: torch.randn(32, 16))
    x = torch.randn(32, 16, requires_grad=True)
    out = model(x)
    _, weights = backward_input([out], [torch.ones_like(out)], [x])
    norm_grads = sum(p.numel() for p in norm.parameters())
    assert not any(capture.junction.node.name().startswith(("Native", "Cudnn"))
                   for capture in weights.captures)
    assert sum(g.numel() for (node, _), g in weights.seeds) == norm_grads
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        weights.run()
    assert not [event.name for event in profiled.events() if "norm_backward" in event.name]
    assert all(p.grad is not None for p in norm.parameters())


class NormWeightUsedAgain(nn.Module):
    """A norm's weight read again in the chunk, directly and through a view."""

    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.norm(x)
        return self.linear(h) * self.norm.weight + h * self.norm.weight.view(1, -1)


def test_a_norm_whose_weight_is_used_again_in_the_chunk():
    """Asking the engine in I for the norm's weight would take the other uses' share there
    too, and W would add it a second time (norm.weight off by 1.76 before)."""
    _compare(NormWeightUsedAgain(), lambda: torch.randn(4, 16))
    _compare(nn.Sequential(NormWeightUsedAgain(), nn.Tanh(), NormWeightUsedAgain()), lambda: torch.randn(4, 16))


class Reentrant(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=True)


def test_a_reentrant_checkpoint_makes_i_a_whole_backward():
    """A reentrant checkpoint's backward runs the engine again and refuses a call that names
    inputs (torch raised in I before); its parameters are not in the outer graph at all. I
    then runs the whole backward (weight gradients too) and W has nothing left."""
    model = nn.Sequential(nn.Linear(16, 16), Reentrant(), nn.Linear(16, 16))
    _compare(model, tokens)
    x = tokens().requires_grad_()
    out = model(x)
    _, weights = backward_input([out], [torch.ones_like(out)], [x])
    assert weights.empty and all(p.grad is not None for p in model.parameters())


# Hooks at the I/W boundary: I captures a gradient where W needs it; a hook there runs
# once, on the gradient a plain backward would hand it, whichever path the junction takes.

class HookedOutput(nn.Module):
    """``op``'s output carries ``hook``, registered anew each forward (as models do)."""

    def __init__(self, op, hook):
        super().__init__()
        self.linear, self.norm, self.op, self.hook = nn.Linear(16, 16), nn.LayerNorm(16), op, hook
        self.weight, self.gain = nn.Parameter(torch.randn(16, 16) / 4), nn.Parameter(torch.randn(16))
        self.calls = 0

    def forward(self, x):
        h = self.op(self, torch.tanh(x))
        if h.requires_grad:
            h.register_hook(self.counted)
        return torch.tanh(h) * 2

    def counted(self, grad):
        self.calls += 1
        return self.hook(grad)


OUTPUT_OPS = {
    "linear": lambda layer, x: layer.linear(x),                     # AddmmBackward0, a rule
    "matmul": lambda layer, x: x @ layer.weight,                    # MmBackward0, a rule
    "mul": lambda layer, x: x * layer.gain,                         # MulBackward0, a rule
    "div": lambda layer, x: torch.div(x, layer.gain.abs() + 1),     # DivBackward0, no rule
    "custom": lambda layer, x: Counted.apply(x, layer.gain),        # a custom Function
    "norm": lambda layer, x: layer.norm(x),                         # fused: weights in I
}
OUTPUT_HOOKS = {
    "times 3": lambda grad: grad * 3,
    "clamp": lambda grad: grad.clamp(-0.01, 0.01),
    "minus 2x": lambda grad: -2 * grad,
    "logging": lambda grad: None,
}


@pytest.mark.parametrize("hook", list(OUTPUT_HOOKS))
@pytest.mark.parametrize("op", list(OUTPUT_OPS))
def test_a_tensor_hook_on_a_junctions_output_reaches_w_once(op, hook):
    """The gradient entering a junction is the one its tensor hooks return: W's weight
    gradient saw the unhooked one where the engine captured it (0.667 off for x3)."""
    layers = [HookedOutput(OUTPUT_OPS[op], OUTPUT_HOOKS[hook]) for _ in range(2)]
    model = nn.Sequential(layers[0], nn.Linear(16, 16), layers[1])
    _compare(model, lambda: torch.randn(7, 16), expect_calls=lambda m: [m[0].calls, m[2].calls])


def _norm_hooks(model, hook):
    """Counts calls of ``hook`` registered on every norm parameter of ``model``."""
    calls = []
    for module in model.modules():
        if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d)):
            for parameter in module.parameters():
                calls.append(0)
                index = len(calls) - 1

                def counted(grad, index=index):
                    calls[index] += 1
                    return hook(grad)

                parameter.register_hook(counted)
    return calls


NORMS = {"layer": lambda: nn.LayerNorm(16), "group": lambda: nn.GroupNorm(4, 16),
         "batch": lambda: nn.BatchNorm1d(16)}
PARAMETER_HOOKS = {
    "times 3": lambda grad: grad * 3,
    "mask": lambda grad: grad * (torch.arange(grad.numel()).view_as(grad) % 2),
    "logging": lambda grad: None,
}


@pytest.mark.parametrize("hook", list(PARAMETER_HOOKS))
@pytest.mark.parametrize("norm", list(NORMS))
def test_a_tensor_hook_on_a_norm_parameter_runs_once(norm, hook):
    """A norm's weight gradients are asked of the engine in I, which runs the leaf's tensor
    hooks as it captures, and W ran them again when it accumulated (9x for a 3x hook)."""
    model = nn.Sequential(nn.Linear(16, 16), NORMS[norm](), nn.Tanh(), nn.Linear(16, 16))
    _compare(model, lambda: torch.randn(32, 16),
             hooks=lambda m: _norm_hooks(m, PARAMETER_HOOKS[hook]))


class HookedWeight(nn.Module):
    """A LayerNorm or a Linear whose weight is read through a tensor hooked each forward
    (a weight-side node: only a leaf shows its hooks)."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.calls = kind, 0
        self.layer = nn.LayerNorm(16) if kind == "norm" else nn.Linear(16, 16)

    def forward(self, x):
        weight = self.layer.weight * 1.0
        if weight.requires_grad:
            weight.register_hook(self.counted)
        if self.kind == "norm":
            return nn.functional.layer_norm(x, (16,), weight, self.layer.bias)
        return nn.functional.linear(x, weight, self.layer.bias)

    def counted(self, grad):
        self.calls += 1
        return grad * 3


@pytest.mark.parametrize("kind", ["norm", "linear"])
def test_a_tensor_hook_on_a_weight_side_intermediate_runs_once(kind):
    model = nn.Sequential(nn.Linear(16, 16), HookedWeight(kind), nn.Tanh(), nn.Linear(16, 16))
    _compare(model, lambda: torch.randn(8, 16), expect_calls=lambda m: [m[1].calls])


def test_a_module_full_backward_hook_that_scales_its_input_gradient():
    def scaled(module, grad_input, grad_output):
        module.calls = getattr(module, "calls", 0) + 1
        return (grad_input[0] * 3,)

    def hooked(model):
        model[1].register_full_backward_hook(scaled)
        model[1].calls = 0
        return []

    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    _compare(model, lambda: torch.randn(7, 16), hooks=hooked, expect_calls=lambda m: [m[1].calls])


def test_a_module_full_backward_pre_hook_that_scales_its_output_gradient():
    """The pre-hook changes the gradient entering a Linear, and so its weight gradient."""
    def scaled(module, grad_output):
        module.calls = getattr(module, "calls", 0) + 1
        return (grad_output[0] * 3,)

    def hooked(model):
        model[1].register_full_backward_pre_hook(scaled)
        model[1].calls = 0
        return []

    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    _compare(model, lambda: torch.randn(7, 16), hooks=hooked, expect_calls=lambda m: [m[1].calls])


def test_a_post_accumulate_hook_on_a_norm_weight_fires_once_in_w():
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16))
    fired = []
    model[1].weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    x = torch.randn(8, 16, requires_grad=True)
    out = model(x)
    _, weights = backward_input([out], [torch.ones_like(out)], [x])
    assert fired == []
    weights.run()
    assert len(fired) == 1 and torch.equal(fired[0], model[1].weight.grad)
