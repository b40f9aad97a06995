"""Cut the micro-batch to profile out of a sample batch (and its target), along dim 0."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def _rows(value: Any, what: str) -> int | None:
    """Rows along dim 0 shared by every tensor of ``value`` (a tensor, or a tuple, list or
    dict of them; other leaves are ignored); None if one has no dim 0."""
    tensors = [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
    if not tensors:
        return None
    rows: set[int] = set()
    for t in tensors:
        if t.dim() == 0:
            return None
        rows.add(t.shape[0])
    if len(rows) != 1:
        raise ValueError(f"the tensors of the {what} must share dim 0, got sizes {sorted(rows)}")
    return rows.pop()


def _head(value: Any, rows: int) -> Any:
    return pytree.tree_map(lambda leaf: leaf[:rows] if isinstance(leaf, torch.Tensor) else leaf,
                           value)


def microbatch_rows(batch: int, microbatch_size: int | None, microbatches: int | None) -> int:
    """Rows of the largest micro-batch, as a pipeline would split ``batch`` rows.

    ``microbatches=M`` splits like ``torch.tensor_split``: the first micro-batch,
    the largest, has ``ceil(batch / M)`` rows.

    Raises:
        ValueError: both or a bad value given, or more rows asked than the batch has.
    """
    if microbatch_size is not None and microbatches is not None:
        raise ValueError(
            f"give microbatch_size or microbatches, not both; got microbatch_size="
            f"{microbatch_size} and microbatches={microbatches}"
        )
    for name, value in (("microbatch_size", microbatch_size), ("microbatches", microbatches)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if microbatches is not None:
        if microbatches > batch:
            raise ValueError(
                f"a batch of {batch} rows cannot be split into {microbatches} micro-batches; "
                f"expected microbatches <= {batch}"
            )
        return -(-batch // microbatches)
    if microbatch_size is not None:
        if microbatch_size > batch:
            raise ValueError(
                f"microbatch_size={microbatch_size} is more than the sample's {batch} rows; "
                f"expected a sample of at least {microbatch_size} rows"
            )
        return microbatch_size
    return batch


def first_microbatch(
    sample: Any, target: Any, microbatch_size: int | None, microbatches: int | None
) -> tuple[Any, Any, int | None]:
    """The sample and target cut to one micro-batch, and its rows.

    Args:
        sample: a tensor or a tuple of tensors, the whole batch.
        target: the loss target (a tensor or tuple), or None.
        microbatch_size: rows per micro-batch, or None.
        microbatches: micro-batches the batch is split into, or None.

    Returns:
        (sample, target, rows); with neither option, the sample is one micro-batch
        and is returned as it is. ``rows`` is None for a sample without dim 0.

    Raises:
        ValueError: a bad option, tensors that disagree on dim 0, a target whose
            rows differ from the sample's, or an option given for a sample without dim 0.
    """
    batch = _rows(sample, "sample")
    if batch is None:
        if microbatch_size is not None or microbatches is not None:
            raise ValueError("microbatch_size and microbatches need a sample with a batch "
                             "dimension (dim 0), got a tensor without one")
        return sample, target, None
    rows = microbatch_rows(batch, microbatch_size, microbatches)
    if target is not None and rows != batch:
        target_rows = _rows(target, "target")
        if target_rows != batch:
            raise ValueError(f"the target must have the sample's {batch} rows along dim 0 "
                             f"to be split with it, got {target_rows}")
        target = _head(target, rows)
    if rows == batch:
        return sample, target, rows
    return _head(sample, rows), target, rows
