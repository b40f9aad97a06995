"""Whole copies of a stage: no replicas (``Alone``), or replicas that all-reduce (``Replicate``).

Also what every way of holding a stage shares: how the replicas hold it (``Sharding``, for
``Pipe.predict`` and the planner), the part of a tensor this rank holds, and what
replicas do together however they hold the stage (``Replicas``: the union's loss weights,
the mean loss, the link between them). FSDP2's shards build on it in ``fully_shard``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from schedules import Link

from pipeline.compute.dtensors import is_dtensor
from pipeline.compute.loss import LossRule
from pipeline.group.agreement import ReplicaAgreement
from pipeline.group.collectives import all_reduce, union_total
from pipeline.group.links import slowest_link


@dataclass(frozen=True)
class Sharding:
    """How a stage's replicas hold it, for ``Pipe.predict`` and the planner.

    Attributes:
        replicas: ranks holding this stage (1 without data parallelism).
        sharded: FSDP2 (parameters, gradients and optimizer state 1/replicas each between
            steps; gathered parameters and unsharded gradients within one).
        reshard_after_forward: gathered parameters freed after each forward.
        shard_groups: the parameter counts of FSDP's shard groups on this rank (whole, not
            sharded): the modules ``fully_shard`` wraps as one, gathered and reduced together.
    """

    replicas: int = 1
    sharded: bool = False
    reshard_after_forward: bool = False
    shard_groups: tuple[int, ...] = ()


NOT_SHARDED = Sharding()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds (a DTensor's local shard, else itself)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def replication(tensor: torch.Tensor, sizes: dict[str, int]) -> int:
    """How many ranks along the mesh dimensions ``sizes`` (name -> ranks) hold the same part
    of ``tensor`` as this one: all of them along a dimension it is not sharded over."""
    sharded: set[str] = set()
    if is_dtensor(tensor):
        names = tensor.device_mesh.mesh_dim_names or ()
        # Not is_shard(): FSDP over a tensor-parallel shard places a _StridedShard, which
        # is no Shard; a gradient is never Partial here.
        sharded = {name for name, placement in zip(names, tensor.placements)
                   if not placement.is_replicate()}
    return math.prod(size for name, size in sizes.items() if name not in sharded)


class Alone:
    """No replicas."""

    group: dist.ProcessGroup | None = None

    @property
    def norm_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """The groups along which this rank's gradients are spread, beside ``pp`` and
        ``tp`` (``grad_norm``), by mesh dimension."""
        return {"dp": self.group}

    def loss_weights(self, rule: LossRule, targets: Sequence[Any], device: torch.device
                     ) -> list[float]:
        return rule.weights(targets)

    def average_loss(self, loss: torch.Tensor) -> None:
        pass

    def link(self, device: torch.device) -> Link | None:
        return None

    def shard(self, layers: Sequence[nn.Module]) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def begin_forward_only(self) -> None:
        pass

    def gathered(self) -> AbstractContextManager[None]:
        return nullcontext()

    def reduce_gradients(self, parameters: Sequence[nn.Parameter]) -> None:
        pass

    def abandon_step(self) -> None:
        pass

    def after_forward_only(self) -> None:
        pass

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    @property
    def sharding(self) -> Sharding:
        return NOT_SHARDED


class Replicas(Alone):
    """What replicas do together however they hold the stage: the union's loss weights, the
    mean loss, the link between them."""

    group: dist.ProcessGroup

    def __init__(self, group: dist.ProcessGroup, timeout: float) -> None:
        self.group = group
        self.timeout = timeout

    def loss_weights(self, rule: LossRule, targets: Sequence[Any], device: torch.device
                     ) -> list[float]:
        replicas, total = union_total(rule.total(targets), self.group, self.timeout,
                                      device)
        # The replicas' gradients are averaged: weigh by their count to get the union's sum.
        return [w * replicas for w in rule.weights(targets, total or None)]

    def average_loss(self, loss: torch.Tensor) -> None:
        all_reduce(loss, self.group, self.timeout, "averaging the loss")
        loss.div_(dist.get_world_size(self.group))

    def link(self, device: torch.device) -> Link | None:
        if dist.get_world_size(self.group) < 2:
            return None
        return slowest_link(self.group, device, self.timeout)


class Replicate(Replicas):
    """Each replica holds the whole stage; gradients are averaged after each step."""

    def __init__(self, data_group: dist.ProcessGroup, timeout: float,
                 device: torch.device | None = None) -> None:
        super().__init__(data_group, timeout)
        self.agreement = ReplicaAgreement(data_group, timeout, device or torch.device("cpu"))

    @property
    def sharding(self) -> Sharding:
        return Sharding(replicas=dist.get_world_size(self.group))

    def begin_step(self) -> None:
        # Every collective here is bounded: no need to meet first.
        self.agreement.start(meet=False)

    def abandon_step(self) -> None:
        self.agreement.failed()

    def reduce_gradients(self, parameters: Sequence[nn.Parameter]) -> None:
        self.agreement.succeeded()
        replicas = dist.get_world_size(self.group)
        for parameter in parameters:
            if parameter.grad is not None:
                grad = local_part(parameter.grad)
                all_reduce(grad, self.group, self.timeout, "averaging gradients")
                grad.div_(replicas)
