"""A Pipe's distributed options in one place: the process groups, the transport, materialising.

``Pipe(..., distributed=Distributed(group, data_group=...))`` says how a pipeline runs
across processes; the separate keywords ``group=``, ``data_group=``, ``transport=`` and
``init_fn=`` remain as shorthands for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.transports import TRANSPORTS


@dataclass(frozen=True)
class Distributed:
    """One stage per rank of ``group``, and what goes with it.

    Attributes:
        group: the pipeline's process group; rank r runs stage r.
        data_group: the data-parallel group whose replicas of this stage average their
            gradients after each step, or None.
        transport: ``"auto"`` (NCCL's rules under NCCL, tag-matched messages under gloo),
            ``"gloo"``, or ``"ordered"`` (NCCL's rules on any backend; on gloo it also
            waits for every send, the worst case NCCL allows).
        init_fn: with a model on the ``meta`` device, called on each local layer after it
            is materialised (default: ``reset_parameters`` where a layer has it).
    """

    group: ProcessGroup
    data_group: ProcessGroup | None = None
    transport: str = "auto"
    init_fn: Callable[[nn.Module], None] | None = None

    @property
    def holders(self) -> ProcessGroup:
        """Every rank that holds a part of the model: the pipeline's group, or with
        data-parallel replicas the default group."""
        if isinstance(self.data_group, ProcessGroup):
            world = dist.group.WORLD
            assert world is not None  # a data group implies an initialised default group
            return world
        return self.group

    def __post_init__(self) -> None:
        if not isinstance(self.group, ProcessGroup):
            raise TypeError(f"Distributed.group: expected a torch.distributed ProcessGroup, "
                            f"got {type(self.group).__name__}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; expected one of: "
                             f"{', '.join(TRANSPORTS)}")


def resolve_distributed(distributed: Distributed | None, **shorthands: Any
                        ) -> Distributed | None:
    """``distributed``, or the one the shorthand keywords describe (None: one process).

    Raises:
        ValueError: both ``distributed`` and a shorthand, or a shorthand without ``group``.
    """
    given = {name: value for name, value in shorthands.items()
             if value is not None and not (name == "transport" and value == "auto")}
    if distributed is not None:
        if given:
            raise ValueError(f"pass either distributed=Distributed(...) or "
                             f"{', '.join(f'{name}=' for name in given)}, not both")
        return distributed
    if "group" not in given:
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise ValueError(f"{', '.join(f'{name}=' for name in given)} {verb} a process "
                             f"group: pass group=... (or distributed=Distributed(group, ...))")
        return None
    return Distributed(**given)
