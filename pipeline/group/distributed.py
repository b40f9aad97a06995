"""A Pipe's distributed options in one place: the process groups, the transport, materialising.

``Pipe(..., distributed=Distributed(group, data_group=...))`` says how a pipeline runs
across processes; ``Pipe(..., mesh=init_device_mesh(..., mesh_dim_names=("pp", "dp")))``
takes the groups from a device mesh (``Distributed.from_mesh(mesh, ...)`` for its options);
``Pipe(..., group=group)`` is ``Distributed(group)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from units.cut import TensorParallelPlan

from pipeline.transports import TRANSPORTS, TransportName


MESH_DIMENSIONS = ("pp", "dp", "ep", "tp")
DataParallelMode = Literal["replicate", "fsdp"]
DATA_PARALLEL: tuple[DataParallelMode, ...] = ("replicate", "fsdp")
TensorParallel = TensorParallelPlan  # "auto", {module name: style}, or fn(layer, tp_mesh)
ExpertParallel = str | Mapping[str, str]  # "auto" or {module name: "ep_dispatch_experts"}


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
        mesh: the device mesh the groups came from (``from_mesh``), else None.
        data_parallel: how the replicas of ``data_group`` share a stage: ``"replicate"``
            (each holds the whole stage; gradients all-reduced after each step) or
            ``"fsdp"`` (each local layer sharded over the replicas by FSDP2's
            ``fully_shard``: parameters all-gathered once per step and kept across the
            micro-batches, gradients reduce-scattered once per step after the last
            backward). Without a data group both mean no data parallelism.
        reshard_after_forward: with ``"fsdp"``, free the gathered parameters after each
            micro-batch's forward and gather them again for its backward: less memory,
            two all-gathers per layer and micro-batch instead of one per step.
        tensor_parallel: how each stage splits over the mesh's ``"tp"`` dimension (needs
            one), applied to the local units once they are materialised (before FSDP shards
            them): ``"auto"`` (the plan a Hugging Face config ships,
            ``base_model_tp_plan``), a dict of the model's module names (``*`` for a layer
            index) to ``"colwise"``, ``"rowwise"``, ``"packed_colwise"`` or
            ``"replicated_with_grad_allreduce"`` (``units.tp_plan``), or ``fn(layer,
            tp_mesh)`` called on each local unit (``parallelize_module`` with torch's
            styles; ``examples/gpt.py`` has one).
        expert_parallel: how each stage spreads its experts over the mesh's ``"ep"``
            dimension (needs one): ``"auto"`` (the plan a Hugging Face config ships,
            ``base_model_ep_plan``) or a dict of the model's module names to
            ``"ep_dispatch_experts"`` (``units.ep_plan``). The ``ep`` ranks take their
            own rows of the batch, as replicas do; each holds 1/ep of every experts
            module's experts, and tokens go to their experts' ranks and back by all-to-all.
        batch_group: with ``"ep"``, the ranks of this stage that take their own rows (its
            ``dp`` x ``ep`` coordinates), set by ``from_mesh``.
    """

    group: ProcessGroup
    data_group: ProcessGroup | None = None
    transport: TransportName = "auto"
    init_fn: Callable[[nn.Module], None] | None = None
    mesh: DeviceMesh | None = None
    data_parallel: DataParallelMode = "replicate"
    reshard_after_forward: bool = False
    tensor_parallel: TensorParallel | None = None
    expert_parallel: ExpertParallel | None = None
    batch_group: ProcessGroup | None = None

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, transport: TransportName = "auto",
                  init_fn: Callable[[nn.Module], None] | None = None,
                  data_parallel: DataParallelMode = "replicate",
                  reshard_after_forward: bool = False,
                  tensor_parallel: TensorParallel | None = None,
                  expert_parallel: ExpertParallel | None = None) -> Distributed:
        """The pipeline along the mesh's ``"pp"`` dimension (each coordinate of the others is
        its own pipeline, sending to the same coordinate of the next stage), data-parallel
        replicas along ``"dp"``, experts spread along ``"ep"``, tensor parallelism along
        ``"tp"``.

        Raises:
            TypeError: ``mesh`` is not a ``DeviceMesh``.
            ValueError: a mesh without a ``"pp"`` dimension, or with one of another name; a
                ``"tp"`` dimension larger than 1 without ``tensor_parallel``, or
                ``tensor_parallel`` without one; likewise ``"ep"`` and
                ``expert_parallel``; ``"ep"`` with ``"tp"`` or with ``data_parallel="fsdp"``
                (not supported yet).
        """
        _check_mesh(mesh)
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [name for name in names if name not in MESH_DIMENSIONS]
        if "pp" not in names or unknown:
            raise ValueError(f"mesh: expected dimensions named among {MESH_DIMENSIONS} with a "
                             f"'pp' one, got {names or 'unnamed dimensions'}")
        tp = mesh["tp"].size() if "tp" in names else 1
        if tp > 1 and tensor_parallel is None:
            raise ValueError(f"the mesh's 'tp' dimension is {tp}: pass tensor_parallel="
                             f"'auto', a dict of module names to styles, or fn(layer, "
                             f"tp_mesh) to say how each stage splits across it")
        if tensor_parallel is not None and "tp" not in names:
            raise ValueError(f"tensor_parallel= needs a mesh with a 'tp' dimension, got "
                             f"dimensions {names}")
        ep = mesh["ep"].size() if "ep" in names else 1
        if ep > 1 and expert_parallel is None:
            raise ValueError(f"the mesh's 'ep' dimension is {ep}: pass expert_parallel='auto' "
                             f"or a dict of module names to 'ep_dispatch_experts' to say which "
                             f"modules hold the experts spread across it")
        if expert_parallel is not None and "ep" not in names:
            raise ValueError(f"expert_parallel= needs a mesh with an 'ep' dimension, got "
                             f"dimensions {names}")
        if ep > 1 and tp > 1:
            raise ValueError(f"expert parallelism (ep={ep}) with tensor parallelism (tp={tp}) "
                             f"in one mesh is not supported yet: use one of them")
        if ep > 1 and data_parallel == "fsdp":
            raise ValueError("expert parallelism with data_parallel='fsdp' is not supported "
                             "yet: use data_parallel='replicate' beside an 'ep' dimension")
        data_group = mesh["dp"].get_group() if "dp" in names and mesh["dp"].size() > 1 else None
        batch_group = _batch_group(mesh) if ep > 1 else None
        return cls(mesh["pp"].get_group(), data_group, transport, init_fn, mesh, data_parallel,
                   reshard_after_forward, tensor_parallel,
                   expert_parallel, batch_group)

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The mesh's ``"tp"`` dimension where it has one larger than 1, else None."""
        if self.mesh is None or "tp" not in (self.mesh.mesh_dim_names or ()):
            return None
        return self.mesh["tp"] if self.mesh["tp"].size() > 1 else None

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The mesh's ``"ep"`` dimension where it has one larger than 1 and a plan, else None."""
        if self.mesh is None or self.expert_parallel is None \
                or "ep" not in (self.mesh.mesh_dim_names or ()):
            return None
        return self.mesh["ep"] if self.mesh["ep"].size() > 1 else None

    @property
    def holders(self) -> ProcessGroup:
        """Every rank that holds a part of the model: the pipeline's group, or with
        data-parallel replicas or tensor parallelism the default group."""
        if isinstance(self.data_group, ProcessGroup) or self.tp_mesh is not None \
                or self.ep_mesh is not None:
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
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(f"unknown data_parallel {self.data_parallel!r}; expected one of: "
                             f"{', '.join(DATA_PARALLEL)}")
        _check_plan(self.tensor_parallel)
        if self.expert_parallel is not None and not (
                self.expert_parallel == "auto" or isinstance(self.expert_parallel, Mapping)):
            raise ValueError(f"expert_parallel={self.expert_parallel!r:.80}: expected 'auto' or "
                             f"a dict of module names to 'ep_dispatch_experts'")
        if self.expert_parallel is not None and self.mesh is None:
            raise ValueError("expert_parallel= needs mesh=init_device_mesh(..., "
                             "mesh_dim_names=('pp', 'ep'))")
        if self.tensor_parallel is not None and self.mesh is None:
            raise ValueError("tensor_parallel= needs mesh=init_device_mesh(..., "
                             "mesh_dim_names=('pp', 'dp', 'tp'))")
        if self.reshard_after_forward and self.data_parallel != "fsdp":
            raise ValueError(f"reshard_after_forward=True applies to data_parallel='fsdp' only, "
                             f"got data_parallel={self.data_parallel!r}")


