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


def in_place() -> nn.Sequential:
    """In-place layers after the first: profiling must not feed them a leaf."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, 32),
        nn.Dropout(0.1, inplace=True), nn.Linear(32, 8),
    )


def tied() -> nn.Sequential:
    """An embedding and a head sharing one weight: its bytes count once."""
    torch.manual_seed(0)
    embedding = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(16, 16), nn.ReLU(), head)


def exits() -> nn.Sequential:
    """A factory that exits instead of returning: status 0 must not pass for success."""
    import sys

    sys.exit(0)
