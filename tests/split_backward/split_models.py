"""What the split backward's tests share: float64 throughout, and a transformer block."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def float64() -> Iterator[None]:
    """Imported by a test module, every test of it runs in float64 (then the old default)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Block(nn.Module):
    """A pre-LayerNorm transformer block: attention and an MLP, each with a residual."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out
