"""What crosses a stage boundary: any pytree of tensors, flattened to leaves and back.

A stage may return a tensor, a tuple, a list or a dict of tensors, nested, with
non-tensor leaves (ints, None, strings) among them. The runtime works on the
flat list of leaves: the floating-point and complex tensors are the ones that
carry gradients (integer and bool tensors never do), and the structure travels
beside them so that the next stage receives exactly what the previous one
returned. Between ranks that structure is bytes from a peer: it travels as
checked JSON, never pickle (``pipeline.payloads.structure``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipeline.payloads.checked_json import StructureError
from pipeline.payloads.structure import MAX_STRUCTURE_BYTES, decode_structure, encode_structure

TENSOR, TUPLE, STRUCTURED = 0, 1, 2  # a payload's kind on the wire


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
    shape and non-tensor leaves travel as JSON (``encode_structure``), in a last uint8 tensor.

    Raises:
        TypeError, ValueError: as ``encode_structure``, before anything is sent.
    """
    if isinstance(payload, torch.Tensor):
        return TENSOR, [payload]
    if type(payload) is tuple and payload and all(isinstance(t, torch.Tensor) for t in payload):
        return TUPLE, list(payload)  # a namedtuple is not a plain tuple: it goes structured
    flat = flatten(payload)
    blob = encode_structure(flat.spec, flat.leaves)
    return STRUCTURED, [*flat.tensors, torch.frombuffer(bytearray(blob), dtype=torch.uint8)]


def from_wire(kind: int, tensors: Sequence[torch.Tensor]) -> Any:
    """Undo ``to_wire``.

    Raises:
        StructureError: a kind, a structure or a number of tensors that ``to_wire`` never
            writes, or a class the receiver does not know (a ``ValueError``).
    """
    if kind == TENSOR and len(tensors) == 1:
        return tensors[0]
    if kind == TUPLE and tensors:
        return tuple(tensors)
    if kind != STRUCTURED or not tensors:
        raise StructureError(f"expected kind {TENSOR} with one tensor, {TUPLE} or {STRUCTURED} "
                             f"with at least one, got kind {kind} with {len(tensors)}")
    blob = tensors[-1]
    if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() > MAX_STRUCTURE_BYTES:
        raise StructureError(f"expected a structure of uint8 bytes in one dimension, at most "
                             f"{MAX_STRUCTURE_BYTES}, got {blob.dtype} of shape "
                             f"{tuple(blob.shape)}")
    return decode_structure(blob.cpu().numpy().tobytes(), tensors[:-1])
