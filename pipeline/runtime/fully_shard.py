"""FSDP2 shards of a stage: each replica holds 1/dp of every local layer, gathered once a step.

``FullyShard`` uses ``torch.distributed.fsdp.fully_shard``:

- The shard groups (what ``fully_shard`` wraps as one, gathered and reduced together):
  each local layer, except that layers holding one parameter (a tied weight, one block at
  several positions) form one group, since FSDP2 shards a parameter once; such a group is
  gathered when the step begins (no hook of its own can).
- Within a step a group's parameters are all-gathered when the step begins, once every
  replica has met (bounded by the timeout), and kept across the micro-batches
  (``reshard_after_forward=False``, the default), and every backward
  (I and W alike) accumulates into the gathered parameters without any reduction; after
  the stage's last backward one reduce-scatter per group averages the gradients over the
  replicas into the sharded ``.grad`` and frees the gathered parameters. So a step costs
  one all-gather and one reduce-scatter per group, whatever the micro-batch count.
- FSDP2's collectives wait for the process group's own timeout, not the Pipe's; so
  before the reduce-scatter the replicas agree, within the timeout, that every
  replica's step succeeded (``pipeline.group.agreement``; ``Replicate`` does the same
  before its all-reduces), and a replica whose step failed says so from its error path:
  every replica then raises, none reduces.
- With ``reshard_after_forward=True`` a forward hook frees the gathered parameters after
  each forward of the group (FSDP2 never reshards a root after its forward by itself, and
  every group here is a root); FSDP2 gathers them again for the backward and, unless the
  schedule splits backwards (a W may still read them), frees them after it. Gradients
  accumulate unsharded either way until the step's one reduce-scatter.

FSDP2 has no public call for "reduce now" outside its own backward hooks, which fire
per backward and before the W half of a split backward has accumulated anything; as
torch.distributed.pipelining does, ``_reduce_now`` calls each parameter group's
``post_backward`` and the root's final callback. Those, the lazy initialisation a
group's forward would run (every group is gathered before its first forward), and
dropping a failed step's gathered gradients are the places this module reaches into
FSDP2's internals (checked by the mesh tests on every torch this project pins).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipeline.errors import PeerError
from pipeline.group.agreement import ReplicaAgreement
from pipeline.runtime.replicas import Replicas, Sharding

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


class FullyShard(Replicas):
    """Each replica holds a 1/dp shard of every local layer (FSDP2), gathered per step."""

    def __init__(self, mesh: DeviceMesh, reshard_after_forward: bool,
                 split_backward: bool = False, timeout: float = 60.0) -> None:
        super().__init__(mesh.get_group(), timeout)
        self.mesh = mesh
        self.agreement = ReplicaAgreement(self.group, timeout, torch.device(mesh.device_type))
        self.reshard_after_forward = reshard_after_forward
        # After a whole backward the group's gathered parameters are done with until its
        # next forward; after an I, the W to come may still read them.
        self.reshard_after_backward = reshard_after_forward and not split_backward
        self.shard_groups: list[FSDPModule] = []
        self.held: list[FSDPModule] = []  # groups gathered by hand: layers sharing parameters
        self.keep_gathered = False  # set while a probe runs: no hook frees a group

    def shard(self, layers: Sequence[nn.Module]) -> None:
        for modules in shard_groups_of(layers):
            if len(modules) == 1:
                _fully_shard()(modules[0], mesh=self.mesh, reshard_after_forward=False)
                shard_group = _as_shard_group(modules[0])
                if self.reshard_after_forward:
                    modules[0].register_forward_hook(self._resharding(shard_group))
            else:
                holder = _holder(modules)
                _fully_shard()(holder, mesh=self.mesh, reshard_after_forward=False)
                shard_group = _as_shard_group(holder)
                self.held.append(shard_group)
            self.shard_groups.append(shard_group)

    def _resharding(self, shard_group: FSDPModule):  # type: ignore[no-untyped-def]
        def reshard(module: nn.Module, inputs: object, outputs: object) -> None:
            if not self.keep_gathered:
                shard_group.reshard()
        return reshard

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every shard group gathered, and kept so, for the body (a probe's forwards and
        backwards, which every replica runs alike); no gradient is reduced. Afterwards the
        gathered parameters and what they accumulated are dropped; the sharded ``.grad``
        of earlier steps is kept."""
        self._prepare_step()
        self.keep_gathered = True
        try:
            for shard_group in self.shard_groups:
                shard_group.set_reshard_after_backward(False)
            self._gather_all()
            yield
        finally:
            self.keep_gathered = False
            self._drop_gathered()

    def begin_forward_only(self) -> None:
        for shard_group in self.held:
            _fully_shard().state(shard_group)._lazy_init()  # a forward's
            shard_group.unshard()

    def begin_step(self) -> None:
        """Meet the replicas (bounded), then gather every shard group before any compute: a replica
        that fails mid-step has then taken part in every all-gather of the step, so none
        waits for it (with ``reshard_after_forward`` the later gathers still may)."""
        self.agreement.start(meet=True)
        self._prepare_step()
        self._gather_all()

    def _prepare_step(self) -> None:
        for shard_group in self.shard_groups:
            shard_group.set_requires_gradient_sync(False)
            shard_group.set_reshard_after_backward(self.reshard_after_backward)
            shard_group.set_is_last_backward(False)

    def _gather_all(self) -> None:
        try:
            for shard_group in self.shard_groups:
                _fully_shard().state(shard_group)._lazy_init()  # a forward's
                shard_group.unshard()
        except RuntimeError as error:  # gloo's own: a replica's process ended
            raise _peer_error("gathering the stage's parameters", error) from error

    def reduce_gradients(self, parameters: Sequence[nn.Parameter]) -> None:
        self.agreement.succeeded()
        for shard_group in self.shard_groups:
            shard_group.set_requires_gradient_sync(True)
            shard_group.set_reshard_after_backward(True)
            shard_group.set_is_last_backward(True)
        try:
            _reduce_now(self.shard_groups)
        except RuntimeError as error:  # gloo's own: a replica's process ended
            raise _peer_error("reduce-scattering the gradients", error) from error

    def abandon_step(self) -> None:
        """Tell the replicas this step failed (if it has not agreed yet), then drop the
        gathered parameters and whatever gradients they accumulated."""
        self.agreement.failed()
        self._drop_gathered()

    def _drop_gathered(self) -> None:
        for shard_group in self.shard_groups:
            for parameter_group in _parameter_groups(shard_group):
                for fsdp_param in parameter_group.fsdp_params:
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
            shard_group.reshard()

    def after_forward_only(self) -> None:
        for shard_group in self.shard_groups:
            shard_group.reshard()

    @property
    def sharding(self) -> Sharding:
        return Sharding(self.mesh.size(), True, self.reshard_after_forward,
                        tuple(sum(p.numel() for p in shard_group.parameters())  # type: ignore[attr-defined]
                              for shard_group in self.shard_groups))

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


def shard_groups_of(layers: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """``layers`` as shard groups: layers holding a common parameter are one group, in order.

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

    FSDP2 lets a group of several modules be no root, and every group here is one; so the
    holder is the shard group. Its forward never runs, so no hook gathers it: the runner gathers
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


def _as_shard_group(module: nn.Module) -> FSDPModule:
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(module, FSDPModule)
    return module


def _parameter_groups(shard_group: FSDPModule) -> list:  # type: ignore[type-arg]
    state = _fully_shard().state(shard_group)
    return list(state._fsdp_param_groups)


def _reduce_now(shard_groups: Sequence[FSDPModule]) -> None:
    """Reduce-scatter every shard group's accumulated gradients and free its gathered
    parameters."""
    for shard_group in shard_groups:
        state = _fully_shard().state(shard_group)
        for parameter_group in reversed(state._fsdp_param_groups):
            parameter_group.post_backward()
        state._root_post_backward_final_callback()
