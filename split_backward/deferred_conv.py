"""A convolution whose backward gives only the input gradient and records what its weight gradient needs.

The convolution counterpart of ``deferred_linear``: the forward is
``functional.conv{1,2,3}d`` as the layer runs it; the backward asks
``aten.convolution_backward`` (the kernel autograd's own ``ConvolutionBackward0``
calls) for the input gradient alone and records the input, the output gradient and
the geometry; W asks the same kernel for the weight's (and bias's) alone. As for a
Linear, the parameters travel outside autograd's view of the node, so their
accumulators are reached only in W (``split_backward.records``).

Under autocast the node casts input, weight and bias to the autocast dtype, as
autocast casts a convolution's operands, and keeps the cast tensors for W.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional

from split_backward.records import Record, autocast_product

_CONVOLUTIONS = {1: functional.conv1d, 2: functional.conv2d, 3: functional.conv3d}


@dataclass(frozen=True)
class Geometry:
    """A convolution's stride, padding (ints: the input already padded otherwise), dilation, groups."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def backward(self, grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                 mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
        """``aten.convolution_backward`` for the gradients ``mask`` asks (input, weight, bias)."""
        bias_sizes = [weight.shape[0]] if mask[2] else None
        found: tuple[torch.Tensor | None, ...] = torch.ops.aten.convolution_backward(
            grad_output, input, weight, bias_sizes, list(self.stride), list(self.padding),
            list(self.dilation), False, [0] * len(self.stride), self.groups, mask)
        return found


@dataclass(slots=True)
class ConvolutionRecord(Record):
    """A convolution's share of W: its (cast) input and weight, its output's gradient, its geometry."""

    weight_used: torch.Tensor
    geometry: Geometry

    def products(self, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, weight_grad, bias_grad = self.geometry.backward(
            self.grad_output, self.input, self.weight_used, [False, True, bias])
        assert weight_grad is not None
        return weight_grad, bias_grad


class DeferredConvolution(torch.autograd.Function):
    """``functional.conv{1,2,3}d`` with the weight gradient left to a ``ConvolutionRecord``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor | None,
                parameters: tuple[torch.Tensor, torch.Tensor | None], geometry: Geometry,
                record: Callable[[Record], None]) -> torch.Tensor:
        # ``anchor``: as in ``deferred_linear``, for an input that does not require grad.
        weight, bias = parameters
        convolution = _CONVOLUTIONS[len(geometry.stride)]
        device = x.device.type
        arguments = (geometry.stride, geometry.padding, geometry.dilation, geometry.groups)
        out, x_used, weight_used = autocast_product(convolution, device, x, weight, bias,
                                                    *arguments)
        ctx.save_for_backward(x_used, weight_used)
        ctx.parameters, ctx.geometry, ctx.record = parameters, geometry, record
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        x, weight_used = ctx.saved_tensors
        weight, bias = ctx.parameters
        ctx.record(ConvolutionRecord(weight, bias, x, grad_output, weight_used, ctx.geometry))
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = ctx.geometry.backward(grad_output, x, weight_used, [True, False, False])[0]
        return grad_input, None, None, None, None


def deferred_convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         geometry: Geometry, record: Callable[[Record], None]) -> torch.Tensor:
    """``functional.conv{1,2,3}d`` whose backward hands ``record`` the weight's share."""
    anchor = None if x.requires_grad else torch.empty(0, requires_grad=True)
    out: torch.Tensor = DeferredConvolution.apply(  # type: ignore[no-untyped-call]
        x, anchor, (weight, bias), geometry, record)
    return out


def multiply_adds(input: torch.Tensor, weight: torch.Tensor, stride: tuple[int, ...]) -> int:
    """About how many multiply-adds the convolution's weight gradient costs: output
    positions (the input's, over the stride) times the weight's size."""
    positions = input.numel() // max(1, input.shape[1])
    for step in stride:
        positions //= max(1, step)
    return positions * weight.numel()
