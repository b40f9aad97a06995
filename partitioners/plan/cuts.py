"""The planner's cuts: exact by time, and exact by time under a conservative memory cap.

A plan's cut is the exact min-max cut by time into the schedule's model chunks
(``balance(..., by="time")``). Under a memory limit, when that cut does not fit,
a schedule with one chunk per stage also gets the fastest cut that fits a
*linear* memory model that never under-estimates ``simulate``'s: per stage,
``(2 + optimizer_factor) x params`` plus, per micro-batch whose activations it
holds at once, ``sum over its layers of max(saved bytes, the layer's input
bytes)``. Without recomputation that is every micro-batch it holds; with
``checkpoint="always"`` a held micro-batch keeps only the stage's input, and one
at a time is recomputed in full; with ``"except_last"`` the last micro-batch is
also kept in full. A stage holding a layer tied to an earlier stage's (a head
tied to the embedding) is charged its own copy of those parameters. A stage's
input is charged as the largest input from its first layer on (a bound that only
shrinks as the stage starts later, which the exact search needs). Any cut meeting that model fits the simulated peak too, so
a cut found here never fails the simulator's check. When no cut meets it, the cut
of least linear memory is returned, so that the planner can name the smallest
limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction
from itertools import accumulate

from partitioners.cut.balance import balance
from partitioners.measure.cost import LayerCost, Profile
from partitioners.cut.feasibility import MemoryCap, Problem, copied_bytes, cut_from, reachable
from partitioners.cut.memory import tied_copies
from partitioners.cut.minmax import NoCutFits, slowest_stage_bound, smallest_memory_cap


def time_cut(costs: Sequence[LayerCost], chunks: int) -> tuple[int, ...]:
    """Layers per chunk minimising the slowest chunk's forward+backward (a loss on the last)."""
    return tuple(balance(costs, chunks, by="time"))


def _full_and_inputs(held: Sequence[float], checkpoint: str
                     ) -> tuple[list[float], list[float]]:
    """Per stage, micro-batches whose activations it keeps in full, and those whose inputs
    only, at once (see the module docstring)."""
    if checkpoint == "never":
        return list(held), [0.0] * len(held)
    full = 1.0 if checkpoint == "always" else 2.0
    return [min(h, full) for h in held], list(held)


def memory_capped_cut(
    costs: Sequence[LayerCost],
    held: Sequence[float],
    limit: float,
    optimizer_factor: float = 0.0,
    checkpoint: str = "never",
) -> tuple[int, ...]:
    """The fastest cut into ``len(held)`` stages meeting ``limit`` in the linear model above.

    Args:
        costs: per layer (a Profile's loss is charged to the last stage).
        held: per stage, the most micro-batches it holds at once (one chunk each).
        limit: bytes per stage.
        optimizer_factor: optimizer-state bytes per parameter byte.
        checkpoint: the recomputation mode ("never", "except_last" or "always").

    Returns:
        Layers per stage of a cut whose slowest stage is smallest (the first such
        cut found; no tie-break on the second slowest, which ``balance`` does: the
        simulator ranks plans); when no cut meets ``limit``, one of those with the
        least linear memory.
    """
    full, kept = _full_and_inputs(held, checkpoint)
    ratios = [Fraction(h).limit_denominator(1000) for h in full + kept]
    scale = math.lcm(*(ratio.denominator for ratio in ratios))
    inputs = [0] + [cost.activation_bytes for cost in costs[:-1]]
    cap = MemoryCap(
        fixed=tuple(accumulate((scale * math.ceil((2 + optimizer_factor) * cost.param_bytes)
                                for cost in costs), initial=0)),
        saved=tuple(accumulate((max(cost.saved_bytes, before)
                                for cost, before in zip(costs, inputs)), initial=0)),
        held=tuple(math.ceil(ratio * scale) for ratio in ratios[:len(held)]),
        limit=math.floor(Fraction(limit) * scale),
        inputs=_largest_from(inputs) if any(kept) else (),
        held_inputs=tuple(math.ceil(ratio * scale) for ratio in ratios[len(held):])
        if any(kept) else (),
        copies=tied_copies(costs, lambda nbytes: scale * math.ceil((2 + optimizer_factor) * nbytes)),
    )
    problem = Problem(_time_prefix(costs), len(held), memory=cap)
    try:
        return _fastest(problem)
    except NoCutFits:
        pass
    ends = list(accumulate(_even(len(costs), len(held)), initial=0))
    fits = max(cap.stage(ends[s], ends[s + 1], s) for s in range(len(held)))
    least = smallest_memory_cap(problem, fits)
    return _fastest(Problem(problem.prefix, problem.stages, memory=replace(cap, limit=least)))


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
    optimizer_factor: float = 0.0, checkpoint: str = "never",
) -> list[float]:
    """Per stage, the linear model's bytes for the cut ``sizes`` (for tests and reports)."""
    full, kept = _full_and_inputs(held, checkpoint)
    inputs = [0] + [cost.activation_bytes for cost in costs[:-1]]
    largest = _largest_from(inputs)
    copies = tied_copies(costs, lambda nbytes: math.ceil((2 + optimizer_factor) * nbytes))
    ends = list(accumulate(sizes, initial=0))
    return [
        sum(math.ceil((2 + optimizer_factor) * costs[i].param_bytes) for i in range(a, b))
        + full[s] * sum(max(costs[i].saved_bytes, inputs[i]) for i in range(a, b))
        + kept[s] * largest[a] + copied_bytes(copies, a, b)
        for s, (a, b) in enumerate(zip(ends, ends[1:]))
    ]


def _largest_from(inputs: Sequence[int]) -> tuple[int, ...]:
    """Per layer, the largest input of it and every later layer."""
    return tuple(reversed(list(accumulate(reversed(inputs), max))))

