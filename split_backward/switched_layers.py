"""The layers a split chunk switches on: their forwards defer weight gradients while its split runs.

A switched layer keeps its class, its parameters and its state-dict keys; only an
instance ``forward`` is added (it holds nothing but the module, so the module still
copies and pickles). Inside its chunk's split (``ACTIVE``, with a graph) the layer's
products go through ``deferred_linear`` or ``deferred_conv``; everywhere else it is
the class's own forward.

- ``nn.Linear``: ``deferred_linear`` on its weight and bias.
- ``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d`` on a batched input with numeric padding:
  ``deferred_conv`` (a padding mode other than zeros pads first, as the layer does).
- ``nn.MultiheadAttention``: torch's own attention code, run with its ``linear``
  resolved to ``linear`` here (a copy of the functions with that one global
  replaced, made once). A call on a weight that is a leaf ``Parameter`` defers (the
  packed in-projection of self-attention, the out-projection, separate q/k/v weights
  without a bias); a call on a slice of one (cross-attention's ``w.split``) runs as
  torch's, its weight gradient in I. Rebinding rather than rewriting keeps every
  mask, dropout draw and shape rule torch's own; were a later torch to stop calling
  ``linear`` by that name, the layer would simply defer nothing. The copy reads
  ``torch.nn.functional`` as it was when this module was imported: a function patched
  into it later (a custom attention kernel) is not seen by a switched layer.

A ``TorchFunctionMode`` over the chunk would see every functional call, but it cost
the GPT stage's forward 17% (0.8 ms of 4.9 ms) and never sees inside
``multi_head_attention_forward``, which hands the whole call to the mode first.
"""

from __future__ import annotations

import types
from contextvars import ContextVar
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional
from torch.nn.modules import activation
from torch.nn.utils import parametrize

from split_backward.deferred_conv import Geometry, deferred_convolution, multiply_adds
from split_backward.deferred_linear import deferred_linear
from split_backward.records import Record


class Deferring(Protocol):
    """What a switched layer asks of the split that is on (``chunk_split.ChunkSplit``)."""

    def defers(self, weight: torch.Tensor | None, bias: torch.Tensor | None,
               multiply_adds: int, convolution: bool = False) -> bool:
        """Whether this call defers its weight gradient (noted if so); ``multiply_adds``
        estimates its cost."""

    def record(self, record: Record) -> None:
        """A deferred product's share of W, from its backward."""


ACTIVE: ContextVar[Deferring | None] = ContextVar("split_backward_active", default=None)


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``functional.linear``, deferred where the split that is on takes the weight."""
    split = ACTIVE.get()
    if split is not None and torch.is_grad_enabled() \
            and split.defers(weight, bias, input.numel() * weight.shape[0]):
        return deferred_linear(input, weight, bias, split.record)
    return functional.linear(input, weight, bias)


def _rebound(function: Any, names: dict[str, Any]) -> Any:
    """``function``'s code with its globals, ``names`` replacing some of them."""
    scope = dict(function.__globals__)
    scope.update(names)
    copy = types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def _attention_forward() -> Any:
    # torch.nn.functional's attention, its in-projections calling ``linear`` above; then
    # MultiheadAttention.forward, reading ``F`` as that functional.
    names: dict[str, Any] = {"linear": linear}
    for name in ("_in_projection_packed", "_in_projection", "multi_head_attention_forward"):
        names[name] = _rebound(getattr(functional, name), names)
    namespace = types.ModuleType(functional.__name__)
    namespace.__dict__.update(vars(functional))
    namespace.__dict__.update(names)
    return _rebound(nn.MultiheadAttention.forward, {"F": namespace})


_ATTENTION_FORWARD = _attention_forward()


class _LinearForward:
    """An installed Linear's ``forward``: deferred inside its chunk's split, else Linear's own."""

    __slots__ = ("module",)
    runs_the_class_forward = True  # outside a split: a tracer may ignore it

    def __init__(self, module: nn.Linear) -> None:
        self.module = module

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        split = ACTIVE.get()
        module = self.module
        # Read from the module's own parameters, never through ``module.weight``: a
        # parametrization computes it anew on every read (spectral norm steps its vectors).
        parameters = module._parameters
        weight = parameters.get("weight")
        if split is not None and weight is not None and torch.is_grad_enabled() \
                and "bias" in parameters \
                and split.defers(weight, parameters["bias"], input.numel() * weight.shape[0]):
            return deferred_linear(input, weight, parameters["bias"], split.record)
        return nn.Linear.forward(module, input)


