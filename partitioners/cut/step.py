"""Choose a cut by its simulated step: every cut where they are few, else a climb from the
min-max cut and the uniform one.

``balance(by="time")`` minimises the slowest stage, which is what bounds a pipeline's
steady state; but a step also pays the ramp up and down, and there a cut with a
slightly slower slowest stage can finish first (a fast first stage starts the
others sooner). Once the schedule is known, the step itself can be judged: this
simulates candidate cuts with ``schedules.simulate`` (through ``report``, the same
figures a report prints) and keeps the fastest. Where every cut fits the budget of
simulations, that is the makespan optimum; else it climbs from the seeds, moving one
boundary by one layer at a time, so the choice is never slower than a seed, and the
seeds are the cuts a report sets beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations

from partitioners.cut.balance import check_stages, uniform
from partitioners.cut.memory import held_microbatches, memory_cap
from partitioners.cut.report import report
from partitioners.measure.cost import LayerCost
from schedules import Link, Schedule, get_schedule

Sizes = tuple[int, ...]
# Actions replayed per choice, in all: about a second of simulation.
ACTIONS_BUDGET = 250_000


@dataclass(frozen=True)
class StepChoice:
    """The cut chosen by its simulated step.

    Attributes:
        sizes: layers per stage.
        step_time: its simulated step, in the costs' unit.
        searched: how many cuts were simulated.
        exhaustive: True when every cut (that fits) was simulated: ``sizes`` is then
            the makespan optimum.
    """

    sizes: Sizes
    step_time: float
    searched: int
    exhaustive: bool


def every_cut(layers: int, stages: int) -> Iterator[Sizes]:
    """Every cut of ``layers`` into ``stages`` non-empty stages, in lexicographic order of
    its boundaries."""
    for inner in combinations(range(1, layers), stages - 1):
        ends = (0, *inner, layers)
        yield tuple(b - a for a, b in zip(ends, ends[1:]))


def neighbours(sizes: Sizes) -> list[Sizes]:
    """The cuts one boundary away: a layer moved across one boundary, every stage kept
    non-empty."""
    found = []
    for boundary in range(len(sizes) - 1):
        for moved in (-1, 1):
            left, right = sizes[boundary] + moved, sizes[boundary + 1] - moved
            if left >= 1 and right >= 1:
                found.append((*sizes[:boundary], left, right, *sizes[boundary + 2:]))
    return found


def fastest_cut(
    layers: int,
    stages: int,
    step_time: Callable[[Sizes], float],
    seeds: Sequence[Sequence[int]],
    fits: Callable[[Sizes], bool] | None = None,
    budget: int = 1000,
) -> StepChoice:
    """The cut of least ``step_time`` among every cut, or among those a climb from ``seeds``
    reaches.

    Args:
        layers, stages: what is cut.
        step_time: a cut's simulated step.
        seeds: cuts to start from, the first preferred on ties; each is simulated.
        fits: whether a cut may be chosen (e.g. under a memory limit); None: every cut.
            Seeds that do not fit are skipped.
        budget: cuts to simulate at most, seeds apart: with at least as many cuts as
            there are, every cut is simulated.

    Raises:
        ValueError: a seed that is not a cut of ``layers`` into ``stages``, or no seed fits.
    """
    check_stages(layers, stages)
    starts = [_checked_seed(seed, layers, stages) for seed in seeds]
    allowed = fits or (lambda sizes: True)
    starts = [seed for seed in starts if allowed(seed)]
    if not starts:
        raise ValueError(f"no seed cut fits: {[list(seed) for seed in seeds]}")
    if math.comb(layers - 1, stages - 1) <= budget:
        ordered = _unique([*starts, *every_cut(layers, stages)])
        steps = {sizes: step_time(sizes) for sizes in ordered if allowed(sizes)}
        return _best(steps, exhaustive=True)
    return _climb(starts, step_time, allowed, budget)


def _checked_seed(seed: Sequence[int], layers: int, stages: int) -> Sizes:
    sizes = tuple(seed)
    if len(sizes) != stages or sum(sizes) != layers or min(sizes) < 1:
        raise ValueError(f"seed {list(sizes)} is not a cut of {layers} layers into {stages} "
                         f"non-empty stages")
    return sizes


def _unique(cuts: Sequence[Sizes]) -> list[Sizes]:
    return list(dict.fromkeys(cuts))


def _best(steps: dict[Sizes, float], exhaustive: bool) -> StepChoice:
    """The first cut (in ``steps``' order) of least step."""
    sizes = min(steps, key=lambda cut: steps[cut])
    return StepChoice(sizes, steps[sizes], len(steps), exhaustive)


def _climb(starts: list[Sizes], step_time: Callable[[Sizes], float],
           fits: Callable[[Sizes], bool], budget: int) -> StepChoice:
    """From each seed, move to its fastest neighbour while that is faster, within ``budget``."""
    steps = {sizes: step_time(sizes) for sizes in _unique(starts)}
    spent = 0
    for current in _unique(starts):
        while spent < budget:
            fresh = [cut for cut in neighbours(current) if cut not in steps and fits(cut)]
            fresh = fresh[: budget - spent]
            spent += len(fresh)
            steps.update((cut, step_time(cut)) for cut in fresh)
            known = [cut for cut in neighbours(current) if cut in steps]
            better = min(known, key=lambda cut: steps[cut], default=current)
            if steps[better] >= steps[current]:
                break
            current = better
    return _best(steps, exhaustive=False)


def simulation_budget(timetable: Schedule) -> int:
    """Cuts to simulate for ``timetable``: ``ACTIONS_BUDGET`` actions in all, at least 64 cuts."""
    actions = sum(len(order) for order in timetable.order)
    return max(64, ACTIONS_BUDGET // max(actions, 1))


def choose_by_step(
    costs: Sequence[LayerCost],
    min_max: Sequence[int],
    schedule: str,
    microbatches: int,
    *,
    held: Sequence[float] | None = None,
    bandwidth: float | None = None,
    link: Link | None = None,
    memory_limit: float | None = None,
    budget: int | None = None,
) -> StepChoice:
    """The cut whose step, as ``report`` simulates it, is least: among every cut where they
    are few, else among those a climb from ``min_max`` and the uniform cut reaches.

    Args:
        costs: per layer, as ``profile`` measured them (a Profile's loss counts).
        min_max: ``balance(costs, stages, by="time", ...)``: preferred on ties.
        schedule, microbatches: the step simulated (one model chunk per stage).
        held: micro-batches each stage holds at once under the schedule (None: read
            from it); with ``memory_limit``, the cut must fit as ``balance`` counts it.
        bandwidth, link: as ``report`` takes them.
        budget: cuts to simulate; None: ``simulation_budget``.

    Returns:
        The choice; its ``step_time`` is never above the min-max cut's or the uniform
        cut's (when that fits).
    """
    stages, layers = len(min_max), len(costs)
    timetable = get_schedule(schedule, stages, microbatches)
    if held is None:
        held = held_microbatches(timetable, stages)

    def step_time(sizes: Sizes) -> float:
        return report(costs, sizes, held, schedule, microbatches, bandwidth, link=link,
                      timetable=timetable).step_time

    fits = None if memory_limit is None else _fits_memory(costs, held, memory_limit)
    return fastest_cut(layers, stages, step_time, [min_max, uniform(layers, stages)], fits,
                       simulation_budget(timetable) if budget is None else budget)


def _fits_memory(costs: Sequence[LayerCost], held: Sequence[float], limit: float
                 ) -> Callable[[Sizes], bool]:
    """Whether a cut fits ``limit`` per stage, counted as ``balance`` counts it."""
    cap, _ = memory_cap(costs, held, limit)

    def fits(sizes: Sizes) -> bool:
        start = 0
        for stage, size in enumerate(sizes):
            if cap.stage(start, start + size, stage) > cap.limit:
                return False
            start += size
        return True

    return fits
