"""Sets of cut positions kept as sorted, disjoint, inclusive integer intervals."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

Intervals = list[tuple[int, int]]


def merge(pieces: Iterable[tuple[int, int]]) -> Intervals:
    """Sort ``pieces`` and join the ones that overlap or touch; empty pieces are dropped."""
    merged: Intervals = []
    for low, high in sorted(piece for piece in pieces if piece[0] <= piece[1]):
        if merged and low <= merged[-1][1] + 1:
            if high > merged[-1][1]:
                merged[-1] = (merged[-1][0], high)
        else:
            merged.append((low, high))
    return merged


def clip(intervals: Intervals, low: int, high: int) -> Intervals:
    """The part of ``intervals`` inside ``[low, high]``."""
    return [
        (max(a, low), min(b, high)) for a, b in intervals if a <= high and b >= low
    ]


def _last_starting_at_or_before(intervals: Intervals, position: int) -> int:
    return bisect_right(intervals, position, key=_start) - 1


def _start(interval: tuple[int, int]) -> int:
    return interval[0]


def contains(intervals: Intervals, position: int) -> bool:
    """Whether ``position`` is in the set."""
    index = _last_starting_at_or_before(intervals, position)
    return index >= 0 and position <= intervals[index][1]


def predecessor(intervals: Intervals, position: int) -> int | None:
    """The largest member strictly below ``position``, or None."""
    index = _last_starting_at_or_before(intervals, position - 1)
    if index < 0:
        return None
    return min(intervals[index][1], position - 1)
