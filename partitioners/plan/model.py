"""plan_for_model: profile a model at each micro-batch size the search needs, then plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from split_backward import SplitMode
from units import Cut

from partitioners.cut.memory import DataParallelism
from partitioners.plan.expert_parallel import ExpertParallelism, spread_costs
from partitioners.plan.tensor_parallel import TensorParallelism, split_costs
from partitioners.plan.search import CHECKPOINTS, Plan, plan
from partitioners.plan.costs import Hop


def plan_for_model(
    model: Any,
    sample: Any,
    target: Any = None,
    loss_fn: Any = None,
    *,
    stages: int,
    batch: int | None = None,
    memory_limit: float | None = None,
    hop: Hop | None = None,
    devices: Sequence[Any] | None = None,
    microbatch_counts: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    checkpoints: Sequence[str] = CHECKPOINTS,
    optimizer_factor: float = 0.0,
    action_overhead: float = 0.0,
    warmup: int = 1,
    repeat: int = 3,
    prune: bool = True,
    data_parallel: DataParallelism | None = None,
    split_backward: SplitMode = "auto",
    tensor_parallel: TensorParallelism | None = None,
    expert_parallel: ExpertParallelism | None = None,
) -> Plan:
    """Profile ``model`` at each micro-batch size the search needs, then ``plan``.

    The entry point for ``Pipe(schedule="auto", chunks="auto")``: each size is
    profiled once (``partitioners.profile`` with ``microbatch_size=rows``, the
    loss included when ``loss_fn`` and ``target`` are given) on the first of
    ``devices`` (the stages are assumed alike), and the costs go to ``plan``.

    Args:
        model: the ``units.Cut`` to run (``partitioners.measure.model_cut.cut_of``), or
            an ``nn.Sequential``.
        sample: one step's input batch (a tensor or tuple of tensors, rows on dim 0).
        target: the loss target for that batch, or None.
        loss_fn: ``loss_fn(output, target)``, or None.
        stages: pipeline stages P.
        batch: rows per step; None: the sample's rows.
        memory_limit, hop, microbatch_counts, schedules, checkpoints,
            optimizer_factor, action_overhead, data_parallel: as for ``plan``.
        devices: the stages' devices; profiling runs on the first (None: cpu).
        warmup, repeat: as for ``profile``.
        prune: as for ``plan`` (False: every candidate simulated, e.g. to draw them all).
        split_backward: how a zero-bubble schedule splits a backward, as
            ``Pipe(split_backward=...)``: the I and W that are priced are the ones it runs.
        tensor_parallel: how each stage's tp ranks split its units
            (``plan.tensor_parallel``): each unit's measured work and bytes scaled to one
            rank's share, its all-reduces added. None: no tensor parallelism.
        expert_parallel: how each stage's ep ranks share its experts
            (``plan.expert_parallel``): each unit's parameter bytes scaled to one rank's
            share of its experts, its all-to-alls added. None: no expert parallelism.

    Returns:
        The Plan; ``plan.pipe_options()`` are ``Pipe``'s keyword arguments for it.

    Raises:
        ValueError: as ``plan`` and ``profile`` do, or a batch larger than the sample.
        RuntimeError: a layer or the loss failed while profiling.
    """
    from partitioners.measure.microbatch import _rows
    from partitioners.measure.profile import profile

    rows = _rows(sample, "sample")
    if rows is None:
        raise ValueError("plan_for_model: expected a sample with a batch dimension (dim 0)")
    if batch is None:
        batch = rows
    if isinstance(batch, int) and batch > rows:
        raise ValueError(f"plan_for_model: batch={batch} rows, but the sample has {rows}; "
                         f"expected a sample of at least the batch's rows")
    device = "cpu" if not devices else devices[0]
    layers = model.units if isinstance(model, Cut) else model

    def measured(size: int) -> Any:
        costs: Any = profile(layers, sample, device=device, warmup=warmup, repeat=repeat,
                             progress=False, microbatch_size=size, loss_fn=loss_fn,
                             target=target, split_backward=split_backward)
        costs = costs if tensor_parallel is None else split_costs(costs, tensor_parallel)
        return costs if expert_parallel is None else spread_costs(costs, expert_parallel)

    found = plan(measured, stages, batch, memory_limit, hop, microbatch_counts, schedules,
                 checkpoints, optimizer_factor=optimizer_factor,
                 action_overhead=action_overhead, prune=prune, data_parallel=data_parallel)
    return replace(found, split_backward=split_backward)
