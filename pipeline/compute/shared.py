"""Parameters shared by several layers (a head tied to the embedding): found, not declared."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class SharedParameter:
    """One parameter object that several layers of the Sequential use.

    Attributes:
        layers: the indices of the layers that hold it, in order; the first is its owner,
            where it is counted once (clipping, memory).
        name: its key under the first layer, e.g. ``"0.weight"``.
    """

    layers: tuple[int, ...]
    name: str

    @property
    def owner(self) -> int:
        return self.layers[0]


def shared_parameters(model: nn.Sequential) -> dict[int, SharedParameter]:
    """``id(parameter) -> SharedParameter`` for every parameter used by two or more layers."""
    users: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for index, layer in enumerate(model):
        for name, parameter in layer.named_parameters():
            users.setdefault(id(parameter), [])
            if index not in users[id(parameter)]:
                users[id(parameter)].append(index)
            names.setdefault(id(parameter), f"{index}.{name}")
    return {
        key: SharedParameter(tuple(layers), names[key])
        for key, layers in users.items() if len(layers) > 1
    }


def chunk_layers(balance: Sequence[int]) -> list[range]:
    """The layer indices of each chunk under ``balance``."""
    found, first = [], 0
    for count in balance:
        found.append(range(first, first + count))
        first += count
    return found


def stages_using(shared: SharedParameter, balance: Sequence[int], placement: Sequence[int]) -> tuple[int, ...]:
    """The stages whose chunks use ``shared``, in order, each once."""
    stages: list[int] = []
    for chunk, layers in enumerate(chunk_layers(balance)):
        if any(layer in layers for layer in shared.layers) and placement[chunk] not in stages:
            stages.append(placement[chunk])
    return tuple(sorted(stages))


def unique(parameters: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Parameters without repeats, in first-seen order."""
    seen: set[int] = set()
    found = []
    for parameter in parameters:
        if id(parameter) not in seen:
            seen.add(id(parameter))
            found.append(parameter)
    return found
