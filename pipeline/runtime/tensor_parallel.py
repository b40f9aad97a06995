"""Tensor parallelism inside a stage: the plan applied to this rank's units, DTensor outputs sent as shards.

``Distributed.from_mesh(mesh, tensor_parallel=plan)``: the cut applies ``plan`` to this
rank's units (``Cut.parallelize``): ``"auto"`` or a dict of the model's module names to
styles (a traced model is traced again at one rank's sizes, with Megatron's boundaries),
or ``fn(layer, tp_mesh)`` on each local unit (``parallelize_module`` with the user's
styles, say). Between stages only plain tensors
travel: a chunk whose last layer returns a DTensor (a ``ColwiseParallel`` with
``use_local_output=False``) sends each tensor-parallel rank's local shard, through the
differentiable ``to_local``, so the gradient coming back is that shard's. The next
stage's first layer reads the plain tensor as the layout its own style declares (a
``RowwiseParallel``'s ``input_layouts=Shard(-1)``, a ``PrepareModuleInput``), exactly as
torch's tensor-parallel styles read a local tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from units import Cut
from units.cut import TensorParallelPlan

from pipeline.compute.dtensors import is_dtensor


@dataclass(frozen=True)
class TensorSplit:
    """``plan`` over ``mesh`` (the ``tp`` dimension), for ``cut``'s units."""

    cut: Cut
    plan: TensorParallelPlan
    mesh: DeviceMesh
    timeout: float  # the Pipe's: how long a tp all-reduce waits for the other ranks

    def check(self) -> None:
        """Raise ValueError for a plan the cut cannot take (``Cut.check_split``)."""
        self.cut.check_split(self.plan, self.mesh.size())

    def apply(self, indices: Sequence[int]) -> Any:
        """Split units ``indices`` (this rank's); what counts the all-reduces, or None."""
        return self.cut.parallelize(self.plan, self.mesh, indices, self.timeout)


def send_shards(last_layers: Sequence[nn.Module]) -> None:
    """Make each layer (the last of a chunk whose outputs cross to another chunk) return
    the local shard of any DTensor it outputs."""
    for layer in last_layers:
        layer.register_forward_hook(_local_outputs)


def _local_outputs(module: nn.Module, inputs: Any, outputs: Any) -> Any:
    return pytree.tree_map(lambda leaf: leaf.to_local() if is_dtensor(leaf) else leaf,
                           outputs)
