"""How a stage's data-parallel replicas share it: the one place that asks, and what each way answers.

``data_parallel_of`` is the one place that asks whether a stage has replicas; everything
else asks its ``DataParallel``: ``Pipe`` the weights of the micro-batches' losses (over the
union of the replicas' batches), ``predict`` the link between replicas, and ``DistRunner``
to shard the stage's layers once they are materialised, to prepare each step, to reduce
the step's gradients after the last backward (and the last W of a split backward), to
average the loss, to drop a failed step's partial gradients and to free what a
forward-only call gathered. ``Alone`` has no replicas; ``Replicate`` is plain data
parallelism (both in ``replicas``); ``FullyShard`` uses FSDP2's ``fully_shard`` and names
each FSDP2 internal it touches (``fully_shard``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from schedules import Link

from pipeline.compute.loss import LossRule
from pipeline.group.distributed import Distributed
from pipeline.runtime.fully_shard import FullyShard
from pipeline.runtime.replicas import (
    NOT_SHARDED,
    Alone,
    Replicas,
    Replicate,
    Sharding,
    local_part,
    replication,
)

__all__ = ["NOT_SHARDED", "Alone", "DataParallel", "FullyShard", "Replicas", "Replicate",
           "Sharding", "data_parallel_of", "local_part", "replication"]


class DataParallel(Protocol):
    """What a stage's replicas do together.

    Attributes:
        group: the replicas' process group (None without replicas).
    """

    @property
    def group(self) -> dist.ProcessGroup | None: ...

    def loss_weights(self, rule: LossRule, targets: Sequence[Any], device: torch.device
                     ) -> list[float]:
        """Each micro-batch's loss factor, so that the replicas' averaged gradients are the
        union of their batches' (every replica of the last stage calls it at once)."""

    def average_loss(self, loss: torch.Tensor) -> None:
        """``loss`` (this replica's batch loss) made the replicas' mean, in place."""

    def link(self, device: torch.device) -> Link | None:
        """The slowest hop between neighbouring replicas (every replica calls it at once),
        or None without replicas."""

    def shard(self, layers: Sequence[nn.Module]) -> None: ...

    def begin_step(self) -> None: ...

    def begin_forward_only(self) -> None: ...

    def gathered(self) -> AbstractContextManager[None]: ...

    def reduce_gradients(self, parameters: Sequence[nn.Parameter]) -> None: ...

    def abandon_step(self) -> None: ...

    def after_forward_only(self) -> None: ...

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]: ...

    @property
    def norm_groups(self) -> dict[str, dist.ProcessGroup | None]: ...

    @property
    def sharding(self) -> Sharding: ...


def data_parallel_of(distributed: Distributed, device: torch.device, timeout: float,
                     split_backward: bool) -> DataParallel:
    """How this rank's stage shares its work with its replicas (``Distributed.data_group``,
    ``.data_parallel``): alone, whole copies, or FSDP2 shards."""
    ep_mesh = distributed.ep_mesh
    if ep_mesh is not None:
        from pipeline.runtime.expert_parallel import ExpertReplicas

        assert distributed.batch_group is not None
        return ExpertReplicas(distributed.batch_group, distributed.data_group,
                              ep_mesh.get_group(), timeout, device)
    group = distributed.data_group
    if group is None:
        return Alone()
    if distributed.data_parallel == "fsdp":
        return FullyShard(_replicas_mesh(distributed.mesh, group, device.type),
                          distributed.reshard_after_forward, split_backward, timeout)
    return Replicate(group, timeout, device)


def _replicas_mesh(mesh: DeviceMesh | None, group: dist.ProcessGroup, device_type: str
                   ) -> DeviceMesh:
    """The one-dimensional mesh of the replicas' ``group`` (FSDP2 shards over a mesh): the
    ``"dp"`` dimension of the mesh they came from, or one made over ``group``."""
    if mesh is not None and "dp" in (mesh.mesh_dim_names or ()):
        return mesh["dp"]
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp",))
