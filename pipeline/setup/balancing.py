"""A Pipe's balance resolved: a list as given, uniform, or measured ("time", "params")."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.setup.options import check_balance, uniform_balance


def resolve_balance(
    balance: Any,
    model: nn.Sequential,
    parts: int,
    sample: Any,
    schedule_name: str,
    microbatches: int,
) -> list[int] | None:
    """A list of layers per chunk, or None when it must wait for a sample ("time", no sample)."""
    if balance is None or balance == "uniform":
        return uniform_balance(len(model), parts)
    if isinstance(balance, str):
        if balance not in ("time", "params"):
            raise ValueError(
                f"unknown balance {balance!r}; expected a list of layer counts, "
                f"'time', 'params' or 'uniform'"
            )
        uniform_balance(len(model), parts)
        if balance == "time" and sample is None:
            return None
        return profiled_balance(model, parts, balance, sample)
    return check_balance(balance, len(model), parts)


def profiled_balance(model: nn.Sequential, parts: int, by: str, sample: Any) -> list[int]:
    """Balance by measured time or by parameter bytes, through the partitioners package."""
    from partitioners import balance as balance_costs
    from partitioners import profile

    if by == "params":
        return list(balance_costs(parameter_bytes(model), parts, by="time"))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    costs = profile(model, sample, device=str(device), progress=False)
    return list(balance_costs(costs, parts, by="time"))


def parameter_bytes(model: nn.Sequential) -> list[float]:
    """Bytes of parameters per layer, a shared parameter charged to its first layer only."""
    seen: set[int] = set()
    weights = []
    for layer in model:
        total = 0
        for parameter in layer.parameters():
            if id(parameter) not in seen:
                seen.add(id(parameter))
                total += parameter.numel() * parameter.element_size()
        weights.append(float(total))
    return weights
