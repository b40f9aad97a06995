"""A traced program's linear products pointed at functions that defer inside a split.

A model traced by ``torch.export`` (``units``) runs its Linear layers as
``aten.linear`` nodes of an ``fx`` graph, and Hugging Face's ``Conv1D`` (GPT-2's
projections, a weight stored (in, out)) as ``aten.addmm(bias, rows, weight)``, never
through a layer's ``forward``, so switching layers (``switched_layers``) cannot
reach them. Pointing those nodes here can: outside a chunk's split each function is
the same ATen call, and inside one it defers the weight gradient as a switched
``nn.Linear`` does, on the parameter the program reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from split_backward.deferred_linear import deferred_linear
from split_backward.switched_layers import ACTIVE, linear

_ATEN_LINEAR = torch.ops.aten.linear.default
_ATEN_ADDMM = torch.ops.aten.addmm.default


def addmm(bias: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, *,
          beta: float = 1, alpha: float = 1) -> torch.Tensor:
    """``torch.addmm``, deferred where the split that is on takes ``weight`` (a 2-D product
    plus a 1-D bias, unscaled: Conv1D's)."""
    split = ACTIVE.get()
    if split is not None and beta == 1 and alpha == 1 and bias.dim() == 1 \
            and rows.dim() == 2 and torch.is_grad_enabled() \
            and split.defers(weight, bias, rows.numel() * weight.shape[1]):
        return deferred_linear(rows, weight, bias, split.record, in_out=True)
    return torch.addmm(bias, rows, weight, beta=beta, alpha=alpha)


_POINTED: dict[Any, Callable[..., torch.Tensor]] = {_ATEN_LINEAR: linear, _ATEN_ADDMM: addmm}


def defer_traced_linears(module: fx.GraphModule) -> int:
    """Point ``module``'s ``aten.linear`` and ``aten.addmm`` calls at their deferring
    functions (once; a program already pointed is left as it is); returns how many
    calls it has."""
    count = 0
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        node.target = _POINTED.get(node.target, node.target)
        if node.target is linear or node.target is addmm:
            count += 1
    module.recompile()
    return count
