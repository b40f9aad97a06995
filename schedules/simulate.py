"""Replay a schedule with per-action costs and return the predicted Timeline."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from functools import reduce
from operator import add

from schedules._speed import OP_B, OP_F, OP_I, OP_W, gc_paused
from schedules.action import OP_CODES, OPS, Op, Schedule
from schedules.cost_values import checked_value
from schedules.costs import Comm, Costs, ResolvedCosts
from schedules.events import StageColumns
from schedules.flat import Flat, flatten
from schedules.simulate_pairs import replay_paired
from schedules.timeline import MemoryTrace, Timeline
from schedules.validate import feasible_runs

Cost = float | Sequence[float]


def simulate(
    schedule: Schedule,
    forward: Cost | None = None,
    backward: Cost | None = None,
    weight: Cost | None = None,
    comm: Comm | None = None,
    *,
    costs: Costs | None = None,
) -> Timeline:
    """Predict when every action runs: as soon as its stage is free and its inputs arrived.

    Either give ``costs``, the full model (per chunk, op, micro-batch and hop, with
    bytes and recomputation: see ``Costs``), or the keywords, which are shorthand
    for ``Costs.from_stages(forward, backward, weight, comm)``: whole-stage costs,
    a stage holding v chunks spending 1/v of them on each chunk's action.
    ``backward`` is the full backward ``B`` when ``weight`` is None, and then a
    split backward costs half of it for ``I`` and half for ``W``. When ``weight``
    is given, ``backward`` is the input-gradient ``I`` alone, ``W`` costs
    ``weight``, and ``B`` costs both. ``costs`` takes precedence: a keyword given
    with it would be ignored, so that raises ValueError instead.

    Args:
        schedule: the timetable to replay (validated first).
        forward: forward cost, one number or one per stage; None: 1.0.
        backward: backward cost (see above), one number or one per stage; None: 2.0.
        weight: weight-gradient cost, one number or one per stage, or None.
        comm: time of every cross-stage transfer (or a matrix or callable, see
            ``Costs.comm``); None: 0.0.
        costs: everything at once, instead of the keywords.

    Returns:
        The predicted ``Timeline``, with ``makespan_bound`` set to the physical
        lower bound: a stage cannot start before the first micro-batch has crossed
        the stages before it, so the makespan is at least that ramp plus the
        stage's own work, for the busiest such stage. When the costs give
        ``activation_bytes``, ``Timeline.memory`` holds each stage's bytes over
        time (see ``memory_traces``) and ``Timeline.peak_bytes`` their peaks.

    Raises:
        ValueError: a negative, NaN or infinite cost (named), a sequence of the
            wrong length, or keywords given together with ``costs``.
        ScheduleError: the schedule cannot run.
    """
    if costs is None:
        costs = _keyword_costs(schedule.stages, forward, backward, weight, comm)
    else:
        keywords = {"forward": forward, "backward": backward, "weight": weight, "comm": comm}
        given = [name for name, value in keywords.items() if value is not None]
        if given:
            raise ValueError(
                f"simulate: expected costs= or the keywords, got both (costs= and "
                f"{', '.join(given)}=); put them in the Costs instead"
            )
    table = costs.resolve(schedule)
    runs = feasible_runs(schedule)  # validates the schedule, once
    with gc_paused():
        per_stage, busy = _replay(schedule, table, runs)
        memory = () if table.activation_bytes is None else _memory_traces(
            [zip(stage.order.ops, stage.order.microbatches, stage.order.chunks, stage.starts,
                 stage.ends) for stage in per_stage], table)
    return Timeline.from_columns(
        per_stage,
        chunks_per_stage=tuple(len(chunks) for chunks in schedule.chunks_of_stage),
        name=f"{schedule.name} (simulated)",
        makespan_bound=_makespan_bound(schedule, table, busy),
        memory=memory,
    )


def _keyword_costs(
    stages: int,
    forward: Cost | None,
    backward: Cost | None,
    weight: Cost | None,
    comm: Comm | None,
) -> Costs:
    """``Costs.from_stages`` with the keywords' own names in the error messages."""
    checked = {}
    for name, value in (("forward", 1.0 if forward is None else forward),
                        ("backward", 2.0 if backward is None else backward),
                        ("weight", weight)):
        if value is None:
            continue
        checked[name] = number = checked_value(name, value)
        if isinstance(number, tuple) and len(number) != stages:
            raise ValueError(f"{name} cost: expected one number or {stages} per-stage numbers, "
                             f"got {len(number)}")
    hops = 0.0 if comm is None else comm
    return Costs.from_stages(comm=hops, **checked)


