"""A layer whose forward, input-gradient and weight-gradient costs are known: sleeps.

Why two autograd paths and not one Function: a Function's backward computes every
gradient it returns in one call, so a split backward could not tell its input gradient
from its weight gradient and would run the whole sleep in I (or in W). Here the output is
``x + bias`` built from two Functions: ``_InputPath`` carries ``x`` (sleeps F in the
forward, I in its backward) and ``_WeightPath`` carries the bias (sleeps W in its
backward). ``_WeightPath`` reads ``x`` detached, so its node leads only to the bias: the
graph split leaves it to W, and a full backward B runs both, I + W. Sleeping takes no
core (time.sleep releases the GIL), so ranks on a loaded host still run the costs given.
"""

from __future__ import annotations

import time
from typing import Any, cast

import torch
from torch import nn


class _InputPath(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in its forward and ``input_s`` in its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, input_s: float) -> torch.Tensor:
        ctx.input_s = input_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.input_s)
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    """``bias`` broadcast to ``like``'s shape; its backward sleeps ``weight_s``."""

    @staticmethod
    def forward(ctx: Any, bias: torch.Tensor, like: torch.Tensor, weight_s: float) -> torch.Tensor:
        ctx.weight_s, ctx.dims = weight_s, like.dim() - bias.dim()
        return bias.expand_as(like).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.weight_s)
        return grad.sum(dim=tuple(range(ctx.dims))), None, None


class SleepingLayer(nn.Module):
    """``x + bias`` (bias over the last dimension) costing ``forward_s`` in F, ``input_s`` in
    I and ``weight_s`` in W (their sum in a full backward)."""

    def __init__(self, width: int, forward_s: float, input_s: float, weight_s: float) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(width))
        self.forward_s, self.input_s, self.weight_s = forward_s, input_s, weight_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        through = cast(torch.Tensor, _InputPath.apply(  # type: ignore[no-untyped-call]
            x, self.forward_s, self.input_s))
        bias = cast(torch.Tensor, _WeightPath.apply(  # type: ignore[no-untyped-call]
            self.bias, x.detach(), self.weight_s))
        return through + bias
