"""The comm plan around overlapped pairs: both inputs received before a pair, both results sent after it.

A pair (``schedules.pairs``) runs its forward and backward as one interval, so the gap
between them is not a gap at all: nothing can be posted there. Whatever a plan placed
there moves out: the receive of the backward's gradient to the gap before the pair, after
what was already posted there; a send (the forward's result), or a receive a later action
needs (taken early), to the gap after it, before what was posted there. Taken before the
pair, such a receive could wait for a result its sender makes only after a pair that
waits for this stage. The order of each stage's receives and of its sends is kept, so
each channel still matches its n-th send with its n-th receive; whether the moved plan
can stall under NCCL's rules is what ``validate_comm`` proves, as for any plan.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from schedules.comm_messages import Messages, Moves
from schedules.plan_steps import RECEIVE


def around_pairs(moves: Moves, pairs: Sequence[int], messages: Messages) -> Moves:
    """``moves`` (one stage's) with no op posted inside a pair: the receive its backward
    needs moves to the gap before it, any other op to the gap after it."""
    if not pairs:
        return moves
    inside = {start + 1 for start in pairs}
    needed_by = messages.consumer_index
    gaps, entries = moves.gaps.tolist(), moves.entries.tolist()
    placed = []
    for order, (gap, entry) in enumerate(zip(gaps, entries)):
        if gap in inside:
            for_backward = entry % 2 == RECEIVE and needed_by[entry // 2] == gap
            gap = gap - 1 if for_backward else gap + 1
        placed.append((gap, order, entry))
    placed.sort()
    moved = Moves()
    moved.gaps = array("q", [gap for gap, _, _ in placed])
    moved.entries = array("q", [entry for _, _, entry in placed])
    return moved
