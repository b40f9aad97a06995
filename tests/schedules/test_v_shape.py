"""V-Half and V-Min: valid V schedules whose activations stay under their design bounds."""

import doctest
import math

import pytest

import schedules.v_shape
from schedules import Action, Op, get_schedule, one_f_one_b, simulate, v_half, v_min, validate
from schedules.v_shape import block_times, v_memory_cap

GENERATORS = {"v-half": v_half, "v-min": v_min}
SWEEP = [(p, m) for p in range(4, 17) for m in (2 * p, 4 * p)]
BARS = {"v-half": lambda p: math.ceil((p + 2) / 2), "v-min": lambda p: math.ceil((p + 4) / 3)}


def _equal_costs(schedule):
    return simulate(schedule, forward=1, backward=1, weight=1)


def _bubble_1f1b(stages, microbatches):
    return _equal_costs(one_f_one_b(stages, microbatches)).bubble_fraction


def test_docstring_timetables_are_current():
    result = doctest.testmod(schedules.v_shape)
    assert result.attempted >= 2 and result.failed == 0


@pytest.mark.parametrize("name", GENERATORS)
def test_v_placement_every_backward_split_and_valid(name):
    for stages, microbatches in [(1, 1), (1, 3), (2, 1), (3, 2), (4, 8), (5, 7), (6, 3)]:
        schedule = GENERATORS[name](stages, microbatches)
        validate(schedule)
        assert schedule.name == name
        assert schedule.placement == tuple(min(c, 2 * stages - 1 - c) for c in range(2 * stages))
        for stage, actions in enumerate(schedule.order):
            expected = {Action(op, m, c) for op in (Op.F, Op.I, Op.W)
                        for m in range(microbatches) for c in schedule.chunks_of_stage[stage]}
            assert len(actions) == len(expected) and set(actions) == expected
        assert get_schedule(name.upper().replace("-", "_"), stages, microbatches) == schedule


@pytest.mark.parametrize("variant", GENERATORS)
def test_block_times_differ_modulo_the_period(variant):
    # Two micro-batches' blocks never want the same slot of a stage.
    for stages in range(1, 17):
        for stage in range(stages):
            residues = {t % 6 for t in block_times(variant, stages, stage)}
            assert len(residues) == 4, (stages, stage)


@pytest.mark.parametrize("name", GENERATORS)
def test_peak_activations_within_the_bar(name):
    for stages, microbatches in SWEEP + [(p, m) for p in range(1, 9) for m in range(1, 3 * p)]:
        peak = max(simulate(GENERATORS[name](stages, microbatches)).peak_activations)
        assert peak <= BARS[name](stages) == v_memory_cap(name, stages), (stages, microbatches)


# Where the issue-13 bars (0.5x and 0.7x of 1F1B's bubble) are not reached yet: the
# ratio reached there. Everywhere else in SWEEP the bars hold.
SHORT_OF_THE_BAR = {
    "v-half": {(10, 20): 0.518, (12, 24): 0.533, (14, 28): 0.544, (14, 56): 0.501,
               (15, 30): 0.512, (16, 32): 0.551, (16, 64): 0.508},
    "v-min": {},
}
BAR = {"v-half": 0.5, "v-min": 0.7}


@pytest.mark.parametrize("name", GENERATORS)
def test_bubble_bars_of_issue_13_where_reached(name):
    for stages, microbatches in SWEEP:
        ours = _equal_costs(GENERATORS[name](stages, microbatches)).bubble_fraction
        ratio = ours / _bubble_1f1b(stages, microbatches)
        short = SHORT_OF_THE_BAR[name].get((stages, microbatches))
        if short is None:
            assert ratio <= BAR[name], (stages, microbatches, ratio)
        else:  # no worse than recorded: a regression fails, an improvement is welcome
            assert ratio <= short + 5e-4, (stages, microbatches, ratio)


@pytest.mark.xfail(strict=True, reason="V-Half at M = 2P for even P >= 10 (and P = 15): the "
                   "last micro-batch waits for memory on its way (README, known limits)")
@pytest.mark.parametrize("name", ["v-half"])
def test_bubble_bars_of_issue_13_everywhere(name):
    for stages, microbatches in SHORT_OF_THE_BAR[name]:
        ours = _equal_costs(GENERATORS[name](stages, microbatches)).bubble_fraction
        assert ours <= BAR[name] * _bubble_1f1b(stages, microbatches), (stages, microbatches)


def test_the_memory_cap_is_never_passed_during_the_replay():
    # By construction: every stage's running count of held chunk activations.
    for name in GENERATORS:
        for stages, microbatches in [(2, 8), (5, 20), (8, 16), (11, 22)]:
            schedule = GENERATORS[name](stages, microbatches)
            for actions in schedule.order:
                held = 0
                for action in actions:
                    held += {Op.F: 1, Op.I: 0, Op.W: -1}[action.op]
                    assert held <= 2 * v_memory_cap(name, stages)


def test_figures_at_four_stages_eight_microbatches():
    half, least = _equal_costs(v_half(4, 8)), _equal_costs(v_min(4, 8))
    assert half.peak_activations == (3.0, 3.0, 3.0, 3.0)
    assert least.peak_activations == (3.0, 3.0, 3.0, 3.0)
    assert (round(half.bubble_fraction, 3), round(least.bubble_fraction, 3)) == (0.094, 0.094)
