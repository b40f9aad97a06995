"""A Linear whose backward gives only the input gradient and records what its weight gradient needs.

The Zero Bubble authors' ``WeightGradStore`` and TransformerEngine's
``delay_wgrad_compute`` defer W per layer rather than by reading the graph: the
layer's backward computes ``grad_output @ weight`` and queues ``(input,
grad_output)``; W later turns the queue into ``grad_output^T @ input`` (and the
bias's row sum). This is that idea for ``nn.Linear``, written for this package.

The weight and bias are not inputs of the autograd node (they travel in a tuple,
which autograd does not look into), so the engine never reaches their
accumulators in I: no tensor hook or post-accumulate hook of theirs runs there,
not even with a missing gradient. W hands each parameter its summed gradient in
one engine call from the parameters' own gradient edges
(``split_backward.graph_split.WeightGradients``): ``AccumulateGrad`` runs once per
W for a weight tied between layers or a module called twice, its tensor hooks run
once on the whole gradient, its post-accumulate hooks fire once.

Under autocast the node casts as autocast would (input, weight and bias to the
autocast dtype) and keeps the cast tensors, so W multiplies what a plain
backward would; the weight gradient reaches the parameter in its own dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.nn import functional

from split_backward.autograd_graph import Slot


@dataclass(frozen=True)
class Record:
    """One call's share of W: its parameters, its (cast) input, the gradient of its output."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    input: torch.Tensor
    grad_output: torch.Tensor


class Records(list[Record]):
    """What the deferred calls of one chunk recorded in their backwards, in order."""


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    if tensor is None or dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


class DeferredLinear(torch.autograd.Function):
    """``functional.linear(x, weight, bias)`` with the weight gradient left to ``Records``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor | None,
                parameters: tuple[torch.Tensor, torch.Tensor | None],
                record: Callable[[Record], None]) -> torch.Tensor:
        # ``anchor``: a tensor that requires grad, given where ``x`` does not, so that the
        # output still has a backward in which to record.
        weight, bias = parameters
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x_used, weight_used = _cast(x, dtype), _cast(weight, dtype)
            assert x_used is not None and weight_used is not None
            with torch.autocast(device, enabled=False):
                out = functional.linear(x_used, weight_used, _cast(bias, dtype))
        else:  # the common case: no context manager to enter (microseconds a call)
            x_used, weight_used = x, weight
            out = functional.linear(x, weight, bias)
        ctx.save_for_backward(x_used, weight_used)
        ctx.parameters = parameters
        ctx.record = record
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        x, weight_used = ctx.saved_tensors
        weight, bias = ctx.parameters
        ctx.record(Record(weight, bias, x, grad_output))
        grad_input = grad_output.matmul(weight_used) if ctx.needs_input_grad[0] else None
        return grad_input, None, None, None


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    record: Callable[[Record], None]) -> torch.Tensor:
    """``functional.linear`` whose backward hands ``record`` the weight's share (a ``Record``)."""
    anchor = None if x.requires_grad else torch.empty(0, requires_grad=True)
    out: torch.Tensor = DeferredLinear.apply(  # type: ignore[no-untyped-call]
        x, anchor, (weight, bias), record)
    return out


def weight_seeds(records: Records) -> list[tuple[Slot, torch.Tensor]]:
    """W's products: each parameter's summed gradient, at its gradient edge. Runs under no_grad.

    Records of one parameter (tied weights, a module called twice) are summed here, so
    its ``AccumulateGrad`` is seeded once.
    """
    sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(parameter: torch.Tensor, grad: torch.Tensor) -> None:
        found = sums.get(id(parameter))
        if found is None:
            sums[id(parameter)] = (parameter, grad)
        else:
            found[1].add_(grad)

    for record in records:
        rows = record.grad_output.reshape(-1, record.grad_output.shape[-1])
        # (out, rows) @ (rows, in): the weight's own layout, so AccumulateGrad keeps it.
        add(record.weight, rows.t().mm(record.input.reshape(-1, record.input.shape[-1])))
        if record.bias is not None and record.bias.requires_grad:
            add(record.bias, rows.sum(0))
    seeds = []
    for parameter, grad in sums.values():
        edge = get_gradient_edge(parameter)
        seeds.append(((edge.node, edge.output_nr), grad.to(parameter.dtype)))
    return seeds
