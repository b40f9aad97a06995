"""How a stage's data-parallel replicas share it: whole copies that all-reduce, or FSDP2 shards.

``data_parallel_of`` is the one place that asks whether a stage has replicas; everything
else asks its ``DataParallel``: ``Pipe`` the weights of the micro-batches' losses (over the
union of the replicas' batches), ``predict`` the link between replicas, and ``DistRunner``
to shard the stage's layers once they are materialised, to prepare each step, to reduce
the step's gradients after the last backward (and the last W of a split backward), to
average the loss, to drop a failed step's partial gradients and to free what a
forward-only call gathered. ``Alone`` has no replicas; ``Replicate`` is plain data
parallelism; ``FullyShard`` uses ``torch.distributed.fsdp.fully_shard``:

- The units: each local layer, except that layers holding one parameter (a tied weight,
  one block at several positions) form one unit, since FSDP2 shards a parameter once;
  such a unit is gathered when the step begins (no hook of its own can).
- Within a step a unit's parameters are all-gathered when the step begins, once every
  replica has met (bounded by the timeout), and kept across the micro-batches
  (``reshard_after_forward=False``, the default), and every backward
  (I and W alike) accumulates into the gathered parameters without any reduction; after
  the stage's last backward one reduce-scatter per unit averages the gradients over the
  replicas into the sharded ``.grad`` and frees the gathered parameters. So a step costs
  one all-gather and one reduce-scatter per unit, whatever the micro-batch count.
- FSDP2's collectives wait for the process group's own timeout, not the Pipe's; so
  before the reduce-scatter the replicas agree, within the timeout, that every
  replica's step succeeded (``pipeline.group.agreement``; ``Replicate`` does the same
  before its all-reduces), and a replica whose step failed says so from its error path:
  every replica then raises, none reduces.
- With ``reshard_after_forward=True`` a forward hook frees the gathered parameters after
  each forward of the unit (FSDP2 never reshards a root after its forward by itself, and
  every unit here is a root); FSDP2 gathers them again for the backward and, unless the
  schedule splits backwards (a W may still read them), frees them after it. Gradients
  accumulate unsharded either way until the step's one reduce-scatter.

FSDP2 has no public call for "reduce now" outside its own backward hooks, which fire
per backward and before the W half of a split backward has accumulated anything; as
torch.distributed.pipelining does, ``_reduce_now`` calls each parameter group's
``post_backward`` and the root's final callback. Those, the lazy initialisation a
unit's forward would run (every unit is gathered before its first forward), and
dropping a failed step's gathered gradients are the places this module reaches into
FSDP2's internals (checked by the mesh tests on every torch this project pins).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from schedules import Link

from pipeline.compute.dtensors import is_dtensor
from pipeline.compute.loss import LossRule
from pipeline.errors import PeerError
from pipeline.group.agreement import ReplicaAgreement
from pipeline.group.collectives import all_reduce, union_total
from pipeline.group.distributed import Distributed
from pipeline.group.links import slowest_link

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


@dataclass(frozen=True)
class Sharding:
    """How a stage's replicas hold it, for ``Pipe.predict`` and the planner.

    Attributes:
        replicas: ranks holding this stage (1 without data parallelism).
        sharded: FSDP2 (parameters, gradients and optimizer state 1/replicas each between
            steps; gathered parameters and unsharded gradients within one).
        reshard_after_forward: gathered parameters freed after each forward.
        units: the FSDP units' parameter counts on this rank (whole, not sharded).
    """

    replicas: int = 1
    sharded: bool = False
    reshard_after_forward: bool = False
    units: tuple[int, ...] = ()


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
    def sharding(self) -> Sharding: ...


def data_parallel_of(distributed: Distributed, device: torch.device, timeout: float,
                     split_backward: bool) -> DataParallel:
    """How this rank's stage shares its work with its replicas (``Distributed.data_group``,
    ``.data_parallel``): alone, whole copies, or FSDP2 shards."""
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


class Alone:
    """No replicas."""

    group: dist.ProcessGroup | None = None

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


class FullyShard(Replicas):
    """Each replica holds a 1/dp shard of every local layer (FSDP2), gathered per step."""

    def __init__(self, mesh: DeviceMesh, reshard_after_forward: bool,
                 split_backward: bool = False, timeout: float = 60.0) -> None:
        super().__init__(mesh.get_group(), timeout)
        self.mesh = mesh
        self.agreement = ReplicaAgreement(self.group, timeout, torch.device(mesh.device_type))
        self.reshard_after_forward = reshard_after_forward
        # After a whole backward the unit's gathered parameters are done with until its next
        # forward; after an I, the W to come may still read them.
        self.reshard_after_backward = reshard_after_forward and not split_backward
        self.units: list[FSDPModule] = []
        self.held: list[FSDPModule] = []  # units gathered by hand: layers sharing parameters
        self.keep_gathered = False  # set while a probe runs: no hook frees a unit

    def shard(self, layers: Sequence[nn.Module]) -> None:
        for modules in sharing_units(layers):
            if len(modules) == 1:
                _fully_shard()(modules[0], mesh=self.mesh, reshard_after_forward=False)
                unit = _as_unit(modules[0])
                if self.reshard_after_forward:
                    modules[0].register_forward_hook(self._resharding(unit))
            else:
                holder = _holder(modules)
                _fully_shard()(holder, mesh=self.mesh, reshard_after_forward=False)
                unit = _as_unit(holder)
                self.held.append(unit)
            self.units.append(unit)

    def _resharding(self, unit: FSDPModule):  # type: ignore[no-untyped-def]
        def reshard(module: nn.Module, inputs: object, outputs: object) -> None:
            if not self.keep_gathered:
                unit.reshard()
        return reshard

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered, and kept so, for the body (a probe's forwards and
        backwards, which every replica runs alike); no gradient is reduced. Afterwards the
        gathered parameters and what they accumulated are dropped; the sharded ``.grad``
        of earlier steps is kept."""
        self._prepare_step()
        self.keep_gathered = True
        try:
            for unit in self.units:
                unit.set_reshard_after_backward(False)
            self._gather_all()
            yield
        finally:
            self.keep_gathered = False
            self._drop_gathered()

    def begin_forward_only(self) -> None:
        for unit in self.held:
            _fully_shard().state(unit)._lazy_init()  # a forward's
            unit.unshard()

    def begin_step(self) -> None:
        """Meet the replicas (bounded), then gather every unit before any compute: a replica
        that fails mid-step has then taken part in every all-gather of the step, so none
        waits for it (with ``reshard_after_forward`` the later gathers still may)."""
        self.agreement.start(meet=True)
        self._prepare_step()
        self._gather_all()

    def _prepare_step(self) -> None:
        for unit in self.units:
            unit.set_requires_gradient_sync(False)
            unit.set_reshard_after_backward(self.reshard_after_backward)
            unit.set_is_last_backward(False)

    def _gather_all(self) -> None:
        try:
            for unit in self.units:
                _fully_shard().state(unit)._lazy_init()  # a forward's
                unit.unshard()
        except RuntimeError as error:  # gloo's own: a replica's process ended
            raise _peer_error("gathering the stage's parameters", error) from error

    def reduce_gradients(self, parameters: Sequence[nn.Parameter]) -> None:
        self.agreement.succeeded()
        for unit in self.units:
            unit.set_requires_gradient_sync(True)
            unit.set_reshard_after_backward(True)
            unit.set_is_last_backward(True)
        try:
            _reduce_now(self.units)
        except RuntimeError as error:  # gloo's own: a replica's process ended
            raise _peer_error("reduce-scattering the gradients", error) from error

    def abandon_step(self) -> None:
        """Tell the replicas this step failed (if it has not agreed yet), then drop the
        gathered parameters and whatever gradients they accumulated."""
        self.agreement.failed()
        self._drop_gathered()

    def _drop_gathered(self) -> None:
        for unit in self.units:
            for group in _parameter_groups(unit):
                for fsdp_param in group.fsdp_params:
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
            unit.reshard()

    def after_forward_only(self) -> None:
        for unit in self.units:
            unit.reshard()

    @property
    def sharding(self) -> Sharding:
        return Sharding(self.mesh.size(), True, self.reshard_after_forward,
                        tuple(sum(p.numel() for p in unit.parameters())  # type: ignore[attr-defined]
                              for unit in self.units))

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """This rank's shard of a tensor of ``shape`` (FSDP2 cuts dim 0 as ``torch.chunk``)."""
        if not shape:
            return shape
        replicas, coordinate = self.mesh.size(), self.mesh.get_local_rank()
        per_rank = -(-shape[0] // replicas)
        start = min(shape[0], coordinate * per_rank)
        return (min(shape[0], start + per_rank) - start, *shape[1:])


def _peer_error(what: str, error: RuntimeError) -> PeerError:
    return PeerError(f"rank {dist.get_rank()}: {what} across this stage's data-parallel "
                     f"replicas failed, after every replica had agreed to it (a replica's "
                     f"process ended mid-collective?): {type(error).__name__}: {error}")


def sharing_units(layers: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """``layers`` grouped so that layers holding a common parameter are one group, in order.

    A module object that appears twice, or inside another layer, is kept once (the outer).
    """
    distinct: list[nn.Module] = []
    for layer in layers:
        if not any(layer is other or _contains(other, layer) for other in distinct):
            distinct = [other for other in distinct if not _contains(layer, other)] + [layer]
    owner: dict[int, int] = {}  # parameter id -> group index
    groups: list[list[nn.Module]] = []
    for layer in distinct:
        joined = {owner[id(p)] for p in layer.parameters() if id(p) in owner}
        target = min(joined) if joined else len(groups)
        if not joined:
            groups.append([])
        for other in sorted(joined - {target}, reverse=True):
            groups[target] += groups[other]
            groups[other] = []
        groups[target].append(layer)
        for module in groups[target]:
            for parameter in module.parameters():
                owner[id(parameter)] = target
    return [group for group in groups if group and any(True for _ in _params(group))]


def _params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    return [p for module in modules for p in module.parameters()]


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return outer is not inner and any(module is inner for module in outer.modules())


def _holder(modules: Sequence[nn.Module]) -> nn.Module:
    """One module above ``modules`` (layers sharing a parameter), for FSDP2 to shard as one.

    FSDP2 lets a unit of several modules be no root, and every unit here is one; so the
    holder is the unit. Its forward never runs, so no hook gathers it: the runner gathers
    it before each call (``unshard``) and ``_reduce_now`` frees it.
    """
    holder = nn.Module()
    for position, module in enumerate(modules):
        holder.add_module(str(position), module)
    return holder


def _fully_shard() -> Any:
    """FSDP2's ``fully_shard``, imported where replicas shard: it pulls in DTensor (and sympy),
    which a pipeline without FSDP need not load."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def _as_unit(module: nn.Module) -> FSDPModule:
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(module, FSDPModule)
    return module


def _parameter_groups(unit: FSDPModule) -> list:  # type: ignore[type-arg]
    state = _fully_shard().state(unit)
    return list(state._fsdp_param_groups)


def _reduce_now(units: Sequence[FSDPModule]) -> None:
    """Reduce-scatter every unit's accumulated gradients and free its gathered parameters."""
    for unit in units:
        state = _fully_shard().state(unit)
        for group in reversed(state._fsdp_param_groups):
            group.post_backward()
        state._root_post_backward_final_callback()
