"""Stage memory under a schedule: parameters with their gradients, plus held saved activations."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from itertools import accumulate

from partitioners.cost import LayerCost, check_ties
from partitioners.feasibility import Copies, MemoryCap
from schedules import Schedule, get_schedule, simulate


def held_microbatches(
    schedule: str | Schedule, stages: int, microbatches: int | None = None
) -> tuple[float, ...]:
    """Per stage, the most micro-batches whose saved activations it holds at once.

    Read from ``simulate(schedule).peak_activations``: GPipe holds all M, 1F1B
    ``min(P - s, M)`` on stage s.

    Args:
        schedule: a schedule name (``"1f1b"``, ``"gpipe"``, ...) or a Schedule.
        stages: number of stages; must match a given Schedule.
        microbatches: micro-batches per step; None means ``stages`` (1F1B's full
            steady state). Ignored for a given Schedule.

    Raises:
        ValueError: an unknown schedule name, bad counts, or a schedule that does
            not hold one model chunk per stage.
    """
    if isinstance(schedule, Schedule):
        timetable = schedule
        if timetable.stages != stages:
            raise ValueError(
                f"schedule has {timetable.stages} stages, expected stages={stages}"
            )
    else:
        timetable = get_schedule(schedule, stages, stages if microbatches is None else microbatches)
    if timetable.chunks != timetable.stages:
        raise ValueError(
            f"balance cuts one model chunk per stage, but schedule {timetable.name!r} places "
            f"{timetable.chunks} chunks on {timetable.stages} stages"
        )
    return simulate(timetable).peak_activations


def stage_memory(
    costs: Sequence[LayerCost], sizes: Sequence[int], held: Sequence[float]
) -> list[float]:
    """Bytes per stage of the cut ``sizes``: ``2 * param_bytes + held * saved_bytes``.

    A stage also holds a copy of each earlier stage's parameters its layers use
    (``LayerCost.tied``: a head tied to the embedding).
    """
    check_ties(costs)
    memory, start = [], 0
    for stage, size in enumerate(sizes):
        layers = costs[start : start + size]
        copies: dict[int, int] = {}
        for cost in layers:
            for origin, nbytes in cost.tied:
                if origin < start:
                    copies[origin] = max(copies.get(origin, 0), nbytes)
        fixed = sum(2 * cost.param_bytes for cost in layers) + 2 * sum(copies.values())
        saved = sum(cost.saved_bytes for cost in layers)
        memory.append(fixed + held[stage] * saved)
        start += size
    return memory


def memory_cap(
    costs: Sequence[LayerCost], held: Sequence[float], limit: float
) -> tuple[MemoryCap, int]:
    """The exact integer cap for ``feasibility``, and the scale its units carry.

    Held counts can be fractions of a micro-batch (a chunk of a stage with several);
    every quantity is multiplied by the common denominator so that all stay integers.
    """
    ratios = [Fraction(h).limit_denominator(1000) for h in held]
    scale = math.lcm(*(ratio.denominator for ratio in ratios))
    cap = MemoryCap(
        fixed=tuple(accumulate((2 * scale * cost.param_bytes for cost in costs), initial=0)),
        saved=tuple(accumulate((cost.saved_bytes for cost in costs), initial=0)),
        held=tuple(int(ratio * scale) for ratio in ratios),
        limit=math.floor(Fraction(limit) * scale),
        copies=tied_copies(costs, lambda nbytes: 2 * scale * nbytes),
    )
    return cap, scale


def tied_copies(
    costs: Sequence[LayerCost], charge: Callable[[int], int]
) -> Copies:
    """``MemoryCap.copies`` of ``costs``: per layer whose parameters later layers use, those
    layers and ``charge(bytes)`` of what each uses."""
    check_ties(costs)
    users: dict[int, list[tuple[int, int]]] = {}
    for layer, cost in enumerate(costs):
        for origin, nbytes in cost.tied:
            users.setdefault(origin, []).append((layer, charge(nbytes)))
    return tuple((origin, tuple(layer for layer, _ in users[origin]),
                  tuple(used for _, used in users[origin])) for origin in sorted(users))
