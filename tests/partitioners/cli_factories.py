"""Model factories for the CLI tests: imported by ``pipe-balance`` in a subprocess."""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Sequential:
    """Twelve small layers with one wide Linear, so a good cut differs from the uniform one."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
        nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 32), nn.ReLU(),
        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 8),
    )


def not_sequential() -> nn.Module:
    return nn.Linear(4, 4)


def empty() -> nn.Sequential:
    return nn.Sequential()


NOT_CALLABLE = 3
