"""Rank functions for tests/pipeline/compute/test_shared_modules.py (importable by name)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


def albert() -> nn.Sequential:
    """One block instance at six positions, then a head."""
    torch.manual_seed(0)
    block = Block()
    return nn.Sequential(*[block] * 6, nn.Linear(WIDTH, 3)).double()


def tied() -> nn.Sequential:
    torch.manual_seed(0)
    embedding, head = nn.Embedding(11, WIDTH), nn.Linear(WIDTH, 11, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(WIDTH, WIDTH), nn.Tanh(), head).double()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3)).double()


def shared_block_across_ranks(rank: int, world: int, schedule: str) -> tuple[float, float, float]:
    """(loss error, worst gradient error, worst parameter change at build) on this rank."""
    from pipeline import Pipe

    torch.set_num_threads(1)
    model = albert()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, WIDTH, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (8,), generator=generator)
    reference = copy.deepcopy(model)
    expected_loss = nn.functional.cross_entropy(reference(x), y)
    expected_loss.backward()
    before = [[p.detach().clone() for p in layer.parameters()] for layer in model]
    pipe = Pipe(model, 4, schedule=schedule, loss_fn=nn.CrossEntropyLoss(), checkpoint="never",
                group=dist.group.WORLD, balance=[3, 4] if schedule != "zb-v" else [2, 2, 2, 1])
    changed = max(float((p.detach() - q).abs().max())
                  for layer, original in zip(pipe.model, before)
                  for p, q in zip(layer.parameters(), original) if not p.is_meta)
    loss = pipe.step(x if rank == 0 else None, y if pipe.schedule.placement[-1] == rank else None)
    errors = []
    for layer, expected in zip(pipe.model, reference):
        for p, q in zip(layer.parameters(), expected.parameters()):
            if not p.is_meta:
                errors.append(float((p.grad - q.grad).abs().max()))
    return float(abs(loss - expected_loss)), max(errors), changed


def _loaded_on_two_ranks(model: nn.Sequential, balance: list[int],
                         state: Callable[[Any], dict[str, torch.Tensor]]) -> str:
    """A 1F1B Pipe of ``model`` over both ranks loads ``state(pipe)`` strictly: "loaded", or
    the ValueError's message."""
    from pipeline import Pipe

    torch.set_num_threads(1)
    pipe = Pipe(model, 2, schedule="1f1b", loss_fn=nn.MSELoss(), group=dist.group.WORLD,
                balance=balance)
    try:
        pipe.load_state_dict(state(pipe))
    except ValueError as error:
        return str(error)
    return "loaded"


def tie_breaking_state(rank: int, world: int) -> str:
    """Load a state whose head differs from its embedding into the tied model: the error."""
    state = copy.deepcopy(tied().state_dict())
    state["3.weight"] = state["3.weight"] + 1.0
    return _loaded_on_two_ranks(tied(), [2, 2], lambda pipe: state)


def missing_key_everywhere(rank: int, world: int) -> str:
    """Load the whole model's state without one of rank 1's keys, strict: every rank raises."""
    state = dict(mlp().state_dict())
    del state["2.bias"]  # rank 1's
    return _loaded_on_two_ranks(mlp(), [2, 1], lambda pipe: state)


def own_state_roundtrip(rank: int, world: int) -> str:
    """Each rank saves pipe.state_dict() (its layers) and loads it back, strict."""
    return _loaded_on_two_ranks(mlp(), [2, 1], lambda pipe: pipe.state_dict())


def unknown_key_everywhere(rank: int, world: int) -> str:
    """Load the whole model's state plus an unknown key, strict: every rank raises."""
    state = {**mlp().state_dict(), "2.scale": torch.ones(1)}
    return _loaded_on_two_ranks(mlp(), [2, 1], lambda pipe: state)
