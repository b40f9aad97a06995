"""One stage's part of a comm plan as arrays: its steps, and where each action's result comes from and goes."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from schedules import CommPlan, Schedule
from schedules.action import OP_CODES, OPS, StageOrder
from schedules.dependencies import ActionKey, received
from schedules.plan_steps import SEND, PlanSteps


NO_SOURCE = 255  # ``StageSteps.source_ops`` of an action that receives nothing


@dataclass(frozen=True, eq=False)
class StageSteps:
    """One stage's part of a comm plan: its steps, and where each action's result comes from
    and goes, as arrays.

    Derived from ``schedules.comm_plan``, the single place that turns a schedule into sends
    and receives. A stage of a 64-stage timetable runs 10^4 actions a step, for the life of
    the process: an object (or a prepared closure) per step would cost every full garbage
    collection a scan of all of them, so the steps stay ``PlanSteps`` arrays and the
    per-action facts are byte and integer arrays indexed like ``steps.actions`` (the
    stage's order). ``run_stage`` reads them; an ``Action`` or ``Group`` is made when a step
    runs.

    Attributes:
        stage: the stage.
        steps: its steps (``Action`` and ``Group``), as arrays.
        comm: the comm plan as this stage sees it, for ``Transport.begin_step``: its own
            steps, every other stage's empty (a transport reads only its own stage's).
        sent: per action, 1 where its result is sent to another stage.
        kept: per action, 1 where a later chunk on this same stage consumes its result.
        source_ops: per action, the op code (``schedules.OPS``) of the result it starts from
            (``dependencies.received``: same micro-batch, chunk ``source_chunks``), or
            ``NO_SOURCE``: chunk 0's forward (the caller's input), the last chunk's backward
            (the loss), a W (its own I).
        source_chunks: per action, that result's chunk.
        source_here: per action, 1 where that result is produced on this stage.
    """

    stage: int
    steps: PlanSteps
    comm: CommPlan
    sent: bytes
    kept: bytes
    source_ops: bytes
    source_chunks: array[int]
    source_here: bytes

    @classmethod
    def of(cls, comm: CommPlan, stage: int) -> StageSteps:
        """Stage ``stage``'s part of ``comm`` (a plan of every stage).

        Raises:
            ValueError: the stage's steps are not ones arrays can hold (``PlanSteps``).
        """
        schedule = comm.schedule
        steps = PlanSteps.of(comm.stages[stage])
        if steps is None:
            raise ValueError(f"stage {stage}'s steps in the {comm.strategy} comm plan are not "
                             f"Actions and Groups of CommOps; expected a comm_plan's steps")
        actions = steps.actions
        position = {key: at for at, key in enumerate(_keys(actions))}
        ops = steps.ops
        sent = bytearray(len(actions))
        for at in range(len(ops.kinds)):
            if ops.kinds[at] == SEND:
                sent[position[(OPS[ops.producer_ops[at]], ops.microbatches[at],
                               ops.chunks[at])]] = 1
        kept = bytearray(len(actions))
        source_ops = bytearray([NO_SOURCE]) * len(actions)
        source_chunks, source_here = array("q", bytes(8 * len(actions))), bytearray(len(actions))
        for at, action in enumerate(actions):
            source = received(schedule, action)
            if source is None:
                continue
            source_ops[at], source_chunks[at] = OP_CODES[source[0]], source[2]
            if schedule.placement[source[2]] == stage:
                source_here[at] = 1
                kept[position[source]] = 1
        return cls(stage, steps, _stage_view(comm, stage), bytes(sent), bytes(kept),
                   bytes(source_ops), source_chunks, bytes(source_here))

    @property
    def actions(self) -> StageOrder:
        """The stage's actions, in order."""
        return self.steps.actions

    @cached_property
    def owned(self) -> frozenset[int]:
        """The model chunks this stage runs."""
        return frozenset(self.steps.actions.chunks)


def _keys(actions: StageOrder) -> Iterator[ActionKey]:
    for code, microbatch, chunk in zip(actions.ops, actions.microbatches, actions.chunks):
        yield (OPS[code], microbatch, chunk)


def _stage_view(comm: CommPlan, stage: int) -> CommPlan:
    """``comm`` as ``stage`` sees it: its own order and steps, every other stage's empty, so
    that what a rank keeps does not grow with the stages."""
    schedule, empty = comm.schedule, StageOrder.of(())
    orders = tuple(schedule.order[s] if s == stage else empty for s in range(schedule.stages))
    pairs = tuple(schedule.pairs[s] if s == stage else () for s in range(schedule.stages))
    view = Schedule(schedule.stages, schedule.microbatches, orders, schedule.placement,
                    schedule.name, schedule.forward_only, pairs)
    return CommPlan(view, tuple(comm.stages[s] if s == stage else ()
                                for s in range(schedule.stages)), comm.strategy)
