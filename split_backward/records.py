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

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Record:
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


def cast(tensor: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``tensor`` in ``dtype`` where it is floating point (as autocast casts a layer's operands)."""
    if tensor is None or dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


def _wants_bias(record: Record) -> bool:
    return record.bias is not None and record.bias.requires_grad


def _sums(records: Records) -> dict[int, torch.Tensor]:
    """Each parameter's summed gradient over ``records``, by id. Runs under no_grad."""
    sums: dict[int, torch.Tensor] = {}
    for record in records:
        wants_bias = _wants_bias(record)
        weight_grad, bias_grad = record.products(wants_bias)
        for parameter, grad in ((record.weight, weight_grad), (record.bias, bias_grad)):
            if parameter is None or grad is None:
                continue
            found = sums.get(id(parameter))
            if found is None:
                sums[id(parameter)] = grad
            else:
                found.add_(grad)
    return sums


class _Products(torch.autograd.Function):
    """W's products as a node whose inputs are the deferred parameters."""

    @staticmethod
    def forward(ctx: Any, records: Records, *parameters: torch.Tensor) -> torch.Tensor:
        ctx.records = records
        ctx.ids = [id(p) for p in parameters]
        return torch.empty(0)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        sums = _sums(ctx.records)
        ctx.records = None
        # Returned, not held: AccumulateGrad keeps a gradient only this node referred to
        # as .grad without a copy (a seed given to the engine stays held by it: each was
        # copied, 24 copies a W on the GPT stage).
        return (None, *(sums.pop(key) for key in ctx.ids))


def weight_root(records: Records) -> torch.Tensor | None:
    """A root whose backward (seeded with ``torch.empty(0)``) accumulates ``records``' products
    into their parameters; None where there are none."""
    parameters: dict[int, torch.Tensor] = {}
    for record in records:
        parameters[id(record.weight)] = record.weight
        if _wants_bias(record):
            assert record.bias is not None
            parameters[id(record.bias)] = record.bias
    if not parameters:
        return None
    with torch.enable_grad():
        root: torch.Tensor = _Products.apply(records, *parameters.values())  # type: ignore[no-untyped-call]
    return root