class _AttentionForward:
    """An installed MultiheadAttention's ``forward``: torch's, its linear calls deferring
    inside its chunk's split."""

    __slots__ = ("module",)
    runs_the_class_forward = True  # outside a split: a tracer may ignore it

    def __init__(self, module: nn.MultiheadAttention) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if ACTIVE.get() is not None and torch.is_grad_enabled():
            return _ATTENTION_FORWARD(module, *args, **kwargs)
        return nn.MultiheadAttention.forward(module, *args, **kwargs)


class _ConvolutionForward:
    """An installed convolution's ``forward``: deferred inside its chunk's split on a batched
    input, else the class's own."""

    __slots__ = ("module",)
    runs_the_class_forward = True  # outside a split: a tracer may ignore it

    def __init__(self, module: nn.Conv1d | nn.Conv2d | nn.Conv3d) -> None:
        self.module = module

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        split = ACTIVE.get()
        module = self.module
        parameters = module._parameters
        weight = parameters.get("weight")
        dimensions = len(module.stride)
        if split is not None and weight is not None and torch.is_grad_enabled() \
                and input.dim() == dimensions + 2 and not isinstance(module.padding, str):
            if split.defers(weight, parameters["bias"],
                            multiply_adds(input, weight, module.stride), convolution=True):
                padding = module.padding
                if module.padding_mode != "zeros":
                    input = functional.pad(input, module._reversed_padding_repeated_twice,
                                           mode=module.padding_mode)
                    padding = (0,) * dimensions
                geometry = Geometry(module.stride, padding, module.dilation, module.groups)
                return deferred_convolution(input, weight, parameters["bias"], geometry,
                                            split.record)
        native: Any = type(module).forward
        return native(module, input)  # type: ignore[no-any-return]


_Switch = type[_LinearForward] | type[_AttentionForward] | type[_ConvolutionForward]
_FORWARDS: dict[type[nn.Module], _Switch] = {
    nn.Linear: _LinearForward, nn.MultiheadAttention: _AttentionForward,
    nn.Conv1d: _ConvolutionForward, nn.Conv2d: _ConvolutionForward, nn.Conv3d: _ConvolutionForward,
}


def _own(module: nn.Module, kind: type[nn.Module]) -> bool:
    """Whether ``module`` runs ``kind``'s own forward (a subclass may change it)."""
    cls = type(module)
    return cls.forward is kind.forward and getattr(cls, "_conv_forward", None) is getattr(
        kind, "_conv_forward", None)


def _switch_for(name: str, module: nn.Module) -> _Switch | None:
    """The forward that switches ``module``, or None where it stays as it is: a class with a
    forward of its own, parametrized weights, inside a ``torch.compile``d module."""
    for kind, forward in _FORWARDS.items():
        if isinstance(module, kind) and _own(module, kind):
            if parametrize.is_parametrized(module) or "_orig_mod" in name.split("."):
                return None
            return forward
    return None


def switch_on(layers: nn.Module) -> int:
    """Give every Linear, MultiheadAttention and convolution of ``layers`` that can defer its
    switched forward (once); returns how many layers are switched."""
    count = 0
    for name, module in layers.named_modules():
        forward = _switch_for(name, module)
        if forward is None or ("forward" in module.__dict__ and not switched(module)):
            continue  # a forward of the user's own runs as it is (the graph split defers)
        if not isinstance(module.__dict__.get("forward"), forward):
            module.forward = forward(module)
        count += 1
    return count


def switch_off(layers: nn.Module, keep: frozenset[int] = frozenset()) -> None:
    """Take the switched forwards off ``layers``' modules, but those whose ids are in ``keep``."""
    for module in layers.modules():
        if switched(module) and id(module) not in keep:
            del module.forward


def switched(module: nn.Module) -> bool:
    """Whether ``module`` has a switched forward."""
    return isinstance(module.__dict__.get("forward"),
                      (_LinearForward, _AttentionForward, _ConvolutionForward))
