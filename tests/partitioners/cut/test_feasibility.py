"""The exact engine: reachable sets, greedy vs scanning steps, any per-stage memory cap."""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import accumulate

import pytest

from balance_brute import cuts
from partitioners.cut.feasibility import MemoryCap, Problem, reachable, windows
from partitioners.cut.intervals import clip, contains, merge, predecessor
from partitioners.cut.minmax import NoCutFits, smallest_memory_cap, solve, stage_costs


def prefix(values: list[int]) -> tuple[int, ...]:
    return tuple(accumulate(values, initial=0))


def random_problem(rng: random.Random, nested: bool) -> tuple[Problem, list[int], list[int]]:
    layers = rng.randint(1, 10)
    stages = rng.randint(1, min(5, layers))
    weights = [rng.randint(0, 9) for _ in range(layers)]
    saved = [rng.randint(0, 5) for _ in range(layers)]
    held = [rng.randint(1, 6) for _ in range(stages)]
    if nested:
        held.sort(reverse=True)
    memory = MemoryCap(
        fixed=prefix([rng.randint(0, 8) for _ in range(layers)]),
        saved=prefix(saved),
        held=tuple(held),
        limit=rng.randint(5, 60),
    )
    send = [rng.choice([0, 0, 1, 5]) for _ in range(layers)] if rng.random() < 0.5 else []
    problem = Problem(prefix(weights), stages, tuple(send), memory)
    return problem, weights, saved


def brute(problem: Problem) -> tuple[int, int] | None:
    best = None
    for sizes in cuts(problem.layers, problem.stages):
        ends = list(accumulate(sizes, initial=0))
        memory = problem.memory
        if memory is not None and any(
            memory.stage(ends[s], ends[s + 1], s) > memory.limit for s in range(problem.stages)
        ):
            continue
        ordered = sorted(stage_costs(problem, sizes), reverse=True) + [0]
        key = (ordered[0], ordered[1] if problem.stages > 1 else 0)
        if best is None or key < best:
            best = key
    return best


@pytest.mark.parametrize("nested", [True, False])
def test_solve_matches_brute_force_for_any_memory_cap(nested: bool) -> None:
    rng = random.Random(5 if nested else 6)
    for _ in range(400):
        problem, _, _ = random_problem(rng, nested)
        expected = brute(problem)
        if expected is None:
            with pytest.raises(NoCutFits):
                solve(problem)
            continue
        sizes = solve(problem)
        assert sum(sizes) == problem.layers and min(sizes) >= 1
        ordered = sorted(stage_costs(problem, sizes), reverse=True) + [0]
        assert (ordered[0], ordered[1] if problem.stages > 1 else 0) == expected, problem


def test_greedy_and_scanning_steps_agree() -> None:
    rng = random.Random(9)
    for _ in range(300):
        problem, _, _ = random_problem(rng, nested=True)
        problem = replace(problem, send=())
        assert problem.greedy_exact
        scanning = replace(problem, send=(0,) * problem.layers)  # zero sends force scans
        assert not scanning.greedy_exact
        for bound in range(0, problem.prefix[-1] + 2, 3):
            assert reachable(problem, bound) == reachable(scanning, bound)


def test_smallest_memory_cap_is_exact() -> None:
    rng = random.Random(4)
    for _ in range(200):
        problem, _, _ = random_problem(rng, nested=rng.random() < 0.5)
        memory = problem.memory
        assert memory is not None
        every_cut = cuts(problem.layers, problem.stages)
        need = min(
            max(memory.stage(e[s], e[s + 1], s) for s in range(problem.stages))
            for e in (list(accumulate(sizes, initial=0)) for sizes in every_cut)
        )
        assert smallest_memory_cap(problem, need + 7) == need


def test_windows_bracket_every_feasible_cut() -> None:
    problem = Problem(prefix([3, 1, 4, 1, 5, 9, 2, 6]), stages=3)
    bound = 15
    spans = windows(problem, bound)
    for sizes in cuts(problem.layers, problem.stages):
        if max(stage_costs(problem, sizes)) <= bound:
            ends = list(accumulate(sizes))
            assert all(low <= end <= high for end, (low, high) in zip(ends, spans))


def test_interval_helpers() -> None:
    assert merge([(5, 6), (1, 2), (3, 3), (9, 8)]) == [(1, 3), (5, 6)]
    assert clip([(1, 3), (5, 9)], 2, 6) == [(2, 3), (5, 6)]
    sets = [(1, 3), (6, 8)]
    assert [contains(sets, p) for p in range(10)] == [
        False, True, True, True, False, False, True, True, True, False
    ]
    assert [predecessor(sets, p) for p in (1, 2, 4, 6, 7, 10)] == [None, 1, 3, 3, 6, 8]