def _replay(
    schedule: Schedule, table: ResolvedCosts, runs: tuple[array[int], array[int]]
) -> tuple[list[StageColumns], list[float]]:
    """Each stage's actions with their starts and ends, and each stage's busy time.

    The hot loop, written for speed (10^6 actions): it walks the feasible order run by run
    (a stage's locals fetched once a run) on the schedule's arrays (``schedules.flat``), each
    action's cost and hops looked up beforehand (``_action_costs``); no call and no object
    per action but the start it stores.
    """
    flat = flatten(schedule)
    if any(schedule.pairs):
        return replay_paired(schedule, table, flat, _action_costs(schedule, table, flat))
    ends = [0.0] * flat.size  # by key
    positions = [0] * schedule.stages
    stage_free = [0.0] * schedule.stages
    starts = [[0.0] * len(order) for order in schedule.orders]
    costs = _action_costs(schedule, table, flat)
    columns = [(keys, first, second, durations, first_hops, second_hops, stage_starts)
               for keys, first, second, (durations, first_hops, second_hops), stage_starts
               in zip(flat.keys, flat.first, flat.second, costs, starts)]
    for stage, count in zip(*runs):
        keys, first, second, durations, first_hops, second_hops, stage_starts = columns[stage]
        position = positions[stage]
        stop = positions[stage] = position + count
        end = stage_free[stage]
        for at in range(position, stop):
            start = end
            needed = first[at]
            if needed >= 0:
                arrival = ends[needed] + first_hops[at]
                if arrival > start:
                    start = arrival
                needed = second[at]
                if needed >= 0:
                    arrival = ends[needed] + second_hops[at]
                    if arrival > start:
                        start = arrival
            end = start + durations[at]
            ends[keys[at]] = end
            stage_starts[at] = start
        stage_free[stage] = end
    per_stage = [StageColumns(order, array("d", stage_starts),
                              array("d", map(ends.__getitem__, keys)))
                 for order, stage_starts, keys in zip(schedule.orders, starts, flat.keys)]
    # Summed in stage order, left to right, as a running total would.
    busy = [reduce(add, durations, 0.0) for durations, _, _ in costs]
    return per_stage, busy


def _action_costs(schedule: Schedule, table: ResolvedCosts, flat: Flat
                  ) -> list[tuple[list[float], list[float], list[float]]]:
    """Per stage and action: its duration, the hop into its first input (a forward's, from
    chunk c-1) and into its second (a B's or I's gradient, from chunk c+1); 0 for none.

    When no cost varies with the micro-batch (no scale, no recomputation, hops of one size),
    each depends only on the action's chunk and op, ``key % (4 * chunks)``: three lookups
    by key at C speed instead of a Python step per action.
    """
    per_chunk = _durations(table)  # [chunk][op][microbatch]
    before = [row.get(chunk - 1) for chunk, row in enumerate(table.hops)]
    after = [row.get(chunk + 1) for chunk, row in enumerate(table.hops)]
    zero = (0.0,) * len(table.scale)
    tables = [[per_chunk[chunk][op] for op in OPS] for chunk in range(schedule.chunks)]
    # [chunk][code] -> per micro-batch: the duration, the first and the second hop
    first_hops = [[before[chunk] or zero if op is OP_F else zero for op in OPS]
                  for chunk in range(schedule.chunks)]
    second_hops = [[after[chunk] or zero if op is OP_B or op is OP_I else zero for op in OPS]
                   for chunk in range(schedule.chunks)]
    lookups = [[values for row in rows for values in row]
               for rows in (tables, first_hops, second_hops)]
    if all(values.count(values[0]) == len(values) for found in lookups for values in found):
        width = 4 * schedule.chunks
        constants = [[values[0] for values in found] for found in lookups]
        result = []
        for keys in flat.keys:
            residues = list(map(width.__rmod__, keys))
            result.append(tuple(list(map(constant.__getitem__, residues))
                                for constant in constants))
        return result  # type: ignore[return-value]
    return [tuple([found[chunk * 4 + code][microbatch]  # type: ignore[misc]
                   for code, microbatch, chunk in zip(order.ops, order.microbatches,
                                                      order.chunks)]
                  for found in lookups)
            for order in schedule.orders]


