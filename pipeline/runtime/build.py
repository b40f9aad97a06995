"""Pick and build a Pipe's runner: threads in one process, or one stage per rank of a group."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from schedules import Schedule

from pipeline.compute.chunk import ChunkOptions
from pipeline.runtime.dist_runner import DistRunner
from pipeline.runtime.local_runner import LocalRunner
from pipeline.runtime.runner import Runner


def build_runner(model: nn.Sequential, balance: Sequence[int], schedule: Schedule,
                 devices: Sequence[torch.device], options: ChunkOptions, timeout: float,
                 group: ProcessGroup | None, data_group: ProcessGroup | None,
                 init_fn: Callable[[nn.Module], None] | None, transport: str) -> Runner:
    """A ``LocalRunner`` over ``devices`` without a group, else this rank's ``DistRunner``."""
    if group is None:
        return LocalRunner(model, list(balance), schedule, list(devices), options, timeout)
    return DistRunner(model, list(balance), schedule, devices[0], options, timeout, group,
                      data_group, init_fn, transport)