def layout_of(distributed: Distributed | None, mesh: DeviceMesh | None,
              group: ProcessGroup | None) -> Distributed | None:
    """The process layout one of ``distributed``, ``mesh`` or ``group`` says (None: one
    process).

    Raises:
        ValueError: more than one of them.
    """
    given = [name for name, value in (("distributed", distributed), ("mesh", mesh),
                                      ("group", group)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"pass one of distributed=, mesh= or group= (each says the whole "
                         f"process layout), got {', '.join(f'{name}=' for name in given)}")
    if mesh is not None:
        return Distributed.from_mesh(mesh)
    if group is not None:
        return Distributed(group)
    return distributed


def _batch_group(mesh: DeviceMesh) -> ProcessGroup:
    """The ranks of this rank's stage that take their own rows: its ``"dp"`` x ``"ep"``
    coordinates (the ``"ep"`` dimension's group where there is no ``"dp"``). Every rank
    makes every such group, in the same order."""
    names = list(mesh.mesh_dim_names or ())
    if "dp" not in names or mesh["dp"].size() == 1:
        return mesh["ep"].get_group()
    sharing = [names.index("dp"), names.index("ep")]
    others = [dim for dim in range(len(names)) if dim not in sharing]
    rows = mesh.mesh.permute(*others, *sharing).reshape(-1, mesh["dp"].size() * mesh["ep"].size())
    mine, _ = dist.new_subgroups_by_enumeration(  # type: ignore[no-untyped-call]
        [row.tolist() for row in rows])
    assert isinstance(mine, ProcessGroup)
    return mine


def _check_plan(plan: Any) -> None:
    """Raise ValueError for a tensor-parallel plan of none of its three forms."""
    if plan is None or callable(plan) or isinstance(plan, Mapping) or plan == "auto":
        return
    raise ValueError(f"tensor_parallel={plan!r:.80}: expected 'auto', a dict of module names "
                     f"to styles, or fn(layer, tp_mesh)")


def _check_mesh(mesh: Any) -> None:
    """Raise TypeError unless ``mesh`` is a torch ``DeviceMesh``, saying what was given."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"Distributed.from_mesh: expected a torch.distributed.device_mesh.DeviceMesh "
            f"(init_device_mesh(device, (pp, dp), mesh_dim_names=('pp', 'dp'))), got "
            f"{type(mesh).__name__}: {mesh!r:.80}")