def _durations(table: ResolvedCosts) -> list[dict[Op, Sequence[float]]]:
    """``durations[chunk][op][microbatch]``, recomputation and scale included."""
    micro, scale, recomputed = len(table.scale), table.scale, table.recomputed
    uniform = all(factor == 1.0 for factor in scale) and not any(recomputed)
    result: list[dict[Op, Sequence[float]]] = []
    for times in table.compute:
        per_op: dict[Op, Sequence[float]] = {}
        for op, time in times.items():
            if uniform:
                per_op[op] = (time,) * micro
                continue
            again = times[Op.F] if op is Op.B or op is Op.I else 0.0  # the recomputed forward
            per_op[op] = tuple((time + again * redo) * factor
                               for factor, redo in zip(scale, recomputed))
        result.append(per_op)
    return result


def memory_traces(timeline: Timeline, table: ResolvedCosts) -> tuple[MemoryTrace, ...]:
    """Each stage's bytes over time for any timeline, simulated or measured.

    A stage holds its chunks' ``fixed_bytes`` throughout. A micro-batch's forward
    on a chunk adds, from its start, the chunk's ``activation_bytes`` (everything
    the forward saves, its input included), or only its ``input_bytes`` when that
    micro-batch is recomputed: then from the start of its backward ``B`` or ``I``
    it holds ``max(activation_bytes, input_bytes)``. All of it is released at the
    end of its ``B``; a split backward releases all but the chunk's ``weight_bytes``
    at the end of ``I``, and those at the end of ``W``. Bytes scale with the
    micro-batch; changes at one instant merge into one step.

    Args:
        timeline: the events to read.
        table: ``Costs.resolve(schedule)`` for the schedule the timeline ran.

    Returns:
        One ``MemoryTrace`` per stage, starting at the timeline's start.

    Raises:
        ValueError: ``table`` has no ``activation_bytes``.
    """
    if table.activation_bytes is None:
        raise ValueError("memory_traces: expected costs with activation_bytes, got None")
    if len(table.fixed_bytes) != timeline.stages:
        raise ValueError(f"memory_traces: expected costs resolved for {timeline.stages} stages "
                         f"(the timeline's), got {len(table.fixed_bytes)}")
    per_stage = [[(OP_CODES[event.action.op], event.action.microbatch, event.action.chunk,
                   event.start, event.end) for event in timeline.stage_events(stage)]
                 for stage in range(timeline.stages)]
    return _memory_traces(per_stage, table, timeline.start)


def _memory_traces(
    per_stage: Iterable[Iterable[tuple[int, int, int, float, float]]], table: ResolvedCosts,
    origin: float = 0.0,
) -> tuple[MemoryTrace, ...]:
    """``memory_traces`` on each stage's ``(op code, micro-batch, chunk, start, end)``."""
    saved, kept = table.activation_bytes or (), table.input_bytes
    for_weights = table.weight_bytes or saved
    traces = []
    for stage, events in enumerate(per_stage):
        held = table.fixed_bytes[stage]
        times, values = [origin], [held]
        for code, m, c, start, end in events:
            op = OPS[code]
            scale, recomputed = table.scale[m], table.recomputed[m]
            # A recomputed micro-batch keeps its input, then holds what the forward saves.
            whole = max(saved[c], kept[c]) if recomputed else saved[c]
            if op is OP_F:
                held += (kept[c] if recomputed else whole) * scale
                _step(times, values, start, held)
                continue
            if recomputed and op is not OP_W:  # B or I re-runs the forward first
                held += (whole - kept[c]) * scale
                _step(times, values, start, held)
            # A split backward has no B: I frees what W does not read, W the rest.
            left_for_w = for_weights[c]
            freed = whole if op is OP_B else whole - left_for_w if op is OP_I else left_for_w
            if freed or op is not OP_I:
                held -= freed * scale
                _step(times, values, end, held)
        traces.append(MemoryTrace(times=tuple(times), held=tuple(values)))
    return tuple(traces)


