"""A Linear whose backward gives only the input gradient and records what its weight gradient needs.

The Zero Bubble authors' ``WeightGradStore`` and TransformerEngine's
``delay_wgrad_compute`` defer W per layer rather than by reading the graph: the
layer's backward computes ``grad_output @ weight`` and queues ``(input,
grad_output)``; W later turns the queue into ``grad_output^T @ input`` (and the
bias's row sum). This is that idea for ``nn.Linear``, written for this package.

The weight and bias are not inputs of the autograd node (they travel in a tuple,
which autograd does not look into), so the engine never reaches their
accumulators in I: no tensor hook or post-accumulate hook of theirs runs there,
not even with a missing gradient. W runs the records through the parameters' own
accumulation (``split_backward.records``).

Under autocast the node casts as autocast would (input, weight and bias to the
autocast dtype) and keeps the cast tensors, so W multiplies what a plain
backward would; the weight gradient reaches the parameter in its own dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional

from split_backward.records import Record, autocast_product


@dataclass(slots=True)
class LinearRecord(Record):
    """A linear call's share of W: its input as rows, the gradient of its output."""

    def products(self, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = self.grad_output
        if rows.dim() != 2:
            rows = rows.reshape(-1, rows.shape[-1])
        # (out, rows) @ (rows, in): the weight's own layout, so AccumulateGrad keeps it.
        return rows.t().mm(self.input), rows.sum(0) if bias else None


@dataclass(slots=True)
class InOutRecord(Record):
    """The same share for a weight stored (in, out): Hugging Face's ``Conv1D``, a traced
    ``addmm(bias, rows, weight)``."""

    def products(self, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.input.t().mm(self.grad_output), self.grad_output.sum(0) if bias else None


def _bias_plus_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.addmm(bias, rows, weight)


class DeferredLinear(torch.autograd.Function):
    """``functional.linear(x, weight, bias)`` with the weight gradient left to a ``LinearRecord``;
    with ``in_out``, ``addmm(bias, x, weight)`` (a 2-D ``x``, a weight stored (in, out)) and an
    ``InOutRecord``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor | None,
                parameters: tuple[torch.Tensor, torch.Tensor | None],
                record: Callable[[Record], None], in_out: bool = False) -> torch.Tensor:
        # ``anchor``: a tensor that requires grad, given where ``x`` does not, so that the
        # output still has a backward in which to record.
        weight, bias = parameters
        device = x.device.type
        # As rows: W multiplies them as they are (a strided input, attention's sequence-first
        # view, is copied once here, as linear itself would, not again in W).
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        product = _bias_plus_product if in_out else functional.linear
        out, rows_used, weight_used = autocast_product(product, device, rows, weight, bias)
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], out.shape[-1])
        ctx.save_for_backward(rows_used, weight_used)
        ctx.parameters = parameters
        ctx.record = record
        ctx.in_out = in_out
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor
                 ) -> tuple[torch.Tensor | None, None, None, None, None]:
        rows, weight_used = ctx.saved_tensors
        weight, bias = ctx.parameters
        if ctx.in_out:
            ctx.record(InOutRecord(weight, bias, rows, grad_output))
            weight_used = weight_used.t()
        else:
            ctx.record(LinearRecord(weight, bias, rows, grad_output))
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        if grad_output.dim() == 2:
            return grad_output.mm(weight_used), None, None, None, None
        return grad_output.matmul(weight_used), None, None, None, None


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    record: Callable[[Record], None], in_out: bool = False) -> torch.Tensor:
    """``functional.linear`` whose backward hands ``record`` the weight's share (a
    ``LinearRecord``); with ``in_out``, ``addmm(bias, x, weight)`` (an ``InOutRecord``)."""
    anchor = None if x.requires_grad else torch.empty(0, requires_grad=True)
    out: torch.Tensor = DeferredLinear.apply(  # type: ignore[no-untyped-call]
        x, anchor, (weight, bias), record, in_out)
    return out
