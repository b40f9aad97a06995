"""The forward-only timetable that inference (``pipe(x)``) runs: every forward, no backward."""

from __future__ import annotations

from schedules.action import Action, Op, Schedule


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule``'s model chunks alone: per stage, chunk by chunk in the
    stage's chunks, each over every micro-batch.

    A chunk's inputs come only from lower chunks, so this order cannot deadlock; the
    placement is ``schedule``'s, so the same stages hold the same chunks.

    >>> from schedules import interleaved_1f1b
    >>> print(forward_only(interleaved_1f1b(stages=2, microbatches=2)))
    stage 0: F0 F1 F0@c2 F1@c2
    stage 1: F0@c1 F1@c1 F0@c3 F1@c3

    Args:
        schedule: any schedule; only its counts and placement are used.

    Returns:
        A Schedule with ``forward_only=True``, named ``"<name> forward"``.
    """
    order = tuple(
        tuple(Action(Op.F, microbatch, chunk)
              for chunk in chunks for microbatch in range(schedule.microbatches))
        for chunks in schedule.chunks_of_stage
    )
    return Schedule(
        schedule.stages, schedule.microbatches, order, schedule.placement,
        name=f"{schedule.name} forward", forward_only=True,
    )
