"""Check a schedule: every action present once, on its stage, and no deadlock.

Its comm plan is checked by ``schedules.comm_validate``.
"""

from __future__ import annotations

from array import array
from itertools import chain, repeat
from typing import TYPE_CHECKING

from schedules._speed import OP_B, OP_F, OP_I, OP_W, gc_paused
from schedules.action import CODE_F, Action, Op, Schedule, ScheduleError, format_order
from schedules.dependencies import dependencies, stage_of
from schedules.flat import flatten, replay_stages

if TYPE_CHECKING:
    import networkx as nx

_VALIDATED = "_validated"


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` can run to completion.

    Checks, in order: every action refers to an existing micro-batch and chunk and
    sits on the stage holding that chunk; no action appears twice; every
    (micro-batch, chunk) has one forward and one backward (``B``, or ``I`` and
    ``W``), or, in a ``forward_only`` schedule, one forward and nothing else; and
    the dependencies plus each stage's order form an acyclic graph. Linear in the
    actions, on the schedule's arrays (``schedules.flat``); Actions are made only to
    describe a fault.

    Raises:
        ScheduleError: naming the stage and action at fault and showing the
            timetable around it; for a deadlock, the cycle of waiting actions.
    """
    if _VALIDATED in schedule.__dict__:
        return
    with gc_paused():
        if not _actions_are_sound(schedule):
            check_actions(schedule)  # finds the fault and raises, naming it
        runs = replay_stages(schedule, flatten(schedule))
    if sum(runs[1]) != sum(len(actions) for actions in schedule.order):
        raise_deadlock(schedule)
    # A schedule is immutable: once valid, always valid. Cached like a cached_property,
    # with the feasible order found (as runs of each stage's actions), which simulate replays.
    schedule.__dict__[_VALIDATED] = runs


def feasible_runs(schedule: Schedule) -> tuple[array[int], array[int]]:
    """A feasible order as runs, ``(stages, counts)``: ``counts[n]`` actions of stage
    ``stages[n]`` (see ``replay_stages``), validating the schedule (once) on the way."""
    validate(schedule)
    return schedule.__dict__[_VALIDATED]  # type: ignore[no-any-return]


def feasible_order(schedule: Schedule) -> array[int]:
    """The stage of each action in ``replay`` order, validating the schedule (once) on the way."""
    stages, counts = feasible_runs(schedule)
    return array("l", chain.from_iterable(map(repeat, stages, counts)))


def _actions_are_sound(schedule: Schedule) -> bool:
    """Whether ``check_actions`` would pass, found on the arrays in C-speed steps."""
    microbatches, chunks = schedule.microbatches, schedule.chunks
    present = bytearray(4 * microbatches * chunks)
    for stage, order in enumerate(schedule.orders):
        if not order:
            continue
        if schedule.forward_only and order.ops.count(CODE_F) != len(order):
            return False
        if max(order.microbatches) >= microbatches or max(order.chunks) >= chunks:
            return False
        if any(schedule.placement[chunk] != stage for chunk in set(order.chunks)):
            return False
    flat = flatten(schedule)
    for keys in flat.keys:
        for key in keys:
            if present[key]:
                return False  # a duplicate
            present[key] = 1
    forwards, fulls, inputs, weights = (present[code::4] for code in range(4))
    if forwards.count(0):
        return False
    if schedule.forward_only:
        return True
    full, split = int.from_bytes(fulls, "little"), int.from_bytes(inputs, "little")
    every = int.from_bytes(b"\x01" * len(forwards), "little")
    return inputs == weights and not full & split and full | split == every


def check_actions(schedule: Schedule) -> None:
    """The checks short of deadlock: placement, duplicates and completeness (on Actions: the
    slow path that names a fault ``validate`` found)."""
    if _VALIDATED in schedule.__dict__:
        return
    _check_placement(schedule)
    _check_completeness(schedule, _check_duplicates(schedule))


def _fail(
    schedule: Schedule, message: str, stage: int, index: int, mark: bool = True
) -> ScheduleError:
    window = format_order(schedule, around=(stage, index), mark=mark)
    return ScheduleError(f"{schedule.name} schedule: {message}\n{window}")


def _check_placement(schedule: Schedule) -> None:
    for stage, actions in enumerate(schedule.order):
        for index, action in enumerate(actions):
            if schedule.forward_only and action.op is not OP_F:
                raise _fail(
                    schedule,
                    f"stage {stage} runs {action}, but a forward-only schedule runs "
                    f"only forwards (F)",
                    stage,
                    index,
                )
            if not (0 <= action.microbatch < schedule.microbatches
                    and 0 <= action.chunk < schedule.chunks):
                raise _fail(schedule, _out_of_range(schedule, stage, action), stage, index)
            owner = schedule.placement[action.chunk]
            if owner != stage:
                raise _fail(
                    schedule,
                    f"{action} is on stage {stage}, but chunk {action.chunk} "
                    f"lives on stage {owner}",
                    stage,
                    index,
                )


def _out_of_range(schedule: Schedule, stage: int, action: Action) -> str:
    """The error for an action whose micro-batch or chunk does not exist."""
    if 0 <= action.microbatch < schedule.microbatches:
        what, count = "chunks", schedule.chunks
    else:
        what, count = "micro-batches", schedule.microbatches
    return f"stage {stage} runs {action}, but {what} are 0..{count - 1}"


def _check_duplicates(schedule: Schedule) -> set[tuple[Op, int, int]]:
    seen: dict[tuple[Op, int, int], tuple[int, int]] = {}
    for stage, actions in enumerate(schedule.order):
        for index, action in enumerate(actions):
            key = (action.op, action.microbatch, action.chunk)
            if key in seen:
                first = seen[key]
                raise _fail(
                    schedule,
                    f"{action} is duplicated: stage {first[0]} position {first[1]} "
                    f"and stage {stage} position {index}",
                    stage,
                    index,
                )
            seen[key] = (stage, index)
    return set(seen)


def _check_completeness(schedule: Schedule, present: set[tuple[Op, int, int]]) -> None:
    for chunk in range(schedule.chunks):
        for microbatch in range(schedule.microbatches):
            missing = _missing_op(schedule, present, microbatch, chunk)
            if missing is not None:
                stage = schedule.placement[chunk]
                # Show where it belongs: after the same op of the previous micro-batch.
                actions = schedule.order[stage]
                index = 0
                if microbatch > 0:
                    previous = Action(missing, microbatch - 1, chunk)
                    index = actions.index(previous) + 1 if previous in actions else 0
                raise _fail(
                    schedule,
                    f"{Action(missing, microbatch, chunk)} is missing from stage {stage}",
                    stage,
                    index,
                    mark=False,
                )


def _missing_op(
    schedule: Schedule, present: set[tuple[Op, int, int]], microbatch: int, chunk: int
) -> Op | None:
    has_i = (OP_I, microbatch, chunk) in present
    has_w = (OP_W, microbatch, chunk) in present
    if (OP_B, microbatch, chunk) in present and (has_i or has_w):
        stage = schedule.placement[chunk]
        raise _fail(
            schedule,
            f"micro-batch {microbatch} of chunk {chunk} has both a full backward B "
            f"and a split one (I/W)",
            stage,
            0,
        )
    if (OP_F, microbatch, chunk) not in present:
        return OP_F
    if schedule.forward_only:
        return None
    if has_i != has_w:
        return OP_W if has_i else OP_I
    if not has_i and (OP_B, microbatch, chunk) not in present:
        return OP_B
    return None


def raise_deadlock(schedule: Schedule) -> None:
    """Raise the ScheduleError for a complete schedule that cannot finish, naming the cycle."""
    cycle = _find_cycle(schedule)
    stage = stage_of(schedule, cycle[0])
    index = schedule.order[stage].index(cycle[0])
    path = " -> ".join(f"{action} (stage {stage_of(schedule, action)})" for action in cycle)
    raise _fail(
        schedule,
        f"deadlock: each action waits for the next: {path} -> {cycle[0]}",
        stage,
        index,
    )


def dependency_graph(schedule: Schedule) -> nx.DiGraph:
    """The graph whose edges say "must finish before": data dependencies and stage order."""
    import networkx as nx  # only here, for a schedule that deadlocks: 0.17 s of every import

    graph = nx.DiGraph()
    for actions in schedule.order:
        graph.add_nodes_from(actions)
        graph.add_edges_from(zip(actions, actions[1:]))
        for action in actions:
            graph.add_edges_from((needed, action) for needed in dependencies(schedule, action))
    return graph


def _find_cycle(schedule: Schedule) -> list[Action]:
    import networkx as nx

    edges = nx.find_cycle(dependency_graph(schedule))
    # An edge u -> v means v waits for u; list the cycle as "u waits for ...".
    return [target for _, target in reversed(edges)]
