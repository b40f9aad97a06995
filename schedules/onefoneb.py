"""1F1B (PipeDream-Flush): warm-up forwards, steady one-forward-one-backward, cool-down."""

from __future__ import annotations

from schedules._checks import check_counts
from schedules.action import Action, Op, Schedule


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """Stage s runs ``min(P-1-s, M)`` warm-up forwards, then alternates F and B, then drains.

    Same bubble as GPipe, but stage s holds at most ``min(P - s, M)`` micro-batches.

    >>> print(one_f_one_b(stages=3, microbatches=4))
    stage 0: F0 F1 F2 B0 F3 B1 B2 B3
    stage 1: F0@c1 F1@c1 B0@c1 F2@c1 B1@c1 F3@c1 B2@c1 B3@c1
    stage 2: F0@c2 B0@c2 F1@c2 B1@c2 F2@c2 B2@c2 F3@c2 B3@c2

    Its peaks, stage by stage (GPipe holds M = 4 on each):

    >>> from schedules import simulate
    >>> simulate(one_f_one_b(stages=3, microbatches=4)).peak_activations
    (3.0, 2.0, 1.0)

    Args:
        stages: number of pipeline stages, >= 1.
        microbatches: number of micro-batches per step, >= 1.

    Returns:
        The schedule, one chunk per stage, named ``"1f1b"``, in three phases: warm-up
        forwards, one forward and one backward in turn, cool-down backwards.

    Raises:
        ValueError: a count below one.
    """
    check_counts(stages, microbatches)
    return Schedule(
        stages,
        microbatches,
        tuple(_stage_order(stage, stages, microbatches) for stage in range(stages)),
        name="1f1b",
    )


def _stage_order(stage: int, stages: int, microbatches: int) -> tuple[Action, ...]:
    warmup = min(stages - 1 - stage, microbatches)
    order = [Action(Op.F, m, stage) for m in range(warmup)]
    for steady in range(microbatches - warmup):
        order.append(Action(Op.F, warmup + steady, stage))
        order.append(Action(Op.B, steady, stage))
    order.extend(Action(Op.B, m, stage) for m in range(microbatches - warmup, microbatches))
    return tuple(order)
