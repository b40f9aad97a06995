"""GPipe: every forward of the step, then every backward (Huang et al., 2019)."""

from __future__ import annotations

from schedules._checks import check_counts
from schedules.action import Action, Op, Schedule


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards, on every stage; each stage holds all M activations.

    >>> print(gpipe(stages=2, microbatches=3))
    stage 0: F0 F1 F2 B0 B1 B2
    stage 1: F0@c1 F1@c1 F2@c1 B0@c1 B1@c1 B2@c1

    Its peaks, stage by stage (1F1B holds ``min(P - s, M)`` on stage s, here 2 and 1):

    >>> from schedules import simulate
    >>> simulate(gpipe(stages=2, microbatches=3)).peak_activations
    (3.0, 3.0)

    Args:
        stages: number of pipeline stages, >= 1.
        microbatches: number of micro-batches per step, >= 1.

    Returns:
        The schedule, one chunk per stage, named ``"gpipe"``.

    Raises:
        ValueError: a count below one.
    """
    check_counts(stages, microbatches)
    order = tuple(
        tuple(Action(Op.F, m, stage) for m in range(microbatches))
        + tuple(Action(Op.B, m, stage) for m in range(microbatches))
        for stage in range(stages)
    )
    return Schedule(stages, microbatches, order, name="gpipe")
