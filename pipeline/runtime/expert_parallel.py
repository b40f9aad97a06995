"""Expert parallelism inside a stage: experts spread over ``ep``, every other parameter a replica.

``Distributed.from_mesh(mesh, expert_parallel=plan)``: the ranks along the mesh's ``"ep"``
dimension each take their own rows of the batch, as data-parallel replicas do, and each
holds 1/ep of every experts module's experts (``Cut.parallelize_experts``): a token goes
to the rank holding its expert and comes back (``units.ep_dispatch``).

``ExpertSplit`` applies the plan to this rank's units. ``ExpertReplicas`` is how the
stage's batch-sharing ranks (``dp`` x ``ep``) reduce gradients: a replicated parameter's
over all of them, an expert's over ``dp`` only (the ``ep`` ranks hold other experts, and
each expert's gradient already sums every rank's tokens through the exchange's
backward), both divided by the ranks sharing the batch, whose losses are weighted as
the union's (``Replicas.loss_weights``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from schedules import Schedule
from units import Cut

from pipeline.compute.dtensors import is_dtensor
from pipeline.group.collectives import all_reduce
from pipeline.runtime.replicas import Replicate, local_part


@dataclass(frozen=True)
class ExpertSplit:
    """``plan`` over ``mesh`` (the ``ep`` dimension), for ``cut``'s units."""

    cut: Cut
    plan: Any  # "auto" or {module name pattern: "ep_dispatch_experts"}
    mesh: DeviceMesh
    timeout: float  # the Pipe's: how long an all-to-all waits for the other ranks

    def check(self) -> None:
        """Raise ValueError for a plan the cut cannot take (``Cut.check_expert_split``)."""
        self.cut.check_expert_split(self.plan, self.mesh.size())

    def apply(self, indices: Sequence[int]) -> Any:
        """Spread the experts of units ``indices`` (this rank's); what counts the
        exchanges (``units.ep_dispatch.Exchange``)."""
        return self.cut.parallelize_experts(self.plan, self.mesh, indices, self.timeout)


def unmatched_pairs(schedule: Schedule, stage: int, experts: dict[int, int]
                    ) -> list[tuple[int, int, int, int]]:
    """The overlapped pairs of ``stage`` whose chunks hold different numbers of expert
    parameters (``experts``: per chunk of the stage), as ``(forward chunk, backward chunk,
    its count, its count)``, each chunk pair once: one side of such a pair issues more
    exchanges than the other can cover, and waits its surplus in full."""
    order, found = schedule.orders[stage], []
    for start in schedule.pairs[stage]:
        forward, backward = order.chunks[start], order.chunks[start + 1]
        counts = (experts.get(forward, 0), experts.get(backward, 0))
        entry = (forward, backward, *counts)
        if counts[0] != counts[1] and entry not in found:
            found.append(entry)
    return found


def expert_parameters(modules: Sequence[nn.Module]) -> int:
    """How many of ``modules``' parameters are expert shards (DTensors over ``ep``)."""
    return sum(_is_expert(p) for module in modules for p in module.parameters())


class ExpertReplicas(Replicate):
    """The ranks of a stage that take their own rows (``dp`` x ``ep``): whole copies of
    everything but the experts, each ``ep`` rank its share of those."""

    def __init__(self, batch_group: dist.ProcessGroup, data_group: dist.ProcessGroup | None,
                 ep_group: dist.ProcessGroup, timeout: float,
                 device: torch.device | None = None) -> None:
        super().__init__(batch_group, timeout, device)
        self.data_group = data_group
        self.ep_group = ep_group

    @property
    def norm_groups(self) -> dict[str, dist.ProcessGroup | None]:
        return {"dp": self.data_group, "ep": self.ep_group}

    def reduce_gradients(self, parameters: Sequence[nn.Parameter]) -> None:
        self.agreement.succeeded()
        sharing = dist.get_world_size(self.group)
        for parameter in parameters:
            expert = _is_expert(parameter)
            if expert and parameter.grad is None:
                # An expert no token picked on this rank: its dp replicas may hold one.
                parameter.grad = torch.zeros_like(parameter)
            if parameter.grad is None:
                continue
            grad = local_part(parameter.grad)
            group = self.data_group if expert else self.group
            if group is not None:
                all_reduce(grad, group, self.timeout, "averaging gradients")
            grad.div_(sharing)


def _is_expert(parameter: torch.Tensor) -> bool:
    return is_dtensor(parameter) and "ep" in (parameter.device_mesh.mesh_dim_names or ())
