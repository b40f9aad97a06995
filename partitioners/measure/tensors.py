"""Helpers over a tensor or a tuple of tensors: move, detach, count bytes, count saved bytes."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch import nn


def _map(value: Any, function: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return function(value)
    return pytree.tree_map(lambda leaf: function(leaf) if isinstance(leaf, torch.Tensor)
                           else leaf, value)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of ``value`` (a tensor, or any pytree: tuples, lists, dicts, a model's
    output class), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor moved to ``device``."""
    return _map(value, lambda tensor: tensor.to(device))


def detached(value: Any) -> Any:
    """``value`` with every tensor detached from the graph."""
    return _map(value, lambda tensor: tensor.detach())


def fresh_inputs(value: Any, grad: bool) -> tuple[Any, list[torch.Tensor]]:
    """A private copy of ``value`` for one run of a layer, and the leaves it grows from.

    Every tensor is copied, so a layer that writes into its input (``ReLU(inplace=True)``,
    ``x.mul_()``) never changes the caller's tensors. A floating tensor needs a gradient
    if ``grad`` or if it required one already; it is then a clone of a fresh leaf, not
    the leaf itself: autograd forbids in-place writes to a leaf that requires grad, and
    a stage's input is never one in a real pipeline either (it comes out of a copy).

    Args:
        value: a tensor, or a (nested) tuple or list of tensors and other values.
        grad: whether floating tensors should require grad.

    Returns:
        (the copy to feed the layer, the leaves requiring grad, in order): the input
        gradient is the gradient with respect to those leaves.
    """
    leaves: list[torch.Tensor] = []

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        differentiable = tensor.is_floating_point() or tensor.is_complex()
        if not (differentiable and (grad or tensor.requires_grad)):
            return tensor.detach().clone()
        leaf = tensor.detach().requires_grad_(True)
        leaves.append(leaf)
        return leaf.clone()

    return _map(value, copy), leaves


def nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (views count their own elements only)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors_of(value))


def storage_pointers(module: nn.Module) -> set[int]:
    """Storage addresses of a module's parameters and buffers."""
    tensors = list(module.parameters()) + list(module.buffers())
    return {_storage_key(tensor)[0] for tensor in tensors}


def storages_of(value: Any) -> set[int]:
    """Storage addresses of the tensors of ``value``."""
    return {_storage_key(tensor)[0] for tensor in tensors_of(value)}


def storage_bytes(tensors: list[torch.Tensor], exclude: set[int]) -> int:
    """Bytes of the distinct storages of ``tensors``, those in ``exclude`` aside."""
    sizes = dict(_storage_key(tensor) for tensor in tensors)
    return sum(size for address, size in sizes.items() if address not in exclude)


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

    def saved(self, tensor: torch.Tensor) -> bool:
        """Whether autograd saved ``tensor``'s storage (and it was counted)."""
        return _storage_key(tensor)[0] in self.seen
