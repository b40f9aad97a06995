"""Split a batch into micro-batches along dim 0, and merge micro-batch outputs back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch

Tensors = Union[torch.Tensor, tuple[torch.Tensor, ...]]


def batch_size(batch: Tensors) -> int:
    """Rows along dim 0 of a tensor, or of the first tensor of a tuple."""
    first = batch[0] if isinstance(batch, tuple) else batch
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise TypeError(
            f"a batch must be a tensor or a tuple of tensors with a batch dimension, "
            f"got {type(first).__name__}"
        )
    return first.shape[0]


def split(batch: Tensors | Sequence[Tensors], chunks: int) -> list[Tensors]:
    """Split ``batch`` into ``chunks`` micro-batches along dim 0, like ``torch.tensor_split``.

    A list of micro-batches (pre-split, e.g. of different sequence lengths) is
    returned as it is, after checking it has ``chunks`` entries.

    Raises:
        ValueError: fewer rows than ``chunks``, tensors of a tuple that disagree
            on the batch size, or a pre-split list of the wrong length.
        TypeError: something other than tensors.
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
    if isinstance(batch, tuple):
        rows = {batch_size(t) for t in batch}
        if len(rows) != 1:
            raise ValueError(f"tensors of a batch tuple must share dim 0, got sizes {sorted(rows)}")
    rows = batch_size(batch)
    if rows < chunks:
        raise ValueError(
            f"a batch of {rows} rows cannot be split into {chunks} micro-batches; "
            f"expected a batch of at least {chunks} rows (or fewer chunks)"
        )
    if isinstance(batch, tuple):
        columns = [torch.tensor_split(t, chunks) for t in batch]
        return [tuple(column[i] for column in columns) for i in range(chunks)]
    return list(torch.tensor_split(batch, chunks))


def merge(outputs: Sequence[Tensors]) -> Tensors:
    """Concatenate micro-batch outputs along dim 0 (tuples element-wise)."""
    if isinstance(outputs[0], tuple):
        return tuple(torch.cat([out[i] for out in outputs]) for i in range(len(outputs[0])))
    return torch.cat(list(outputs))  # type: ignore[arg-type]


def as_tuple(value: Tensors) -> tuple[torch.Tensor, ...]:
    """A tensor as a 1-tuple; a tuple as it is."""
    return value if isinstance(value, tuple) else (value,)


def from_tuple(values: tuple[torch.Tensor, ...], like_tuple: bool) -> Tensors:
    """Undo ``as_tuple``: a 1-tuple back to its tensor unless the original was a tuple."""
    return values if like_tuple else values[0]


def to_device(value: Any, device: torch.device) -> Any:
    """A tensor, or a tuple of them, on ``device``; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(to_device(v, device) for v in value)
    return value
