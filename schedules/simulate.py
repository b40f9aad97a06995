"""Replay a schedule with per-action costs and return the predicted Timeline."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from schedules.action import Op, Schedule
from schedules.timeline import Event, Timeline
from schedules._speed import gc_paused
from schedules.validate import feasible_order

Cost = float | Sequence[float]


def simulate(
    schedule: Schedule,
    forward: Cost = 1.0,
    backward: Cost = 2.0,
    weight: Cost | None = None,
    comm: float = 0.0,
) -> Timeline:
    """Predict when every action runs: as soon as its stage is free and its inputs arrived.

    Costs are for a whole stage (one chunk per stage); a stage that holds v chunks
    spends 1/v of them on each chunk's action. ``backward`` is the full backward
    ``B`` when ``weight`` is None, and then a split backward costs half of it for
    ``I`` and half for ``W``. When ``weight`` is given, ``backward`` is the
    input-gradient ``I`` alone, ``W`` costs ``weight``, and ``B`` costs both.

    Args:
        schedule: the timetable to replay (validated first).
        forward: forward cost, one number or one per stage.
        backward: backward cost (see above), one number or one per stage.
        weight: weight-gradient cost, one number or one per stage, or None.
        comm: delay added to every dependency that crosses stages.

    Returns:
        The predicted ``Timeline``, with ``makespan_bound`` set to the physical
        lower bound: a stage cannot start before the first micro-batch has crossed
        the stages before it, so the makespan is at least that ramp plus the
        stage's own work, for the busiest such stage.

    Raises:
        ValueError: a negative cost or a per-stage list of the wrong length.
        ScheduleError: the schedule cannot run.
    """
    stages = schedule.stages
    forwards = _per_stage("forward", forward, stages)
    backwards = _per_stage("backward", backward, stages)
    weights = None if weight is None else _per_stage("weight", weight, stages)
    if not comm >= 0:  # also rejects NaN
        raise ValueError(f"comm must be >= 0, got {comm}")
    order = feasible_order(schedule)  # validates the schedule, once

    durations = _durations(schedule, forwards, backwards, weights)
    placement = schedule.placement
    ends: dict[tuple[Op, int, int], float] = {}
    stage_free = [0.0] * stages
    events = []
    with gc_paused():
        for stage, action, needed in order:
            start = stage_free[stage]
            for dependency in needed:
                arrival = ends[dependency] + (comm if placement[dependency[2]] != stage else 0.0)
                if arrival > start:
                    start = arrival
            end = start + durations[stage][action.op]
            ends[(action.op, action.microbatch, action.chunk)] = end
            stage_free[stage] = end
            events.append(Event(stage, action, start, end))

    busy = [sum(durations[s][a.op] for a in schedule.order[s]) for s in range(stages)]
    return Timeline(
        stages=stages,
        events=tuple(events),
        chunks_per_stage=tuple(len(chunks) for chunks in schedule.chunks_of_stage),
        name=f"{schedule.name} (simulated)",
        makespan_bound=_makespan_bound(schedule, durations, busy, comm),
    )


def _per_stage(name: str, cost: Cost, stages: int) -> tuple[float, ...]:
    if isinstance(cost, numbers.Real):  # numpy scalars too
        values = (float(cost),) * stages
    else:
        values = tuple(float(c) for c in cost)
        if len(values) != stages:
            raise ValueError(
                f"{name} cost: expected one number or {stages} per-stage numbers, "
                f"got {len(values)}"
            )
    negative = [v for v in values if not v >= 0]  # also rejects NaN
    if negative:
        raise ValueError(f"{name} cost must be >= 0, got {negative[0]}")
    return values


def _durations(
    schedule: Schedule,
    forwards: tuple[float, ...],
    backwards: tuple[float, ...],
    weights: tuple[float, ...] | None,
) -> list[dict[Op, float]]:
    table = []
    for stage, chunks in enumerate(schedule.chunks_of_stage):
        share = 1.0 / len(chunks)
        f, b = forwards[stage], backwards[stage]
        if weights is None:
            i = w = b / 2
        else:
            i, w = b, weights[stage]
        table.append({Op.F: f * share, Op.B: (i + w) * share, Op.I: i * share, Op.W: w * share})
    return table


def _makespan_bound(
    schedule: Schedule, durations: list[dict[Op, float]], busy: list[float], comm: float
) -> float:
    # Micro-batch 0 reaches chunk c after the forwards of chunks 0..c-1 and their hops.
    arrival = [0.0] * schedule.chunks
    for chunk in range(1, schedule.chunks):
        previous = schedule.placement[chunk - 1]
        hop = comm if previous != schedule.placement[chunk] else 0.0
        arrival[chunk] = arrival[chunk - 1] + durations[previous][Op.F] + hop
    return max(
        min(arrival[c] for c in schedule.chunks_of_stage[stage]) + busy[stage]
        for stage in range(schedule.stages)
    )


def simulate_measured(schedule: Schedule, measured: Timeline, comm: float = 0.0) -> Timeline:
    """Predict ``schedule`` with each stage's mean measured duration per op.

    The figure to set beside a measured timeline: same schedule, same per-action
    costs, no communication (unless ``comm``) and no variation around the means.

    Args:
        schedule: the schedule that was run.
        measured: its measured Timeline (``Pipe.timeline``).
        comm: delay to add to every cross-stage dependency, in the timeline's unit.
    """
    costs: dict[Op, list[float]] = {op: [] for op in Op}
    for stage in range(schedule.stages):
        events = measured.stage_events(stage)
        chunks_here = len(schedule.chunks_of_stage[stage])
        for op in Op:
            durations = [event.duration for event in events if event.action.op is op]
            mean = sum(durations) / len(durations) if durations else 0.0
            costs[op].append(mean * chunks_here)  # simulate takes whole-stage costs
    split = any(costs[Op.I])
    return simulate(
        schedule,
        forward=costs[Op.F],
        backward=costs[Op.I] if split else costs[Op.B],
        weight=costs[Op.W] if split else None,
        comm=comm,
    )
