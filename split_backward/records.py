"""What deferred layers leave for W, and W's products run through the parameters' own accumulation.

A deferring layer's backward gives its input gradient and records, for W, the
tensors its weight gradient needs (``Record``: a Linear's input rows and output
gradient, a convolution's input, output gradient and geometry). W sums each
parameter's products over its records (a weight tied between layers, a module
called twice) and hands each sum to the engine from one node whose inputs are the
deferred parameters (``weight_root``): ``AccumulateGrad`` runs once per W and
parameter, its tensor hooks run once on the whole gradient, its post-accumulate
hooks fire once, and it keeps the gradient as ``.grad`` without a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)  # not frozen: one is made in every deferred backward, and frozen
class Record:               # fields are set through object.__setattr__, a call each
    """One call's share of W: its parameters, the (cast) input and output gradient it read."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    input: torch.Tensor
    grad_output: torch.Tensor

    def products(self, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight's gradient, and the bias's where ``bias``. Runs under no_grad."""
        raise NotImplementedError


class Records(list[Record]):
    """What the deferred calls of one chunk recorded in their backwards, in order."""


def autocast_product(product: Callable[..., torch.Tensor], device: str, operand: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor | None, *rest: Any
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``product(operand, weight, bias, *rest)`` run as autocast runs it on ``device`` (every
    operand cast to the autocast dtype), and the operand and weight it multiplied: what W
    multiplies in turn. Without autocast: as they are, with no context to enter."""
    if not torch.is_autocast_enabled(device):
        return product(operand, weight, bias, *rest), operand, weight
    dtype = torch.get_autocast_dtype(device)
    operand_used, weight_used = cast(operand, dtype), cast(weight, dtype)
    assert operand_used is not None and weight_used is not None
    with torch.autocast(device, enabled=False):
        return product(operand_used, weight_used, cast(bias, dtype), *rest), operand_used, \
            weight_used


def cast(tensor: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``tensor`` in ``dtype`` where it is floating point (as autocast casts a layer's operands)."""
    if tensor is None or dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


def _sums(records: Records) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each parameter and its summed gradient over ``records``, by id. Runs under no_grad."""
    sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for record in records:
        bias = record.bias
        wants_bias = bias is not None and bias.requires_grad
        weight_grad, bias_grad = record.products(wants_bias)
        found = sums.get(id(record.weight))
        if found is None:
            sums[id(record.weight)] = (record.weight, weight_grad)
        else:
            found[1].add_(weight_grad)
        if bias is not None and bias_grad is not None:
            found = sums.get(id(bias))
            if found is None:
                sums[id(bias)] = (bias, bias_grad)
            else:
                found[1].add_(bias_grad)
    return sums


class _Products(torch.autograd.Function):
    """W's products as a node whose inputs are the deferred parameters."""

    @staticmethod
    def forward(ctx: Any, grads: list[torch.Tensor], *parameters: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return torch.empty(0)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads, ctx.grads = ctx.grads, None
        # Returned, and held nowhere else: AccumulateGrad keeps such a gradient as .grad
        # without a copy (a seed given to the engine stays held by it: each was copied, 24
        # copies a W on the GPT stage).
        return (None, *grads)


def weight_root(records: Records) -> torch.Tensor | None:
    """A root whose backward (seeded with ``torch.empty(0)``) accumulates ``records``' products
    into their parameters; None where there are none. The products run here."""
    with torch.no_grad():
        sums = _sums(records)
    if not sums:
        return None
    parameters = [parameter for parameter, _ in sums.values()]
    grads = [grad for _, grad in sums.values()]
    del sums
    with torch.enable_grad():
        root: torch.Tensor = _Products.apply(grads, *parameters)  # type: ignore[no-untyped-call]
    return root
