"""A Pipe's arguments that travel together (a sample and its target), and the old keywords.

``Pipe(..., sample=Sample(inputs, target))`` gives the batch a model is traced, profiled and
planned with, and the target its loss is timed against. Keywords that an earlier ``Pipe``
took and a newer spelling replaced are refused by ``refuse_old_keywords`` with that spelling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., None])

# The keyword, and how to say the same thing now.
OLD_KEYWORDS: dict[str, str] = {
    "data_group": "distributed=Distributed(group, data_group=...)",
    "init_fn": "distributed=Distributed(group, init_fn=...) "
               "(or Distributed.from_mesh(mesh, init_fn=...))",
    "transport": "distributed=Distributed(group, transport=...) "
                 "(or Distributed.from_mesh(mesh, transport=...))",
    "data_parallel": "distributed=Distributed.from_mesh(mesh, data_parallel=...) "
                     "(or Distributed(group, data_group=..., data_parallel=...))",
    "reshard_after_forward": "distributed=Distributed.from_mesh(mesh, data_parallel='fsdp', "
                             "reshard_after_forward=True)",
    "tensor_parallel": "distributed=Distributed.from_mesh(mesh, tensor_parallel=...)",
    "loss_count": "loss_fn=SummedLoss(loss_fn, count)",
    "sample_target": "sample=Sample(inputs, target)",
    "memory_report": "with pipe.measure_memory(): pipe.step(...), then pipe.memory",
}


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


def refuse_old_keywords(init: F) -> F:
    """Wrap ``init`` so that a keyword of ``OLD_KEYWORDS`` is a TypeError naming its new spelling."""

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        old = [name for name in kwargs if name in OLD_KEYWORDS]
        if old:
            raise TypeError(
                f"{type(self).__name__}() no longer takes "
                + "; ".join(f"{name}=: pass {OLD_KEYWORDS[name]}" for name in old))
        init(self, *args, **kwargs)

    return checked  # type: ignore[return-value]
