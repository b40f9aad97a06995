"""Who runs a Pipe, decided once: threads in one process, or one stage per rank of a group.

``processes`` is the one place that asks whether there is a process group. What it returns
answers both sides of that question: the ``Ranks`` that every collective decision goes to,
and the runner that steps run on (``LocalRunner`` or this rank's ``DistRunner``, with the
data-parallel and tensor-parallel strategies of its stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from schedules import Schedule
from units import Cut

from pipeline.compute.chunk import ChunkOptions
from pipeline.group.distributed import Distributed
from pipeline.group.process_groups import rank_device
from pipeline.group.ranks import OneProcess, RankGroup, Ranks
from pipeline.runtime.data_parallel import data_parallel_of
from pipeline.runtime.dist_runner import DistRunner
from pipeline.runtime.local_runner import LocalRunner
from pipeline.runtime.runner import Runner
from pipeline.runtime.expert_parallel import ExpertSplit
from pipeline.runtime.tensor_parallel import TensorSplit


class Processes(Protocol):
    """The processes a Pipe runs on (``ranks``) and the runner that goes with them."""

    @property
    def ranks(self) -> Ranks: ...

    def implied_stages(self) -> dict[str, int]:
        """The stage count the processes imply, by where it comes from (none in one process)."""

    def devices(self, given: Sequence[Any] | None, stages: int) -> list[torch.device]:
        """One device per stage in one process (``given``, or the default); with a group,
        this rank's device alone.

        Raises:
            ValueError: devices given with a group (each rank picks its own).
        """

    def build_runner(self, cut: Cut, balance: Sequence[int], schedule: Schedule,
                     devices: Sequence[torch.device], options: ChunkOptions) -> Runner:
        """The runner of ``cut``'s units split by ``balance``; ``devices``: one per stage in
        one process, this rank's with a group."""


class InOneProcess:
    """Every stage a thread of this process."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.ranks: Ranks = OneProcess(timeout)

    def implied_stages(self) -> dict[str, int]:
        return {}

    def devices(self, given: Sequence[Any] | None, stages: int) -> list[torch.device]:
        if given is None:
            return default_devices(stages)
        return [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
                for d in given]

    def build_runner(self, cut: Cut, balance: Sequence[int], schedule: Schedule,
                     devices: Sequence[torch.device], options: ChunkOptions) -> Runner:
        return LocalRunner(cut.units, list(balance), schedule, list(devices), options, self.timeout)


class AcrossRanks:
    """One stage per rank of ``distributed.group``."""

    def __init__(self, distributed: Distributed, timeout: float) -> None:
        self.distributed = distributed
        self.timeout = timeout
        self.ranks: Ranks = RankGroup(distributed.group, timeout)

    def implied_stages(self) -> dict[str, int]:
        return {"the group's size": self.ranks.size}

    def devices(self, given: Sequence[Any] | None, stages: int) -> list[torch.device]:
        if given is not None:
            raise ValueError("with group=..., each rank picks its own device; pass devices=None")
        return [rank_device(self.distributed.group)]

    def build_runner(self, cut: Cut, balance: Sequence[int], schedule: Schedule,
                     devices: Sequence[torch.device], options: ChunkOptions) -> Runner:
        distributed, device = self.distributed, devices[0]
        data_parallel = data_parallel_of(distributed, device, self.timeout,
                                         bool(schedule.split_backward))
        return DistRunner(cut.units, list(balance), schedule, device, options, self.timeout,
                          distributed.group, distributed.init_fn, distributed.transport,
                          data_parallel, _tensor_split(distributed, cut, self.timeout),
                          _expert_split(distributed, cut, self.timeout))


def default_devices(stages: int) -> list[torch.device]:
    """The CUDA devices round-robin when there are any, else the CPU for every stage."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return [torch.device("cuda", stage % count) for stage in range(stages)]
    return [torch.device("cpu")] * stages


def processes(distributed: Distributed | None, timeout: float) -> Processes:
    """Threads of this process without ``distributed``; else one stage per rank of its group."""
    if distributed is None:
        return InOneProcess(timeout)
    return AcrossRanks(distributed, timeout)


def _tensor_split(distributed: Distributed, cut: Cut, timeout: float) -> TensorSplit | None:
    """How ``cut`` splits over the mesh's ``tp`` dimension, where there is one and a plan."""
    tp_mesh = distributed.tp_mesh
    if distributed.tensor_parallel is None or tp_mesh is None:
        return None
    return TensorSplit(cut, distributed.tensor_parallel, tp_mesh, timeout)


def _expert_split(distributed: Distributed, cut: Cut, timeout: float) -> ExpertSplit | None:
    """How ``cut`` spreads its experts over the mesh's ``ep`` dimension, where there is one
    larger than 1 and a plan."""
    ep_mesh = distributed.ep_mesh
    if distributed.expert_parallel is None or ep_mesh is None:
        return None
    return ExpertSplit(cut, distributed.expert_parallel, ep_mesh, timeout)
