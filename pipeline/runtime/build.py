"""Pick and build a Pipe's runner: threads in one process, or one stage per rank of a group."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from schedules import Schedule

from pipeline.compute.chunk import ChunkOptions
from pipeline.group.distributed import Distributed, TensorParallel
from pipeline.runtime.data_parallel import Alone, DataParallel, FullyShard, Replicate
from pipeline.runtime.dist_runner import DistRunner
from pipeline.runtime.local_runner import LocalRunner
from pipeline.runtime.runner import Runner


def build_runner(model: nn.Sequential, balance: Sequence[int], schedule: Schedule,
                 devices: Sequence[torch.device], options: ChunkOptions, timeout: float,
                 distributed: Distributed | None) -> Runner:
    """A ``LocalRunner`` over ``devices`` in one process, else this rank's ``DistRunner``."""
    if distributed is None:
        return LocalRunner(model, list(balance), schedule, list(devices), options, timeout)
    return DistRunner(model, list(balance), schedule, devices[0], options, timeout,
                      distributed.group, distributed.data_group, distributed.init_fn,
                      distributed.transport, _data_parallel(distributed, devices[0], timeout,
                                                     bool(schedule.split_backward)),
                      _tensor_parallel(distributed))


def _tensor_parallel(distributed: Distributed) -> tuple[TensorParallel, DeviceMesh] | None:
    """The user's ``fn(layer, tp_mesh)`` and the mesh it splits over, where both are."""
    tp_mesh = distributed.tp_mesh
    if distributed.tensor_parallel is None or tp_mesh is None:
        return None
    return distributed.tensor_parallel, tp_mesh


def _data_parallel(distributed: Distributed, device: torch.device,
                   timeout: float, split_backward: bool) -> DataParallel:
    """How this stage's data-parallel replicas share it (``Distributed.data_parallel``)."""
    if distributed.data_group is None:
        return Alone()
    if distributed.data_parallel == "fsdp":
        mesh = distributed.data_mesh(device.type)
        assert mesh is not None
        return FullyShard(mesh, distributed.reshard_after_forward, split_backward, timeout)
    return Replicate(distributed.data_group, timeout, device)
