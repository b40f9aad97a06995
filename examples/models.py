"""Model factories for the examples and for ``pipe-balance examples.models:NAME``."""

from __future__ import annotations

from torch import nn


def uneven_mlp(width: int = 512) -> nn.Sequential:
    """An MLP whose middle layer is 8x wider than the rest: a uniform cut is badly off."""
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, 8 * width), nn.ReLU(),
        nn.Linear(8 * width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, 10),
    )
