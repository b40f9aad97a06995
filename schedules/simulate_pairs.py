"""``simulate`` for a timetable with overlapped pairs: a pair starts once both its inputs are in, and each one's exchange hides under the other's computation.

A pair (``schedules.pairs``) of a forward F and a backward B on one stage runs as one
interval. Of each, ``exchange`` is the time it waits on expert all-to-alls (``Costs``);
the rest is computation. In turns (``pipeline.runtime.paired``) each one's exchange runs
while the other computes, so what is left exposed is what the other's computation could
not cover::

    pair = F_compute + B_compute + max(0, F_exchange - B_compute)
                                 + max(0, B_exchange - F_compute)

drawn as F's event first (its computation and its exposed exchange), then B's.

A pair needs both inputs before either starts, which the dependency order alone does not
say, so the replay here is its own: stages advance in turn as far as their next action
(or pair) has its inputs, until all are done, or none can move: then the pairs deadlock
the timetable, and the error names where each stage waits.
"""

from __future__ import annotations

from array import array

from schedules._speed import OP_F, OP_W
from schedules.action import OPS, Schedule, ScheduleError
from schedules.costs import ResolvedCosts
from schedules.events import StageColumns
from schedules.flat import Flat


def paired_order(schedule: Schedule, flat: Flat) -> list[tuple[int, int]]:
    """``(stage, span)`` steps in an order that runs every action after its inputs, a pair
    (``span`` 2) as one step: what the replay and the ``"ordered"`` comm plan walk.

    Raises:
        ScheduleError: the pairs make the timetable deadlock.
    """
    stages = schedule.stages
    done = bytearray(flat.size)
    positions = [0] * stages
    pairs = [frozenset(stage_pairs) for stage_pairs in schedule.pairs]
    steps: list[tuple[int, int]] = []
    moved = True
    while moved:
        moved = False
        for stage in range(stages):
            keys, first, second = flat.keys[stage], flat.first[stage], flat.second[stage]
            at = positions[stage]
            while at < len(keys):
                span = 2 if at in pairs[stage] else 1
                if any(needed >= 0 and not done[needed] for index in range(at, at + span)
                       for needed in (first[index], second[index])):
                    break
                for index in range(at, at + span):
                    done[keys[index]] = 1
                steps.append((stage, span))
                at += span
                moved = True
            positions[stage] = at
    stuck = [(stage, schedule.order[stage][at]) for stage, at in enumerate(positions)
             if at < len(schedule.orders[stage])]
    if stuck:
        waits = ", ".join(f"stage {stage} at {action}" for stage, action in stuck)
        raise ScheduleError(f"the overlapped pairs deadlock the timetable: a pair starts only "
                            f"once both its inputs are in, and {waits} wait for each other")
    return steps


def replay_paired(schedule: Schedule, table: ResolvedCosts, flat: Flat,
                  costs: list[tuple[list[float], list[float], list[float]]]
                  ) -> tuple[list[StageColumns], list[float]]:
    """Each stage's actions with starts and ends, and each stage's busy time (``_replay``'s
    result) for a schedule with pairs; ``costs`` per stage and action: duration, hops in.

    Raises:
        ScheduleError: the pairs make the timetable deadlock.
    """
    stages = schedule.stages
    ends = [0.0] * flat.size
    starts = [[0.0] * len(order) for order in schedule.orders]
    finished = [[0.0] * len(order) for order in schedule.orders]
    exchanges = [exchange_times(schedule, table, stage) for stage in range(stages)]
    positions, free, busy = [0] * stages, [0.0] * stages, [0.0] * stages
    for stage, span in paired_order(schedule, flat):
        keys, first, second = flat.keys[stage], flat.first[stage], flat.second[stage]
        durations, first_hops, second_hops = costs[stage]
        at = positions[stage]
        start = free[stage]
        for index in range(at, at + span):
            if first[index] >= 0:
                start = max(start, ends[first[index]] + first_hops[index])
            if second[index] >= 0:
                start = max(start, ends[second[index]] + second_hops[index])
        if span == 1:
            end = start + durations[at]
            starts[stage][at], finished[stage][at] = start, end
            busy[stage] += durations[at]
        else:
            forward_end, end = _pair_times(start, durations[at], durations[at + 1],
                                           exchanges[stage][at], exchanges[stage][at + 1])
            starts[stage][at], finished[stage][at] = start, forward_end
            starts[stage][at + 1], finished[stage][at + 1] = forward_end, end
            busy[stage] += end - start
        for index in range(at, at + span):
            ends[keys[index]] = finished[stage][index]
        free[stage] = end
        positions[stage] = at + span
    per_stage = [StageColumns(order, array("d", stage_starts), array("d", stage_ends))
                 for order, stage_starts, stage_ends in zip(schedule.orders, starts, finished)]
    return per_stage, busy


def _pair_times(start: float, forward: float, backward: float, forward_exchange: float,
                backward_exchange: float) -> tuple[float, float]:
    """When a pair's forward ends (its event) and when the pair ends."""
    forward_exchange, backward_exchange = min(forward_exchange, forward), \
        min(backward_exchange, backward)
    forward_compute, backward_compute = forward - forward_exchange, backward - backward_exchange
    forward_end = start + forward_compute + max(0.0, forward_exchange - backward_compute)
    return forward_end, forward_end + backward_compute + max(0.0, backward_exchange
                                                              - forward_compute)


def exchange_times(schedule: Schedule, table: ResolvedCosts, stage: int) -> list[float]:
    """Per action of ``stage``: its exchange time (a forward's, or a backward's, which also
    waits on its recomputed forward's; a W's is 0)."""
    if not table.exchange:
        return [0.0] * len(schedule.orders[stage])
    order = schedule.orders[stage]
    times = []
    for code, microbatch, chunk in zip(order.ops, order.microbatches, order.chunks):
        op = OPS[code]
        time = 0.0 if op is OP_W else table.exchange[chunk]
        if op is not OP_F and op is not OP_W and table.recomputed[microbatch]:
            time += table.exchange[chunk]
        times.append(time * table.scale[microbatch])
    return times
