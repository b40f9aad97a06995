"""Parameters shared by several layers (a head tied to the embedding): found, not declared."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
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


def tied_keys(model: nn.Sequential) -> list[tuple[str, ...]]:
    """The state-dict keys of each parameter the model holds under several keys (ties)."""
    keys: dict[int, list[str]] = {}
    for index, layer in enumerate(model):
        for name, parameter in layer.named_parameters(remove_duplicate=False):
            keys.setdefault(id(parameter), []).append(f"{index}.{name}")
    return [tuple(dict.fromkeys(names)) for names in keys.values() if len(set(names)) > 1]


def check_ties_kept(ties: Sequence[Sequence[str]], state: dict[str, Any]) -> None:
    """Raise ValueError where ``state`` gives one shared parameter two values, naming both keys.

    A tied head and embedding are one Parameter (``ties``, from ``tied_keys`` of the
    model as built): loading different values under their keys would leave each stage
    holding the copy it loaded, while their gradients are still summed as one.
    """
    for names in ties:
        given = [name for name in names if name in state]
        for name in given[1:]:
            first = state[given[0]]
            if not (isinstance(first, torch.Tensor) and isinstance(state[name], torch.Tensor)
                    and first.shape == state[name].shape and torch.equal(first, state[name])):
                raise ValueError(
                    f"load_state_dict: {given[0]!r} and {name!r} are one parameter in this "
                    f"model (tied), but the state gives them different values; load a state "
                    f"saved from the tied model, or set both keys to the same tensor")


def check_keys(model: nn.Sequential, state: dict[str, Any], local: Sequence[int]) -> None:
    """Raise ValueError unless ``state`` has exactly the keys it should (strict loading).

    A state with keys of layers beyond ``local`` (a whole model's, loaded on every rank)
    must have the whole model's keys, so that every rank decides alike; one of only
    ``local`` layers (what ``pipe.state_dict()`` saved on this rank) must have theirs.
    """
    layers = {key.partition(".")[0] for key in state}
    whole = any(not index.isdigit() or int(index) not in local for index in layers)
    expected = {key for key in model.state_dict(keep_vars=True)
                if whole or int(key.partition(".")[0]) in local}
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"load_state_dict(strict=True): expected the whole model's keys; missing "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected "
            f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
