"""What a Pipe runs, as given or as planned: stages, devices, micro-batches, schedule, cut."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from schedules import Schedule
from schedules.recompute import CheckpointMode, check_mode
from split_backward import SplitMode
from units import Cut

from pipeline.group.distributed import Distributed
from pipeline.group.ranks import Ranks
from pipeline.runtime.build import Processes
from pipeline.setup.coordination import (
    choose_plan,
    expert_parallelism_of,
    replicas_of,
    tensor_parallelism_of,
)
from pipeline.setup.options import check_positive, chunks_per_stage, count_stages


@dataclass(frozen=True)
class Requested:
    """What ``Pipe(...)`` was asked for (``"auto"`` where the plan decides)."""

    chunks: Any
    schedule: Any
    balance: Any
    checkpoint: Any
    devices: Sequence[Any] | None
    stages: int | None
    schedule_options: dict[str, Any] | None
    memory_limit: float | None


@dataclass(frozen=True)
class Picked:
    """What a Pipe runs: the schedule and its options, the balance request, the counts,
    the devices, and the plan that chose them (None when nothing was planned)."""

    schedule: str | Schedule
    balance: Sequence[int] | str | None
    options: dict[str, Any]
    stages: int
    source: str  # where the stage count came from, for messages
    chunks: int
    checkpoint: CheckpointMode
    devices: list[torch.device]
    plan: Any


def pick(requested: Requested, processes: Processes, cut: Cut, samples: tuple[Any, Any, Any],
         deciders: Ranks, distributed: Distributed | None, timeout: float,
         split_backward: SplitMode) -> Picked:
    """The stage count, devices, and the chunks, schedule, balance and checkpoint mode: as
    requested, or planned where ``chunks`` or ``schedule`` is ``"auto"`` (``deciders``'
    first rank plans for all; ``samples``: the batch, its target, the loss function)."""
    chunks, schedule, balance = requested.chunks, requested.schedule, requested.balance
    checkpoint, options = requested.checkpoint, dict(requested.schedule_options or {})
    planning = chunks == "auto" or schedule == "auto"
    per_stage = 1 if planning else chunks_per_stage(schedule, options)
    stages, source = count_stages(schedule, requested.devices, balance, requested.stages,
                                  per_stage, processes.implied_stages())
    devices = processes.devices(requested.devices, stages)
    plan: Any = None
    if planning:
        plan = choose_plan(cut, chunks, schedule, checkpoint, stages, samples, devices,
                           requested.memory_limit, processes.ranks, deciders,
                           replicas_of(distributed, devices[0], timeout), split_backward,
                           tensor_parallelism_of(distributed, cut, devices[0], timeout),
                           expert_parallelism_of(distributed, cut, devices[0], timeout))
        chosen = plan.pipe_options()
        chunks, schedule, balance = chosen["chunks"], chosen["schedule"], chosen["balance"]
        checkpoint, options = chosen["checkpoint"], chosen["schedule_options"]
    return Picked(schedule, balance, options, stages, source, check_positive("chunks", chunks),
                  check_mode("except_last" if checkpoint is None else checkpoint), devices,
                  plan)
