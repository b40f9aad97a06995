"""What tensor parallelism does to a plan's units: a share of their work, and Megatron's all-reduces.

The planner profiles each unit whole, in one process. With each stage split over ``size``
tensor-parallel ranks (a mesh's ``"tp"`` dimension), a unit whose parameters are split
in a share ``split`` (its split Linears' bytes over all of its parameters') runs
``1 - split + split / size`` of its measured work and holds that share of its parameter and
saved bytes: a transformer block's products, and its attention over a rank's heads, split;
its norms and residual adds do not. Each of its row-split products costs one all-reduce
of the unit's output in the forward (Megatron's *g*) and one in the backward (*f*, before
the column-split products that feed it), each a ring over ``size`` hops: a
reduce-scatter then an all-gather (``replicas.ring_seconds`` twice). The I of a split
backward pays the backward's; W pays none (a split Linear's weight gradient is a local
product).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from partitioners.measure.cost import LayerCost, Profile
from partitioners.plan.replicas import ring_seconds
from schedules import Link


@dataclass(frozen=True)
class TensorParallelism:
    """How each stage's tensor-parallel ranks split its units.

    Attributes:
        size: ranks per stage (the mesh's ``"tp"``); 1: no tensor parallelism.
        split: per unit, the share of its parameter bytes in split modules (0 to 1).
        reductions: per unit, its row-split products: all-reduces forward, and as many
            backward.
        link: the hop between two tp ranks (a ring of ``size`` such hops).

    Raises:
        ValueError: ``size`` below 1, a share outside [0, 1], a negative count, or
            ``split`` and ``reductions`` of different lengths.
    """

    size: int
    split: tuple[float, ...]
    reductions: tuple[int, ...]
    link: Link

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"TensorParallelism.size: expected an int >= 1, got {self.size!r}")
        if len(self.split) != len(self.reductions):
            raise ValueError(f"TensorParallelism: {len(self.split)} split shares for "
                             f"{len(self.reductions)} units' reductions")
        if any(not 0.0 <= share <= 1.0 for share in self.split) or \
                any(count < 0 for count in self.reductions):
            raise ValueError(f"TensorParallelism: expected shares in [0, 1] and counts >= 0, "
                             f"got {self.split} and {self.reductions}")

    def all_reduce_seconds(self, nbytes: float) -> float:
        """One ring all-reduce of ``nbytes`` over the tp ranks."""
        return 2 * ring_seconds(nbytes, self.size, self.link)


def split_costs(costs: Sequence[LayerCost], tensor_parallel: TensorParallelism
                ) -> list[LayerCost] | Profile:
    """``costs`` (one unit each, measured whole) as one tp rank runs them.

    Raises:
        ValueError: costs for another number of units than ``tensor_parallel`` describes.
    """
    if len(costs) != len(tensor_parallel.split):
        raise ValueError(f"tensor parallelism describes {len(tensor_parallel.split)} units, "
                         f"the profile has {len(costs)}")
    size = tensor_parallel.size
    found = []
    for cost, split, reductions in zip(costs, tensor_parallel.split, tensor_parallel.reductions):
        share = 1.0 - split + split / size
        reduce = reductions * tensor_parallel.all_reduce_seconds(cost.activation_bytes)
        found.append(replace(
            cost, forward=cost.forward * share + reduce,
            backward=cost.backward * share + reduce,
            backward_input=cost.backward_input * share + reduce if cost.backward_input else 0.0,
            backward_weight=cost.backward_weight * share,
            param_bytes=round(cost.param_bytes * share),
            saved_bytes=round(cost.saved_bytes * share),
            shared_input_bytes=min(cost.shared_input_bytes, round(cost.saved_bytes * share)),
            weight_bytes=None if cost.weight_bytes is None else round(cost.weight_bytes * share)))
    if isinstance(costs, Profile):
        return Profile(found, costs.loss, costs.microbatch_size, costs.device)
    return found
