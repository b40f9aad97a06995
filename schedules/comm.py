"""Communication as data: where every send and receive sits between a stage's actions.

A schedule fixes the order of compute; ``comm_plan`` adds, per stage, the
point-to-point operations that move activations and gradients between stages,
grouped into the batches a runtime posts together, and ``validate_comm`` proves
the result cannot stall. Every transport executes the same plan.

Why the plan is built, not left to the runtime
----------------------------------------------
The obvious runtime posts a receive just before the action that consumes it
and a send just after the action that produces it. gloo tolerates that: it
buffers small sends and matches by tag. NCCL does neither. It ignores tags,
matches the n-th send on a communicator from A to B with the n-th receive there
at B from A, and (in the worst case, which is the one to design for) a send does
not complete until its receive has been posted. Under those rules 1F1B deadlocks
at two stages: stage 0 sends F1 while stage 1 sends B0, and neither reaches the
receive the other waits on. Fusing each action's sends with the next action's
receives (Megatron's ``send_forward_recv_backward``) fixes 1F1B and ZB-H1, but
not interleaved 1F1B, ZB-H2 or ZB-V, where a stage's next receive is not from the
peer its last send went to. So the plan is derived here, for any schedule, and
checked under NCCL's rules rather than trusted.

The always-correct construction, and why it is not enough
---------------------------------------------------------
Take one global order of the actions that respects the dependencies (the
replay order) and let both ends of every transfer post it, one op per group,
right after the producer in that order (``strategy="ordered"``). Each stage's
plan is then the projection of one global sequence of events, so the first event
not yet done can always happen: both stages it involves have it next. It never
deadlocks, but it serialises: a receiver must take each message at the point the
global order chose, even when it could have been computing, and every message is
a separate synchronisation.

The default: a rendezvous simulation, then one group per gap
------------------------------------------------------------
``strategy="overlap"`` runs the schedule once, with ``simulate``'s default
costs, under NCCL's rule that a message moves only when both stages are between
actions (in a "gap"). A stage finishing an action holds its results as pending
sends; a message moves the moment its two stages are both in a gap; a stage
leaves its gap as soon as its next action's inputs have arrived. Two refinements:

- *Receives are posted as early as is safe*: a stage waiting in a gap takes any
  message addressed to it whose sender is also in a gap, even one for a later
  action, so the data has crossed before it is needed.
- *Sends are not held back needlessly*: a sender leaves its gap with a send still
  pending (it goes out at a later gap) unless the receiver needs it for its very
  next action and will reach its gap before the sender's next action would end;
  then the sender waits, which costs less than making the receiver wait.

Every message moved in a stage's gap then becomes one op of one group posted in
that gap, in the order they moved: a send and the next receive, with one peer or
two, fuse into one batch (Megatron's fused send-and-receive, generalised to any
peers), and a stage synchronises once per gap instead of once per message.

Why that cannot deadlock: the simulation is a global sequence of arrivals in
gaps, messages and departures. In the plan a group is posted no later than the
simulated arrival in its gap (induction over that sequence: every group a gap's
ops pair with was posted before the message moved, hence before the departure
from the previous gap), so every group completes. Each channel carries a pair's
messages in the order they moved, on both sides, so the n-th send and the n-th
receive are the same message. ``validate_comm`` checks both anyway, for every
plan, in time linear in its size.

Channels: activations (sent by forwards) go on channel 0, gradients (sent by
backwards) on channel 1, two communicators. Matching is per channel, so the two
directions never queue behind each other, and a runtime that posts the receives
of a later group early (gloo may) keeps each channel's order. The runtime posts the
``"overlap"`` plan; ``"naive"`` (one op per group on one channel, what a runtime
does left to itself) is kept so tests can show it fails; ``"paired"`` is the
Megatron fusion above.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from itertools import chain, compress, count, islice, repeat
from operator import add, ne
from typing import Literal, Union

from schedules._speed import gc_paused
from schedules.action import Action, Schedule, StageOrder
from schedules.comm_messages import Messages, Moves, find_messages
from schedules.comm_ops import CommOp, Group
from schedules.comm_pairs import around_pairs
from schedules.comm_rendezvous import Rendezvous, default_durations
from schedules.flat import flatten
from schedules.plan_steps import (ACTION_STEP, GROUP_STEP, RECEIVE, SEND, Fields,
                                  PlanSteps)
from schedules.simulate_pairs import paired_order
from schedules.validate import feasible_order, validate

Strategy = Literal["overlap", "ordered", "paired", "naive"]
STRATEGIES: tuple[str, ...] = ("overlap", "ordered", "paired", "naive")


Step = Union[Action, Group]


@dataclass(frozen=True)
class CommPlan:
    """A schedule with its communication: ``stages[s]`` is what stage s runs, in order.

    A runtime walks ``stages[s]``: it runs each ``Action`` and posts each ``Group``
    (one batch per channel) and waits for it before the next step.

    Attributes:
        schedule: the timetable whose compute order the plan keeps exactly.
        stages: per stage, a tuple of steps, each an ``Action`` or a ``Group`` (stored as
            ``PlanSteps``, arrays made into objects when read, whenever arrays can hold
            them: always for ``comm_plan``'s plans, whose arrays are made on a stage's
            first read, so that a rank pays for its own stage only).
        strategy: how it was built (see ``comm_plan``), for messages.
    """

    schedule: Schedule
    stages: tuple[tuple[Step, ...], ...]
    strategy: str = "custom"

    def __post_init__(self) -> None:
        # Arrays where they can hold the steps (always, for comm_plan's): see plan_steps.
        object.__setattr__(self, "stages", tuple(map(_arrays, self.stages)))
        if len(self.stages) != self.schedule.stages:
            raise ValueError(
                f"a comm plan needs one step list per stage: expected "
                f"{self.schedule.stages}, got {len(self.stages)}"
            )

    def groups(self, stage: int) -> tuple[Group, ...]:
        """The groups ``stage`` posts, in order."""
        return tuple(step for step in self.stages[stage] if isinstance(step, Group))

    def receives(self, stage: int) -> tuple[CommOp, ...]:
        """The receives ``stage`` posts, in order (what a runtime may pre-allocate)."""
        return tuple(op for group in self.groups(stage) for op in group.ops if op.kind == "recv")

    def sends(self, stage: int) -> tuple[CommOp, ...]:
        """The sends ``stage`` posts, in order."""
        return tuple(op for group in self.groups(stage) for op in group.ops if op.kind == "send")

    @cached_property
    def channels(self) -> tuple[int, ...]:
        """The channels used, sorted: one communicator each."""
        used: set[int] = set()
        for steps in self.stages:
            if isinstance(steps, PlanSteps):  # every op is in a group: read the column
                ends = steps.group_ends
                used.update(islice(steps.ops.channels, ends[-1] if ends else 0))
            else:
                used.update(op.channel for step in steps if isinstance(step, Group)
                            for op in step.ops)
        return tuple(sorted(used))

    def peers(self, stage: int) -> tuple[int, ...]:
        """The stages ``stage`` exchanges messages with, sorted."""
        return tuple(sorted({op.peer for group in self.groups(stage) for op in group.ops}))

    def __str__(self) -> str:
        return format_plan(self)


def _arrays(steps: Sequence[Step]) -> tuple[Step, ...]:
    """``steps`` as ``PlanSteps`` if arrays can hold them and there are any (a later one
    is not made to find out: ``_plan`` makes none for an empty stage), else as a tuple."""
    arrays = PlanSteps.of(steps)
    return tuple(steps) if arrays is None or (arrays.made and not arrays) else arrays


def format_plan(plan: CommPlan, around: Mapping[int, int] | None = None, width: int = 3) -> str:
    """The plan as text, one line per stage; ``around={stage: step}`` shows only those
    stages, ``width`` steps either side of the step, which is marked ``>>``.

    Args:
        plan: the plan to print.
        around: stages to show and the step to centre on and mark, or None for all.
        width: how many neighbouring steps to show either side.
    """
    lines = []
    for stage, steps in enumerate(plan.stages):
        texts = [str(step) for step in steps]
        if around is None:
            lines.append(f"stage {stage}: {' '.join(texts)}")
            continue
        if stage not in around:
            continue
        at = around[stage]
        if at < len(texts):
            texts[at] = ">>" + texts[at]
        start, stop = max(0, at - width), at + width + 1
        prefix = "... " if start else ""
        suffix = " ..." if stop < len(texts) else ""
        lines.append(f"stage {stage}: {prefix}{' '.join(texts[start:stop])}{suffix}")
    return "\n".join(lines)


def comm_plan(schedule: Schedule, strategy: Strategy = "overlap") -> CommPlan:
    """Derive the sends and receives of ``schedule``, grouped and placed between its actions.

    >>> from schedules import one_f_one_b
    >>> print(comm_plan(one_f_one_b(stages=2, microbatches=2)))
    stage 0: F0 [send F0 -> 1] F1 [send F1 -> 1, recv B0@c1 <- 1 ch1] B0 [recv B1@c1 <- 1 ch1] B1
    stage 1: [recv F0 <- 0] F0@c1 [recv F1 <- 0] B0@c1 [send B0@c1 -> 0 ch1] F1@c1 B1@c1 [send B1@c1 -> 0 ch1]

    Args:
        schedule: a valid timetable (training or forward-only).
        strategy: ``"overlap"`` (default; see the module docstring), ``"ordered"``
            (one global order, always correct, serialising), ``"paired"`` (each
            action's sends with the next action's receives, Megatron's fusion;
            deadlocks some schedules) or ``"naive"`` (one op per group just after
            its producer and before its consumer, one channel: what a runtime does
            left to itself; deadlocks under NCCL's rules).

    Returns:
        The CommPlan; ``validate_comm`` proves the ``"overlap"`` and ``"ordered"`` ones.

    Raises:
        ValueError: an unknown strategy.
        ScheduleError: the schedule itself cannot run.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of: {', '.join(STRATEGIES)}")
    validate(schedule)
    with gc_paused():
        messages = find_messages(schedule, flatten(schedule))
        if strategy == "overlap":
            stages = _overlap(schedule, messages)
        elif strategy == "ordered":
            stages = _ordered(schedule, messages)
        else:
            stages = _local(schedule, messages, paired=strategy == "paired")
    return CommPlan(schedule, tuple(stages), strategy)


def _plan(schedule: Schedule, stage: int, moves: Moves, messages: Messages,
          channel: int | None = None, together: bool = True) -> PlanSteps:
    """``stage``'s steps: before action ``i``, the ops posted in gap ``i`` (one group, or one
    group per op unless ``together``); after the last action, the last gap's. Made when
    first read (``PlanSteps.later``): a rank reads only its own stage's. Nothing is
    posted inside an overlapped pair (``comm_pairs``)."""
    moves = around_pairs(moves, schedule.pairs[stage], messages)
    make = partial(_steps, schedule.orders[stage], moves, messages, channel, together)
    return PlanSteps(*make()) if not moves.gaps and not schedule.orders[stage] \
        else PlanSteps.later(make)


def _steps(order: StageOrder, moves: Moves, messages: Messages, channel: int | None,
           together: bool) -> Fields:
    """The fields of the PlanSteps of ``_plan``, for a stage running ``order``."""
    gaps = moves.gaps.tolist()  # ints made once, not once per pass
    if together:  # one group per gap: a group ends where the (never decreasing) gap changes
        last = list(map(ne, gaps, chain(islice(gaps, 1, None), (-1,))))
        groups: Sequence[int] = list(compress(gaps, last))
        ends = array("q", compress(range(1, len(gaps) + 1), last))
    else:
        groups, ends = gaps, array("q", range(1, len(gaps) + 1))
    # Group n comes after the actions before its gap and the n groups before it.
    kinds = bytearray((ACTION_STEP,)) * (len(order) + len(groups))
    deque(map(kinds.__setitem__, map(add, groups, count()), repeat(GROUP_STEP)), 0)
    return bytes(kinds), order, ends, messages.op_arrays(moves, channel)


def _local(schedule: Schedule, messages: Messages, paired: bool) -> list[PlanSteps]:
    """``"naive"`` and ``"paired"``: each op placed by its own stage alone: a receive just
    before its consumer, a send just after its producer (``"paired"``: both in one group)."""
    plans = []
    for stage, order in enumerate(schedule.orders):
        gaps: dict[int, list[tuple[int, int]]] = {}
        sends, receives = messages.out[stage], messages.needs[stage]
        for index in range(len(order)):
            if sends[index] >= 0:
                gaps.setdefault(index + 1, []).append((sends[index], SEND))
            if receives[index] >= 0:
                gaps.setdefault(index, []).append((receives[index], RECEIVE))
        plans.append(_plan(schedule, stage, Moves.of(gaps), messages, None if paired else 0,
                           together=paired))
    return plans


def _ordered(schedule: Schedule, messages: Messages) -> list[PlanSteps]:
    """``"ordered"``: both ends post each message right after its producer in the replay order."""
    gaps: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(schedule.stages)]
    done = [0] * schedule.stages
    order: Iterable[int] = feasible_order(schedule)
    if any(schedule.pairs):  # a pair's two actions next to each other in the one order
        order = (stage for stage, span in paired_order(schedule, flatten(schedule))
                 for _ in range(span))
    for stage in order:
        done[stage] += 1
        message = messages.out[stage][done[stage] - 1]
        if message >= 0:
            destination = messages.destination[message]
            gaps[stage].setdefault(done[stage], []).append((message, SEND))
            gaps[destination].setdefault(done[destination], []).append((message, RECEIVE))
    return [_plan(schedule, stage, Moves.of(gaps[stage]), messages, together=False)
            for stage in range(schedule.stages)]


def _overlap(schedule: Schedule, messages: Messages) -> list[PlanSteps]:
    """``"overlap"``: the rendezvous simulation of the module docstring, one group per gap."""
    moves = Rendezvous([len(order) for order in schedule.order], default_durations(schedule),
                       messages).run()
    return [_plan(schedule, stage, moves[stage], messages) for stage in range(schedule.stages)]
