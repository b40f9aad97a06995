"""Overlapped forward-and-backward pairs (DeepSeek's ``F&B``): what a pair is, and its checks.

A stage of DualPipeV's steady state runs the forward of one micro-batch and the backward
of another as one pair. In a mixture-of-experts model each of them stops four times per
layer for an all-to-all (dispatch and combine, each way); paired, one's all-to-all runs
while the other computes, so the exchange is hidden by the schedule instead of waited for.

As data a pair is two neighbours in a stage's order, a forward at position ``p`` and a
backward (``B`` or ``I``) at ``p + 1``; ``Schedule.pairs[stage]`` lists the ``p``. What
follows from it:

- both start once both inputs are in: the comm plan posts the backward's receive before
  the pair and the forward's send after it (``schedules.comm_pairs``), and
  ``validate_comm`` proves that plan under NCCL's rules like any other;
- ``simulate`` runs a pair as one interval: the two computations one after the other,
  each one's exchange time hidden under the other's computation (what is left of it
  waits), its two events drawn in that interval;
- the runtime runs the backward, and the forward in the turns the backward's exchanges
  leave it (``pipeline.runtime.paired``).

The text form writes a pair joined by ``&``: ``stage 0: F0 F1 F2@c3&B0 ...``.
"""

from __future__ import annotations

from collections.abc import Sequence

from schedules.stage_order import StageOrder
from schedules.vocabulary import CODE_B, CODE_F, CODE_I, ScheduleError


def checked_pairs(pairs: Sequence[Sequence[int]], order: Sequence[StageOrder]
                  ) -> tuple[tuple[int, ...], ...]:
    """``pairs`` as one sorted tuple per stage, each a forward followed by a backward.

    Raises:
        ScheduleError: pairs given for another number of stages, a position outside the
            stage's order, a pair whose first action is not a forward or whose second is
            not a backward (``B`` or ``I``), or two pairs sharing an action.
    """
    if not pairs:
        return ((),) * len(order)
    if len(pairs) != len(order):
        raise ScheduleError(f"pairs must have one tuple of positions per stage: expected "
                            f"{len(order)}, got {len(pairs)}")
    checked = []
    for stage, (positions, actions) in enumerate(zip(pairs, order)):
        ordered = tuple(sorted(int(position) for position in positions))
        for before, position in zip((-2,) + ordered, ordered):
            if not 0 <= position < len(actions) - 1:
                raise ScheduleError(f"stage {stage}: a pair starts at position {position}, "
                                    f"expected 0..{len(actions) - 2} (a forward and the "
                                    f"backward after it)")
            if position - before < 2:
                raise ScheduleError(f"stage {stage}: the pairs at {before} and {position} "
                                    f"share an action; an action runs in one pair at most")
            first, second = actions.ops[position], actions.ops[position + 1]
            if first != CODE_F or second not in (CODE_B, CODE_I):
                raise ScheduleError(
                    f"stage {stage}: a pair is a forward and then a backward (B or I), got "
                    f"{actions[position]}&{actions[position + 1]} at position {position}")
        checked.append(ordered)
    return tuple(checked)


def joined_pairs(texts: list[str], positions: Sequence[int]) -> list[str]:
    """A stage's action texts with each pair written as one token, ``F3&B1``."""
    if not positions:
        return texts
    starts = set(positions)
    joined: list[str] = []
    skip = False
    for at, text in enumerate(texts):
        if skip:
            skip = False
            continue
        if at in starts:
            joined.append(f"{text}&{texts[at + 1]}")
            skip = True
        else:
            joined.append(text)
    return joined
