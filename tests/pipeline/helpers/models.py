"""Tiny float64 models and reference gradients shared by the pipeline tests.

Every factory returns an ``nn.Sequential`` in float64 whose parameters depend only
on ``torch.manual_seed`` (the factories seed nothing themselves). Each has nine
layers, enough for four stages of two chunks (interleaved 1F1B, ZB-V).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

DTYPE = torch.float64
FEATURES = 6  # input width of mlp() and residual_stack()
CLASSES = 3  # output width of every model
IMAGE = (2, 6, 6)  # input channels, height, width of small_cnn()


def mlp(width: int = 8, depth: int = 4) -> nn.Sequential:
    """``depth`` x (Linear, Tanh), then a Linear head: 2*depth+1 layers (9 by default)."""
    layers: list[nn.Module] = []
    features = FEATURES
    for _ in range(depth):
        layers += [nn.Linear(features, width), nn.Tanh()]
        features = width
    layers.append(nn.Linear(features, CLASSES))
    return nn.Sequential(*layers).to(DTYPE)


def small_cnn() -> nn.Sequential:
    """Two 3x3 convolutions, pooling and a two-layer head: 9 layers, input (N, 2, 6, 6)."""
    channels, height, width = IMAGE
    return nn.Sequential(
        nn.Conv2d(channels, 4, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * (height // 2) * (width // 2), 8),
        nn.Tanh(),
        nn.Linear(8, CLASSES),
    ).to(DTYPE)


class ResidualBlock(nn.Module):
    """x + W2 tanh(W1 LayerNorm(x)): a pre-norm residual block, one layer of the Sequential."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.inner = nn.Linear(width, 2 * width)
        self.outer = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(self.norm(x))))


def residual_stack(width: int = 8, blocks: int = 6) -> nn.Sequential:
    """Linear in, ``blocks`` residual blocks, LayerNorm, Linear out: blocks+3 layers (9)."""
    return nn.Sequential(
        nn.Linear(FEATURES, width),
        *[ResidualBlock(width) for _ in range(blocks)],
        nn.LayerNorm(width),
        nn.Linear(width, CLASSES),
    ).to(DTYPE)


class TupleIn(nn.Module):
    """(a, b) -> (tanh(A a + B b), b): takes the tuple input of tuple_model()."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.left = nn.Linear(FEATURES, width)
        self.right = nn.Linear(FEATURES, width, bias=False)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = pair
        return torch.tanh(self.left(a) + self.right(b)), b


class TupleMix(nn.Module):
    """(h, b) -> (tanh(W h) * sigmoid(V b), b): both tensors of the tuple carry gradients."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(width, width)
        self.gate = nn.Linear(FEATURES, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, b = pair
        return torch.tanh(self.hidden(h)) * torch.sigmoid(self.gate(b)), b


class TupleScale(nn.Module):
    """(h, b) -> (h, s * b): only the second tensor changes, through a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.9))

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, b = pair
        return h, self.scale * b


class TupleOut(nn.Module):
    """(h, b) -> W h + U b: back to one tensor."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(width, CLASSES)
        self.skip = nn.Linear(FEATURES, CLASSES, bias=False)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, b = pair
        return self.hidden(h) + self.skip(b)


def tuple_model(width: int = 8) -> nn.Sequential:
    """Layers passing a tuple of two tensors; the input x is a tuple (a, b) too. 6 layers."""
    return nn.Sequential(
        TupleIn(width),
        TupleMix(width),
        TupleScale(),
        TupleMix(width),
        TupleMix(width),
        TupleOut(width),
    ).to(DTYPE)


def dropout_mlp(p: float = 0.3) -> nn.Sequential:
    """An MLP with Dropout(p) after every hidden layer: 10 layers."""
    return nn.Sequential(
        nn.Linear(FEATURES, 8), nn.Tanh(), nn.Dropout(p),
        nn.Linear(8, 8), nn.Tanh(), nn.Dropout(p),
        nn.Linear(8, 8), nn.Tanh(), nn.Dropout(p),
        nn.Linear(8, CLASSES),
    ).to(DTYPE)


class ToDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> dict:
        hidden = self.linear(x)
        mask = hidden > 0
        return {"hidden": [hidden, torch.tanh(hidden)], "mask": mask, "scale": 3,
                "note": None, "index": (x[:, 0] > 0).long()}


class FromDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, value: dict) -> torch.Tensor:
        assert value["note"] is None and value["mask"].dtype == torch.bool
        first, second = value["hidden"]
        mixed = (first * value["mask"] + second) * (value["index"][:, None] + 1) / value["scale"]
        return self.linear(mixed)


class ToComplex(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.complex(x, x.flip(-1) * 0.5)


class FromComplex(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return (z * z.conj().roll(1, -1)).real + z.abs()


def tied_head(width: int) -> nn.Sequential:
    """Embedding(11, width), Linear, Tanh, Linear, and a bias-free head whose weight is the
    embedding's: a tie across the ends of the pipeline; tokens in 0..10."""
    embedding, head = nn.Embedding(11, width), nn.Linear(width, 11, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width),
                         head).to(DTYPE)


def structured_model() -> nn.Sequential:
    """Stages that pass a dict of a list of tensors, a bool mask, an int tensor, an int and
    None, then complex tensors: 6 layers, input FEATURES wide, output 2 wide."""
    return nn.Sequential(ToDict(), FromDict(), nn.Linear(3, 6), ToComplex(), FromComplex(),
                         nn.Linear(6, 2)).to(DTYPE)


MODELS: dict[str, Callable[[], nn.Sequential]] = {
    "mlp": mlp,
    "small_cnn": small_cnn,
    "residual_stack": residual_stack,
}


def batch(name: str, rows: int = 13, seed: int = 1) -> tuple[Any, torch.Tensor]:
    """A deterministic (x, target) pair for the model called ``name``.

    ``small_cnn`` gets class labels (for CrossEntropyLoss), the others real targets.
    """
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=DTYPE)

    if name == "small_cnn":
        x = randn(rows, *IMAGE)
        return x, torch.randint(0, CLASSES, (rows,), generator=generator)
    if name == "tuple_model":
        return (randn(rows, FEATURES), randn(rows, FEATURES)), randn(rows, CLASSES)
    return randn(rows, FEATURES), randn(rows, CLASSES)


def loss_for(name: str) -> nn.Module:
    """The loss used with the model called ``name``."""
    return nn.CrossEntropyLoss() if name == "small_cnn" else nn.MSELoss()


def build(name: str, seed: int = 0) -> nn.Sequential:
    """A fresh model: ``MODELS[name]`` (or tuple_model / dropout_mlp) under ``seed``."""
    factories = {**MODELS, "tuple_model": tuple_model, "dropout_mlp": dropout_mlp}
    torch.manual_seed(seed)
    return factories[name]()


def reference(
    model: nn.Sequential, x: Any, target: Any, loss_fn: Callable[..., torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradients of the unpipelined model on the whole batch (model left untouched)."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), target)
    loss.backward()
    return loss.detach(), [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in model.parameters()
    ]


def grads(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameter gradients, zeros where there is none."""
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for p in model.parameters()]


def max_difference(left: list[torch.Tensor], right: list[torch.Tensor]) -> float:
    """The largest absolute element-wise difference between two gradient lists."""
    assert len(left) == len(right)
    return max(float((a - b).abs().max()) for a, b in zip(left, right))
