"""The exact min-max cut: smallest slowest stage, then smallest second-slowest, on integers.

The slowest stage's cost is found by bisection over integers: feasibility is
monotone in the bound, so the smallest feasible integer is the optimum, exactly.
The tie-break is a second bisection, on the second-slowest stage: with the slowest
fixed at ``best``, is there a cut where every stage but at most one costs ``<= T``?
That is the reachable-set walk of ``feasibility`` run twice side by side, once for
cuts that have not yet used their one large stage and once for cuts that have.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, replace
from functools import cached_property

from partitioners.cut.feasibility import Problem, cut_from, reachable, step, windows
from partitioners.cut.intervals import Intervals, clip, contains, merge, predecessor


class NoCutFits(ValueError):
    """No cut meets the memory cap, whatever the time."""


def solve(problem: Problem) -> list[int]:
    """Layers per stage of a cut whose slowest stage is smallest, then its second-slowest.

    Raises:
        NoCutFits: no cut meets the memory cap.
    """
    best = slowest_stage_bound(problem)
    return _tie_break(problem, best)


def slowest_stage_bound(problem: Problem) -> int:
    """The smallest achievable cost of the slowest stage.

    Raises:
        NoCutFits: no cut meets the memory cap.
    """
    prefix, stages = problem.prefix, problem.stages
    if problem.send:
        # Send costs only add: the optimum without them bounds it from below, and that
        # cut, with its send costs, from above.
        plain = replace(problem, send=())
        cut = solve(plain)
        low = max(stage_costs(plain, cut)) - 1
        high = max(stage_costs(problem, cut))
    else:
        total = prefix[-1]
        if reachable(problem, total) is None:
            raise NoCutFits("no cut meets the memory cap")
        largest = max(b - a for a, b in zip(prefix, prefix[1:]))
        low = min(max(largest, -(-total // stages)), total) - 1
        high = total
    return _smallest_feasible(problem, low, high)


def _smallest_feasible(problem: Problem, low: int, high: int) -> int:
    """Bisect: ``low`` is infeasible (or below every cost), ``high`` feasible."""
    while high - low > 1:
        middle = (low + high) // 2
        if reachable(problem, middle) is None:
            low = middle
        else:
            high = middle
    return high


def stage_costs(problem: Problem, sizes: list[int]) -> list[int]:
    """Each stage's cost (send cost included) for the cut ``sizes``."""
    costs, start = [], 0
    for stage, size in enumerate(sizes):
        costs.append(problem.time(start, start + size, stage))
        start += size
    return costs


@dataclass(frozen=True)
class _Heavy:
    """Finds the last layer costing more than a bound: only the one large stage may hold it."""

    weights: tuple[int, ...]

    @cached_property
    def _sorted(self) -> tuple[list[int], list[int]]:
        order = sorted(range(len(self.weights)), key=self.weights.__getitem__)
        values = [self.weights[i] for i in order]
        # last_index[k]: the largest layer index among the layers ranked k and above.
        last_index = [0] * (len(order) + 1)
        last_index[-1] = -1
        for rank in range(len(order) - 1, -1, -1):
            last_index[rank] = max(order[rank], last_index[rank + 1])
        return values, last_index

    def last_above(self, bound: int) -> int:
        values, last_index = self._sorted
        return last_index[bisect_right(values, bound)]


def _tie_break(problem: Problem, best: int) -> list[int]:
    sets = reachable(problem, best)
    if sets is None:
        raise RuntimeError(f"bound {best} was found feasible and is not: a bug")
    cut = cut_from(problem, sets, best)
    if problem.stages == 1:
        return cut
    prefix = problem.prefix
    heavy = _Heavy(tuple(b - a for a, b in zip(prefix, prefix[1:])))
    low, high = -1, sorted(stage_costs(problem, cut))[-2]
    while high - low > 1:
        middle = (low + high) // 2
        if _one_large_stage(problem, heavy, best, middle) is None:
            low = middle
        else:
            high = middle
    history = _one_large_stage(problem, heavy, best, high)
    if history is None:
        raise RuntimeError(f"second bound {high} was found feasible and is not: a bug")
    return _two_level_cut(problem, history, best, high)


def _one_large_stage(
    problem: Problem, heavy: _Heavy, best: int, bound: int
) -> list[tuple[Intervals, Intervals]] | None:
    """Per stage, (ends with every stage <= bound, ends with one stage in (bound, best])."""
    spans = windows(problem, best)
    # Positions at or before the last layer heavier than ``bound`` are dead once the
    # large stage is spent: a later stage would have to hold that layer.
    after_heavy = heavy.last_above(bound) + 1
    small: Intervals = [(0, 0)]
    large: Intervals = []
    history = []
    for stage in range(problem.stages):
        span = spans[stage]
        pieces = step(problem, large, stage, bound, span) + step(problem, small, stage, best, span)
        large = clip(merge(pieces), after_heavy, problem.layers)
        small = step(problem, small, stage, bound, span)
        if not small and not large:
            return None
        history.append((small, large))
    last_small, last_large = history[-1]
    if contains(last_small, problem.layers) or contains(last_large, problem.layers):
        return history
    return None


def _two_level_cut(
    problem: Problem, history: list[tuple[Intervals, Intervals]], best: int, bound: int
) -> list[int]:
    end = problem.layers
    spent = contains(history[-1][1], end)
    ends = [end]
    for stage in range(problem.stages - 1, 0, -1):
        small, large = history[stage - 1]
        start = predecessor(large, end) if spent else None
        if start is None or not problem.fits(start, end, stage, bound):
            limit = best if spent else bound
            start = predecessor(small, end)
            if start is None or not problem.fits(start, end, stage, limit):
                raise RuntimeError(f"no start for stage {stage} ending at {end}: a bug")
            spent = False
        ends.append(start)
        end = start
    ends.append(0)
    ends.reverse()
    return [b - a for a, b in zip(ends, ends[1:])]


def smallest_memory_cap(problem: Problem, known_fit: int) -> int:
    """The smallest memory cap some cut meets (time unbounded); ``known_fit`` is one that does."""
    memory = problem.memory
    if memory is None:
        return 0
    plain = replace(problem, send=())
    total = problem.prefix[-1]
    low, high = -1, known_fit
    while high - low > 1:
        middle = (low + high) // 2
        if reachable(replace(plain, memory=replace(memory, limit=middle)), total) is None:
            low = middle
        else:
            high = middle
    return high
