"""What crosses a stage boundary: any pytree of tensors, flattened to leaves and back.

A stage may return a tensor, a tuple, a list or a dict of tensors, nested, with
non-tensor leaves (ints, None, strings) among them. The runtime works on the
flat list of leaves: the floating-point and complex tensors are the ones that
carry gradients (integer and bool tensors never do), and the structure travels
beside them so that the next stage receives exactly what the previous one
returned.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


def differentiable(value: Any) -> bool:
    """Whether ``value`` is a tensor that can carry a gradient (floating point or complex)."""
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


@dataclass(frozen=True)
class Flat:
    """A payload as its leaves and the structure that rebuilds it."""

    leaves: tuple[Any, ...]
    spec: Any  # a torch.utils._pytree.TreeSpec

    def rebuild(self, leaves: tuple[Any, ...] | list[Any] | None = None) -> Any:
        """The payload again, with ``leaves`` in place of the original ones when given."""
        if self.spec is _LEAF:  # a plain tensor: no pytree work
            return self.leaves[0] if leaves is None else leaves[0]
        return pytree.tree_unflatten(list(self.leaves if leaves is None else leaves), self.spec)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(leaf for leaf in self.leaves if isinstance(leaf, torch.Tensor))

    @property
    def differentiable(self) -> tuple[torch.Tensor, ...]:
        return tuple(leaf for leaf in self.leaves if differentiable(leaf))


_LEAF = pytree.tree_flatten(0)[1]  # the structure of a payload that is one leaf


def flatten(value: Any) -> Flat:
    """Split a payload into its leaves and structure."""
    if isinstance(value, torch.Tensor):  # the common case, without pytree work
        return Flat((value,), _LEAF)
    leaves, spec = pytree.tree_flatten(value)
    return Flat(tuple(leaves), _LEAF if spec == _LEAF else spec)


def map_tensors(value: Any, function: Any) -> Any:
    """``value`` with ``function`` applied to every tensor leaf (other leaves kept)."""
    if isinstance(value, torch.Tensor):
        return function(value)
    return pytree.tree_map(lambda leaf: function(leaf) if isinstance(leaf, torch.Tensor) else leaf,
                           value)


def detach(value: Any) -> Any:
    """Every tensor of ``value`` detached from its graph."""
    return map_tensors(value, lambda tensor: tensor.detach())


def to_wire(payload: Any) -> tuple[int, list[torch.Tensor]]:
    """``(kind, tensors)`` for the wire (see ``pipeline.transports.wire``): a structured payload's
    shape and non-tensor leaves travel pickled, as a last uint8 tensor."""
    if isinstance(payload, torch.Tensor):
        return 0, [payload]
    if isinstance(payload, tuple) and payload and all(isinstance(t, torch.Tensor) for t in payload):
        return 1, list(payload)
    flat = flatten(payload)
    others = [(i, leaf) for i, leaf in enumerate(flat.leaves) if not isinstance(leaf, torch.Tensor)]
    blob = pickle.dumps((pytree.treespec_dumps(flat.spec), others, len(flat.leaves)))
    structure = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return 2, [*flat.tensors, structure]


def from_wire(kind: int, tensors: tuple[torch.Tensor, ...]) -> Any:
    """Undo ``to_wire``.

    Raises:
        ValueError: a structure that does not match the tensors that came with it.
    """
    if kind == 0:
        return tensors[0]
    if kind == 1:
        return tensors
    spec_text, others, count = pickle.loads(tensors[-1].cpu().numpy().tobytes())
    spec = pytree.treespec_loads(spec_text)
    leaves: list[Any] = [None] * count
    for index, leaf in others:
        leaves[index] = leaf
    holes = [i for i in range(count) if i not in dict(others)]
    if len(holes) != len(tensors) - 1:
        raise ValueError(
            f"a structured payload announced {len(holes)} tensors, got {len(tensors) - 1}"
        )
    for index, tensor in zip(holes, tensors[:-1]):
        leaves[index] = tensor
    return pytree.tree_unflatten(leaves, spec)
