"""A batch and its target, as ``Pipe(..., sample=...)`` takes them (beside the loss they are timed with).

``Pipe(..., sample=Sample(inputs, target))`` gives the batch a model is traced, profiled and
planned with, and the target its loss is timed against; a bare batch has no target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sample:
    """A batch and its target, for ``Pipe(..., sample=...)``.

    Attributes:
        inputs: the batch as the model takes it (a tensor, a tuple of positional arguments,
            or a mapping of keyword arguments).
        target: its target; with ``chunks="auto"`` or ``schedule="auto"`` the loss's time
            and the memory it keeps count in the plan. None: the plan leaves the loss out.
    """

    inputs: Any
    target: Any = None


def split_sample(sample: Any) -> tuple[Any, Any]:
    """``(inputs, target)`` of a ``Sample``; a bare batch has no target."""
    if isinstance(sample, Sample):
        return sample.inputs, sample.target
    return sample, None
