"""1F1B (PipeDream-Flush): warm-up forwards, steady one-forward-one-backward, cool-down; and its combined form (Megatron), each steady F and B one overlapped pair."""

from __future__ import annotations

from schedules._checks import check_counts
from schedules.action import Action, Op, Schedule


def one_f_one_b(stages: int, microbatches: int, overlap: bool = False) -> Schedule:
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

    With ``overlap``, a combined 1F1B (Megatron's, for expert parallelism): each steady
    forward and the backward after it run as one overlapped pair (``schedules.pairs``), one
    micro-batch's expert all-to-alls under the other's compute. A pair starts once both its
    inputs are in. With 1F1B's warm-up, stage s's pair k would wait for stage s+1's pair k
    (the gradient), which waits for stage s's pair k-1 (the activation): two pairs' time
    per micro-batch. So stage s warms up with ``min(2(P-s)-1, M)`` forwards, and stage
    s+1's pair k needs stage s's pair k-2: the steady state keeps 1F1B's pace, for twice
    its activations (``min(2(P-s), M)`` on stage s):

    >>> print(one_f_one_b(stages=2, microbatches=4, overlap=True))
    stage 0: F0 F1 F2 F3&B0 B1 B2 B3
    stage 1: F0@c1 F1@c1&B0@c1 F2@c1&B1@c1 F3@c1&B2@c1 B3@c1

    Args:
        stages: number of pipeline stages, >= 1.
        microbatches: number of micro-batches per step, >= 1.
        overlap: pair each steady forward with the backward after it (combined 1F1B).

    Returns:
        The schedule, one chunk per stage, named ``"1f1b"``, in three phases: warm-up
        forwards, one forward and one backward in turn, cool-down backwards.

    Raises:
        ValueError: a count below one.
    """
    check_counts(stages, microbatches)
    orders = [_stage_order(stage, stages, microbatches, overlap) for stage in range(stages)]
    return Schedule(stages, microbatches, tuple(order for order, _ in orders), name="1f1b",
                    pairs=tuple(pairs for _, pairs in orders) if overlap else ())


def _stage_order(stage: int, stages: int, microbatches: int, overlap: bool
                 ) -> tuple[tuple[Action, ...], tuple[int, ...]]:
    """A stage's order, and the positions of its pairs' forwards (with ``overlap``)."""
    warmup = min(2 * (stages - stage) - 1 if overlap else stages - 1 - stage, microbatches)
    order = [Action(Op.F, m, stage) for m in range(warmup)]
    pairs = []
    for steady in range(microbatches - warmup):
        pairs.append(len(order))
        order.append(Action(Op.F, warmup + steady, stage))
        order.append(Action(Op.B, steady, stage))
    order.extend(Action(Op.B, m, stage) for m in range(microbatches - warmup, microbatches))
    return tuple(order), tuple(pairs)