def _step(times: list[float], values: list[float], at: float, value: float) -> None:
    if times[-1] == at:
        values[-1] = value
    else:
        times.append(at)
        values.append(value)


def _makespan_bound(schedule: Schedule, table: ResolvedCosts, busy: list[float]) -> float:
    # Micro-batch 0 reaches chunk c after the forwards of chunks 0..c-1 and their hops.
    arrival = [0.0] * schedule.chunks
    for chunk in range(1, schedule.chunks):
        arrival[chunk] = (arrival[chunk - 1] + table.duration(Op.F, 0, chunk - 1)
                          + table.hop(chunk - 1, chunk, 0))
    return max(
        min(arrival[c] for c in schedule.chunks_of_stage[stage]) + busy[stage]
        for stage in range(schedule.stages)
    )


def simulate_measured(schedule: Schedule, measured: Timeline, comm: Comm = 0.0) -> Timeline:
    """Predict ``schedule`` with each chunk's mean measured duration per op.

    The figure to set beside a measured timeline: same schedule, same per-action
    costs, no communication (unless ``comm``) and no variation around the means.
    An op a chunk never ran is derived as ``Costs`` says (``B = I + W``, ...);
    a chunk with no backward at all gets 0.

    Args:
        schedule: the schedule that was run.
        measured: its measured Timeline (``Pipe.timeline``).
        comm: hop time to add to every cross-stage dependency (see ``Costs.comm``),
            in the timeline's unit.

    Returns:
        The predicted Timeline.

    Raises:
        ValueError: ``measured`` has another stage count than ``schedule``, or
            events of a chunk that ``schedule`` does not have.
    """
    if measured.stages != schedule.stages:
        raise ValueError(
            f"simulate_measured: expected a timeline of {schedule.stages} stages "
            f"(the schedule's), got {measured.stages}"
        )
    totals: dict[tuple[int, Op], list[float]] = {}
    for event in measured.events:
        chunk = event.action.chunk
        if not 0 <= chunk < schedule.chunks:
            raise ValueError(
                f"simulate_measured: expected chunks 0..{schedule.chunks - 1} (the schedule's), "
                f"got an event of chunk {chunk}: {event.action}"
            )
        total = totals.setdefault((chunk, event.action.op), [0.0, 0.0])
        total[0] += event.end - event.start
        total[1] += 1

    means = [_op_means({op: totals.get((chunk, op)) for op in Op})
             for chunk in range(schedule.chunks)]
    costs = Costs(**{name: tuple(chunk[index] for chunk in means)  # type: ignore[arg-type]
                     for index, name in enumerate(("forward", "backward", "input_grad",
                                                   "weight_grad"))}, comm=comm)
    return simulate(schedule, costs=costs)


def _op_means(totals: dict[Op, list[float] | None]) -> tuple[float, float, float, float]:
    """One chunk's mean F, B, I, W, a missing op derived as ``Costs`` does (0 if underived)."""
    mean = {op: None if total is None else total[0] / total[1] for op, total in totals.items()}
    b, i, w = mean[Op.B], mean[Op.I], mean[Op.W]
    if b is None:
        b = (i or 0.0) + (w or 0.0)
    if i is None:
        i = max(b - w, 0.0) if w is not None else b / 2
    if w is None:
        w = max(b - i, 0.0)
    return (mean[Op.F] or 0.0, b, i, w)
