"""How a batch is handed to a model: a tensor, a tuple of positional arguments, or a dict of
keyword arguments (``model(**batch)``), flattened to the leaves a traced graph takes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree


def as_call(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for ``model(*args, **kwargs)``: a dict (any mapping) is keyword
    arguments, a tuple positional arguments, anything else the one positional argument."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, tuple):
        return batch, {}
    return (batch,), {}


def describe(value: Any) -> str:
    """A short, readable picture of a batch's structure (for error messages)."""
    def leaf(item: Any) -> str:
        if isinstance(item, torch.Tensor):
            return f"Tensor{tuple(item.shape)}:{str(item.dtype).removeprefix('torch.')}"
        return repr(item)

    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return leaf(value)


class CallSpec:
    """The structure a traced model was called with, and the non-tensor values it froze.

    Export keeps a non-tensor argument (``use_cache=False``, ``return_dict=True``) as a
    constant of the graph: a call with another value would run the branch frozen for the
    traced one, so it is refused.
    """

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        leaves, self.structure = pytree.tree_flatten((args, kwargs))
        self.keys = tuple(kwargs)
        self.constants = {i: leaf for i, leaf in enumerate(leaves)
                          if not isinstance(leaf, torch.Tensor)}
        self.traced = _shown(args, kwargs)
        self.leaves = len(leaves)

    def flatten(self, batch: Any) -> list[Any]:
        """The leaves of ``batch`` in the order the graph takes them.

        Raises:
            ValueError: a batch of another structure (other keys, another number of
                arguments), or a non-tensor argument other than the traced one.
        """
        args, kwargs = as_call(batch)
        if set(kwargs) == set(self.keys):
            kwargs = {key: kwargs[key] for key in self.keys}  # the traced order
        leaves, structure = pytree.tree_flatten((args, kwargs))
        if structure != self.structure:
            raise ValueError(
                f"this model was traced with the batch {self.traced}; a batch must have the "
                f"same arguments and keys, got {_shown(args, kwargs)}"
            )
        for index, expected in self.constants.items():
            if leaves[index] != expected:
                raise ValueError(
                    f"this model was traced with the non-tensor argument value {expected!r} "
                    f"(the graph keeps it as a constant), got {describe(leaves[index])}; "
                    f"pass the traced value, or build the Pipe with a sample that has this one"
                )
        return leaves


def _shown(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    if kwargs and not args:
        return describe(kwargs)
    return describe(args) if not kwargs else describe((args, kwargs))
