"""Balancing by time for a known schedule: the cut shown is never slower, simulated, than another
cut shown beside it (the uniform one, the min-max one), and is the makespan optimum where every
cut is simulated; checked against brute force on cases where min-max and makespan disagree."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balance_brute import cuts
from partitioners.cut.balance import balance, uniform
from partitioners.cut.report import report
from partitioners.cut.step import choose_by_step, fastest_cut, neighbours
from partitioners.measure.cost import LayerCost

# min-max and the makespan disagree: [1, 2] has the smaller slowest stage (19 against 21),
# [2, 1] the shorter 1F1B step with two micro-batches (45 against 48).
DISAGREE = [LayerCost(9.0, 1.0), LayerCost(7.0, 4.0), LayerCost(7.0, 1.0)]


def step_of(costs: list[LayerCost], sizes: list[int], schedule: str, microbatches: int) -> float:
    held = [1.0] * len(sizes)
    return report(costs, sizes, held, schedule, microbatches).step_time


def test_min_max_and_the_makespan_disagree_on_the_case() -> None:
    """The case is what it claims: the plain API stays min-max, and that cut is slower."""
    assert balance(DISAGREE, 2) == [1, 2]
    assert step_of(DISAGREE, [1, 2], "1f1b", 2) == 48.0
    assert step_of(DISAGREE, [2, 1], "1f1b", 2) == 45.0


def test_the_choice_is_the_faster_step_not_the_smaller_slowest_stage() -> None:
    choice = choose_by_step(DISAGREE, [1, 2], "1f1b", 2)
    assert choice.sizes == (2, 1)
    assert choice.step_time == 45.0
    assert choice.exhaustive and choice.searched == 2


def test_neighbours_move_one_boundary_by_one_layer() -> None:
    assert sorted(neighbours((2, 2, 1))) == [(1, 3, 1), (2, 1, 2), (3, 1, 1)]
    assert neighbours((1,)) == []


def test_local_search_never_ends_slower_than_a_seed() -> None:
    """With a budget too small for every cut, it climbs from the seeds: never above them."""
    def step(sizes: tuple[int, ...]) -> float:
        return float(sum(abs(size - 3) for size in sizes) + sizes[0])

    choice = fastest_cut(12, 4, step, seeds=[(9, 1, 1, 1), (3, 3, 3, 3)], budget=20)
    assert not choice.exhaustive
    assert choice.searched <= 2 + 20  # the seeds, and the budget
    assert choice.step_time <= min(step((9, 1, 1, 1)), step((3, 3, 3, 3)))


def test_a_cut_that_does_not_fit_is_never_chosen() -> None:
    choice = fastest_cut(3, 2, lambda sizes: float(sizes[1]), seeds=[(1, 2)],
                         fits=lambda sizes: sizes != (2, 1))
    assert choice.sizes == (1, 2)


def test_seeds_that_are_not_cuts_are_refused() -> None:
    with pytest.raises(ValueError, match="seed"):
        fastest_cut(3, 2, lambda sizes: 0.0, seeds=[(1, 1)])


LAYER = st.builds(LayerCost, st.integers(1, 9).map(float), st.integers(1, 9).map(float))


@settings(max_examples=120, deadline=None)
@given(costs=st.lists(LAYER, min_size=2, max_size=7), stages=st.integers(2, 4),
       microbatches=st.integers(1, 5), schedule=st.sampled_from(["1f1b", "gpipe"]))
def test_the_choice_is_the_makespan_optimum_against_brute_force(
        costs: list[LayerCost], stages: int, microbatches: int, schedule: str) -> None:
    """Every cut simulated: the choice's step is the least, so never above min-max's or
    uniform's, the two cuts a report sets beside it."""
    stages = min(stages, len(costs))
    min_max = balance(costs, stages)
    choice = choose_by_step(costs, min_max, schedule, microbatches)
    steps = {tuple(sizes): step_of(costs, sizes, schedule, microbatches)
             for sizes in cuts(len(costs), stages)}
    assert choice.exhaustive
    assert choice.step_time == steps[choice.sizes] == min(steps.values())
    assert choice.step_time <= steps[tuple(min_max)]
    assert choice.step_time <= steps[tuple(uniform(len(costs), stages))]


@settings(max_examples=40, deadline=None)
@given(costs=st.lists(LAYER, min_size=6, max_size=12), stages=st.integers(2, 5),
       microbatches=st.integers(1, 6))
def test_a_local_search_is_never_slower_than_the_cuts_shown(
        costs: list[LayerCost], stages: int, microbatches: int) -> None:
    min_max = balance(costs, stages)
    choice = choose_by_step(costs, min_max, "1f1b", microbatches, budget=8)
    assert choice.step_time <= step_of(costs, min_max, "1f1b", microbatches)
    assert choice.step_time <= step_of(costs, uniform(len(costs), stages), "1f1b", microbatches)


def test_under_a_memory_limit_only_cuts_that_fit_are_chosen() -> None:
    """The faster [2, 1] holds 400 bytes of parameters and gradients on stage 0, over 300."""
    heavy = [LayerCost(9.0, 1.0, param_bytes=100), LayerCost(7.0, 4.0, param_bytes=100),
             LayerCost(7.0, 1.0)]
    min_max = balance(heavy, 2, memory_limit=300, microbatches=2)
    choice = choose_by_step(heavy, min_max, "1f1b", 2, memory_limit=300)
    assert choice.sizes == (1, 2) and choice.searched == 1
    assert choose_by_step(heavy, min_max, "1f1b", 2).sizes == (2, 1)
