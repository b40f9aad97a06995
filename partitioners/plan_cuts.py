"""The planner's cuts: exact by time, and exact by time under a conservative memory cap.

A plan's cut is the exact min-max cut by time into the schedule's model chunks
(``balance(..., by="time")``). Under a memory limit, when that cut does not fit,
a schedule with one chunk per stage also gets the fastest cut that fits a
*linear* memory model that never under-estimates ``simulate``'s: per stage,
``(2 + optimizer_factor) x params`` plus the micro-batches it holds at once times
``sum over its layers of max(saved bytes, the layer's input bytes)``. Any cut
meeting that model fits the simulated peak too (a held micro-batch keeps at most
``max(saved, input)`` of each chunk, recomputed or not), so a cut found here
never fails the simulator's check. When no cut meets it, the cut of least
linear memory is returned, so that the planner can name the smallest limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from itertools import accumulate

from partitioners.balance import balance
from partitioners.cost import LayerCost, Profile
from partitioners.feasibility import MemoryCap, Problem, cut_from, reachable
from partitioners.minmax import NoCutFits, slowest_stage_bound, smallest_memory_cap


def time_cut(costs: Sequence[LayerCost], chunks: int) -> tuple[int, ...]:
    """Layers per chunk minimising the slowest chunk's forward+backward (a loss on the last)."""
    return tuple(balance(costs, chunks, by="time"))


def memory_capped_cut(
    costs: Sequence[LayerCost],
    held: Sequence[float],
    limit: float,
    optimizer_factor: float = 0.0,
) -> tuple[int, ...]:
    """The fastest cut into ``len(held)`` stages meeting ``limit`` in the linear model above.

    Args:
        costs: per layer (a Profile's loss is charged to the last stage).
        held: per stage, the most micro-batches it holds at once (one chunk each).
        limit: bytes per stage.
        optimizer_factor: optimizer-state bytes per parameter byte.

    Returns:
        Layers per stage of a cut whose slowest stage is smallest (the first such
        cut found; no tie-break on the second slowest, which ``balance`` does: the
        simulator ranks plans); when no cut meets ``limit``, one of those with the
        least linear memory.
    """
    ratios = [Fraction(h).limit_denominator(1000) for h in held]
    scale = math.lcm(*(ratio.denominator for ratio in ratios))
    inputs = [0] + [cost.activation_bytes for cost in costs[:-1]]
    cap = MemoryCap(
        fixed=tuple(accumulate((scale * math.ceil((2 + optimizer_factor) * cost.param_bytes)
                                for cost in costs), initial=0)),
        saved=tuple(accumulate((max(cost.saved_bytes, before)
                                for cost, before in zip(costs, inputs)), initial=0)),
        held=tuple(math.ceil(ratio * scale) for ratio in ratios),
        limit=math.floor(Fraction(limit) * scale),
    )
    problem = Problem(_time_prefix(costs), len(held), memory=cap)
    try:
        return _fastest(problem)
    except NoCutFits:
        pass
    ends = list(accumulate(_even(len(costs), len(held)), initial=0))
    fits = max(cap.stage(ends[s], ends[s + 1], s) for s in range(len(held)))
    least = smallest_memory_cap(problem, fits)
    return _fastest(Problem(problem.prefix, problem.stages,
                            memory=MemoryCap(cap.fixed, cap.saved, cap.held, least)))


def _fastest(problem: Problem) -> tuple[int, ...]:
    """A cut with the smallest slowest stage (no tie-break: the simulator ranks the rest)."""
    best = slowest_stage_bound(problem)
    sets = reachable(problem, best)
    if sets is None:
        raise RuntimeError(f"bound {best} was found feasible and is not: a bug")
    return tuple(cut_from(problem, sets, best))


def _even(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if stage < extra else 0) for stage in range(stages)]


def _time_prefix(costs: Sequence[LayerCost]) -> tuple[int, ...]:
    """Prefix sums of forward+backward (the loss on the last layer) as exact integers."""
    weights = [Fraction(cost.forward) + Fraction(cost.backward) for cost in costs]
    loss = costs.loss if isinstance(costs, Profile) else None
    if loss is not None:
        weights[-1] += Fraction(loss.forward) + Fraction(loss.backward)
    unit = math.lcm(*(weight.denominator for weight in weights))
    return tuple(accumulate((int(weight * unit) for weight in weights), initial=0))


def cut_memory(
    costs: Sequence[LayerCost], sizes: Sequence[int], held: Sequence[float],
    optimizer_factor: float = 0.0,
) -> list[float]:
    """Per stage, the linear model's bytes for the cut ``sizes`` (for tests and reports)."""
    inputs = [0] + [cost.activation_bytes for cost in costs[:-1]]
    ends = list(accumulate(sizes, initial=0))
    return [
        sum(math.ceil((2 + optimizer_factor) * costs[i].param_bytes) for i in range(a, b))
        + held[s] * sum(max(costs[i].saved_bytes, inputs[i]) for i in range(a, b))
        for s, (a, b) in enumerate(zip(ends, ends[1:]))
    ]

