"""Brute-force references for the balance tests: enumerate every cut, exactly, in fractions."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction

Sizes = list[int]


def cuts(layers: int, stages: int) -> Iterator[Sizes]:
    """Every way to cut ``layers`` into ``stages`` non-empty contiguous stages."""
    for inner in itertools.combinations(range(1, layers), stages - 1):
        ends = (0, *inner, layers)
        yield [b - a for a, b in zip(ends, ends[1:])]


def stage_costs(
    weights: Sequence[float],
    sizes: Sizes,
    send: Sequence[Fraction] | None = None,
    last_extra: float = 0,
) -> list[Fraction]:
    """Exact per-stage sums; with ``send``, a stage but the last adds its last layer's;
    the last stage adds ``last_extra``."""
    costs, start = [], 0
    for stage, size in enumerate(sizes):
        cost = sum((Fraction(w) for w in weights[start : start + size]), Fraction(0))
        if send is not None and stage < len(sizes) - 1:
            cost += send[start + size - 1]
        if stage == len(sizes) - 1:
            cost += Fraction(last_extra)
        costs.append(cost)
        start += size
    return costs


def top_two(costs: Sequence[Fraction]) -> tuple[Fraction, Fraction]:
    """(slowest, second-slowest); the second is 0 for one stage."""
    ordered = sorted(costs, reverse=True)
    return ordered[0], ordered[1] if len(ordered) > 1 else Fraction(0)


def best_top_two(
    weights: Sequence[float],
    stages: int,
    send: Sequence[Fraction] | None = None,
    allowed: Callable[[Sizes], bool] | None = None,
    last_extra: float = 0,
) -> tuple[Fraction, Fraction] | None:
    """The lexicographically smallest (slowest, second) over allowed cuts; None if none is."""
    best = None
    for sizes in cuts(len(weights), stages):
        if allowed is not None and not allowed(sizes):
            continue
        key = top_two(stage_costs(weights, sizes, send, last_extra))
        if best is None or key < best:
            best = key
    return best
