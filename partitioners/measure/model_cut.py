"""The one place a model becomes a ``units.Cut``: a Sequential as it is, anything else traced.

``Pipe`` and ``pipe-balance`` both call ``cut_of``, so that what the command profiles and
prices is what the Pipe runs: a traced unit's Linear products are pointed at the functions
that defer their weight gradients inside a split backward (``split_backward.traced_linears``;
outside one they are the same ATen calls), for the profile's I and W as for the runtime's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from split_backward.traced_linears import defer_traced_linears
from units import Cut, cut_model
from units.ep_plan import resolve_expert_plan


def cut_of(model: nn.Module, sample: Any = None, units: Sequence[str] | None = None,
           expert_plan: Any = None) -> Cut:
    """``model`` as the pipeline runs it.

    Args:
        model: an ``nn.Sequential`` (its layers are the units) or any other module, traced
            with ``sample`` and cut into units (``units.cut_model``).
        sample: a batch as the model takes it (a list of micro-batches: the first);
            needed for a model that is not a Sequential.
        units: for a traced model, the module names where units begin.
        expert_plan: an expert-parallel plan (``units.ep_plan``): its experts modules are
            traced as one call each, which expert parallelism makes token exchanges.

    Raises:
        ValueError: ``units=`` or ``expert_plan`` for an nn.Sequential, a plan that marks
            no module, or a model that cannot be traced (``units.TraceError`` is a
            ValueError).
        TypeError: ``units`` is not a list of module names.
    """
    if isinstance(model, nn.Sequential):
        if expert_plan is not None:
            raise ValueError(
                "expert parallelism spreads the experts modules of a traced model: give the "
                "Pipe the model as it is written, not an nn.Sequential of its blocks")
        if units is not None:
            raise ValueError(
                f"units= sets where a traced model's units begin; an nn.Sequential's layers "
                f"are its units (got units={units!r}): leave it out, or group layers into "
                f"nested Sequentials"
            )
        return Cut.of_sequential(model)
    if isinstance(units, str) or (units is not None and not all(
            isinstance(name, str) for name in units)):
        raise TypeError(f"units must be a list of module names, got {units!r}")
    experts = resolve_expert_plan(model, expert_plan) if expert_plan is not None else []
    cut = cut_model(model, sample[0] if isinstance(sample, list) else sample, units, experts)
    cut.rewrite(defer_traced_linears)
    return cut
