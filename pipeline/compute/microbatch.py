"""Split a batch into micro-batches along dim 0, and merge micro-batch outputs back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree


def batch_size(batch: Any) -> int:
    """Rows along dim 0 of a tensor, or of the first tensor of a tuple, dict or nested batch."""
    leaves = pytree.tree_leaves(batch)
    first = next((leaf for leaf in leaves if isinstance(leaf, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        shown = type(first if first is not None else (leaves or [batch])[0]).__name__
        raise TypeError(
            f"a batch must be a tensor or a tuple/dict of tensors with a batch dimension, "
            f"got {shown}"
        )
    return first.shape[0]


def split(batch: Any, chunks: int) -> list[Any]:
    """Split ``batch`` into ``chunks`` micro-batches along dim 0, like ``torch.tensor_split``.

    A tuple, dict or nested batch is split tensor by tensor (other leaves are
    repeated). A list of micro-batches (pre-split, e.g. of different sequence
    lengths) is returned as it is, after checking it has ``chunks`` entries.

    Raises:
        ValueError: fewer rows than ``chunks``, tensors of a batch that disagree
            on the batch size, or a pre-split list of the wrong length.
        TypeError: no tensor with a batch dimension.
    """
    if isinstance(batch, list):
        if len(batch) != chunks:
            raise ValueError(
                f"a pre-split batch must hold one entry per micro-batch: expected "
                f"{chunks}, got {len(batch)}"
            )
        for part in batch:
            batch_size(part)
        return list(batch)
    if isinstance(batch, torch.Tensor) and batch.dim() and batch.shape[0] >= chunks:
        return list(torch.tensor_split(batch, chunks))  # the common case, without pytree work
    leaves, spec = pytree.tree_flatten(batch)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    rows = {t.shape[0] if t.dim() else None for t in tensors}
    if len(rows) > 1:
        shown = sorted(rows, key=lambda r: -1 if r is None else r)
        raise ValueError(f"tensors of a batch must share dim 0, got sizes {shown}")
    count = batch_size(batch)
    if count < chunks:
        raise ValueError(
            f"a batch of {count} rows cannot be split into {chunks} micro-batches; "
            f"expected a batch of at least {chunks} rows (or fewer chunks)"
        )
    columns = [
        torch.tensor_split(leaf, chunks) if isinstance(leaf, torch.Tensor) else [leaf] * chunks
        for leaf in leaves
    ]
    return [pytree.tree_unflatten([column[i] for column in columns], spec) for i in range(chunks)]


def split_batch(x: Any, target: Any, chunks: int, in_process: bool,
                caller: str = "step") -> tuple[list[Any] | None, list[Any] | None]:
    """``x`` and ``target`` cut into ``chunks`` micro-batches, as a step runs them.

    Across processes a rank may hold only one of them (None for the other).

    Raises:
        ValueError: in one process, x or target missing; micro-batch sizes that differ
            between them.
    """
    if in_process and (x is None or target is None):
        missing = "x" if x is None else "target"
        raise ValueError(f"{caller}() needs x and target in one process (only ranks of a "
                         f"group may leave one out), got {missing}=None")
    inputs = split(x, chunks) if x is not None else None
    targets = split(target, chunks) if target is not None else None
    if inputs is not None and targets is not None:
        rows = [batch_size(p) for p in inputs], [batch_size(p) for p in targets]
        if rows[0] != rows[1]:
            raise ValueError(f"x and target must split into the same micro-batch sizes, got "
                             f"{rows[0]} and {rows[1]}")
    return inputs, targets


def merge(outputs: Sequence[Any]) -> Any:
    """Concatenate micro-batch outputs along dim 0, leaf by leaf (other leaves: the first's)."""
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    merged = []
    for index, leaf in enumerate(flat[0][0]):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            merged.append(torch.cat([leaves[index] for leaves, _ in flat]))
        else:
            merged.append(leaf)
    return pytree.tree_unflatten(merged, spec)


def to_device(value: Any, device: torch.device) -> Any:
    """Every tensor of ``value`` on ``device``; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return pytree.tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, value
    )
