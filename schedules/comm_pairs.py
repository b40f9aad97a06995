"""The comm plan around overlapped pairs: both inputs received before a pair, both results sent after it.

A pair (``schedules.pairs``) runs its forward and backward as one interval, so the gap
between them is not a gap at all: nothing can be posted there. Whatever a plan placed
there moves out: a receive (the backward's gradient, or any message the stage took
early) to the gap before the pair, after what was already posted there; a send (the
forward's result) to the gap after it, before what was posted there. The order of each
stage's receives and of its sends is kept, so each channel still matches its n-th send
with its n-th receive; whether the moved plan can stall under NCCL's rules is what
``validate_comm`` proves, as for any plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from array import array

from schedules.comm_messages import Moves
from schedules.plan_steps import RECEIVE


def around_pairs(moves: Moves, pairs: Sequence[int]) -> Moves:
    """``moves`` (one stage's) with no op posted inside a pair: receives posted there move
    to the gap before it, sends to the gap after it."""
    if not pairs:
        return moves
    inside = {start + 1 for start in pairs}
    gaps, entries = moves.gaps.tolist(), moves.entries.tolist()
    placed = []
    for order, (gap, entry) in enumerate(zip(gaps, entries)):
        if gap in inside:
            gap = gap - 1 if entry % 2 == RECEIVE else gap + 1
        placed.append((gap, order, entry))
    placed.sort()
    moved = Moves()
    moved.gaps = array("q", [gap for gap, _, _ in placed])
    moved.entries = array("q", [entry for _, _, entry in placed])
    return moved
