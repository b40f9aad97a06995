"""Helpers over a tensor or a tuple of tensors: move, detach, count bytes, count saved bytes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _map(value: Any, function: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map(item, function) for item in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor moved to ``device``."""
    return _map(value, lambda tensor: tensor.to(device))


def detached(value: Any) -> Any:
    """``value`` with every tensor detached from the graph."""
    return _map(value, lambda tensor: tensor.detach())


def requiring_grad(value: Any, grad: bool) -> Any:
    """Fresh leaves: floating tensors require grad if ``grad`` or if they did already."""

    def leaf(tensor: torch.Tensor) -> torch.Tensor:
        differentiable = tensor.is_floating_point() or tensor.is_complex()
        wants = (grad or tensor.requires_grad) and differentiable
        return tensor.detach().requires_grad_(wants)

    return _map(value, leaf)


def nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (views count their own elements only)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in _tensors(value))


def storage_pointers(module: nn.Module) -> set[int]:
    """Storage addresses of a module's parameters and buffers."""
    tensors = list(module.parameters()) + list(module.buffers())
    return {_storage_key(tensor)[0] for tensor in tensors}


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory ``tensor`` keeps alive."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested, ...)
        return id(tensor), tensor.numel() * tensor.element_size()


class SavedBytes:
    """Pack/unpack hooks that add up the distinct storages autograd saves, minus excluded ones.

    Use with ``torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack)``.
    A storage saved twice (a tensor and its view) counts once.
    """

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.seen: set[int] = set()
        self.total = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        address, size = _storage_key(tensor)
        if address not in self.exclude and address not in self.seen:
            self.seen.add(address)
            self.total += size
        return tensor

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor
