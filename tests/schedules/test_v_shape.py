"""V-Half and V-Min: valid V schedules whose activations stay under their design bounds."""

import math

import pytest

from schedules import Op, one_f_one_b, simulate, v_half, v_min
from schedules.v_shape import block_times, v_idle_bound, v_memory_cap

GENERATORS = {"v-half": v_half, "v-min": v_min}
SWEEP = [(p, m) for p in range(4, 17) for m in (2 * p, 4 * p)]
BARS = {"v-half": lambda p: math.ceil((p + 2) / 2), "v-min": lambda p: math.ceil((p + 4) / 3)}


def _equal_costs(schedule):
    return simulate(schedule, forward=1, backward=1, weight=1)


def _bubble_1f1b(stages, microbatches):
    return _equal_costs(one_f_one_b(stages, microbatches)).bubble_fraction


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


def _idle_per_stage(timeline, microbatches):
    # In chunk units (a chunk action costs half a full stage's): every stage of these
    # schedules does the same work, so each idles the makespan less 6 units per micro-batch.
    return round(2 * timeline.makespan) - 6 * microbatches


BAR = {"v-half": 0.5, "v-min": 0.7}
# Idle per stage in chunk units, with F = I = W, the same at every M >= 2P (1F1B's: 6(P-1)).
IDLE = {
    "v-half": {4: 5, 5: 6, 6: 11, 7: 11, 8: 17, 9: 17, 10: 23, 11: 23, 12: 29, 13: 29,
               14: 35, 15: 35, 16: 41},
    "v-min": {4: 5, 5: 11, 6: 11, 7: 17, 8: 23, 9: 23, 10: 29, 11: 35, 12: 35, 13: 41,
              14: 47, 15: 47, 16: 53},
}


@pytest.mark.parametrize("name", GENERATORS)
def test_bubble_time_bars_of_issue_13(name):
    # The bubble as Qi et al. compare it ("~p/2m" against 1F1B's "~p/m", with F = I = W)
    # and as DualPipe's README gives it: the time a stage idles in one step.
    for stages, microbatches in SWEEP:
        ours = _equal_costs(GENERATORS[name](stages, microbatches))
        one_f_one_b_idle = 6 * (stages - 1)
        assert _idle_per_stage(ours, microbatches) == IDLE[name][stages], (stages, microbatches)
        assert IDLE[name][stages] <= BAR[name] * one_f_one_b_idle, (stages, microbatches)


@pytest.mark.parametrize("name", GENERATORS)
def test_idle_meets_the_lower_bound(name):
    # With the idle of every cell pinned above: both are optimal for P in 4..16.
    for stages in range(4, 17):
        assert v_idle_bound(name, stages) == IDLE[name][stages], stages
    assert [v_idle_bound("v-half", p) for p in (4, 10, 15, 16)] == [5, 23, 35, 41]


def test_no_schedule_idles_less_than_the_bound():
    # A bound above what a valid schedule reaches would be a wrong proof: every replay,
    # at every M >= P here (memory binding or not), idles at least the bound.
    for stages in range(2, 11):
        for microbatches in range(stages, 3 * stages):
            for name in GENERATORS:
                idle = _idle_per_stage(_equal_costs(GENERATORS[name](stages, microbatches)),
                                       microbatches)
                assert idle >= v_idle_bound(name, stages), (name, stages, microbatches)


# The makespan (chunk units, F = I = W) of V-Half by its authors' own generator
# (sail-sg/zero-bubble-pipeline-parallelism, scheduler/zbv_greedy.py, run on these cells
# with unit costs on 2026-12-01) where its cap is the bar's, at even P: the bound too.
REFERENCE_V_HALF = {
    (4, 8): 53, (4, 16): 101, (6, 12): 83, (6, 24): 155, (8, 16): 113, (8, 32): 209,
    (10, 20): 143, (10, 40): 263, (12, 24): 173, (12, 48): 317, (14, 28): 203,
    (14, 56): 371, (16, 32): 233, (16, 64): 425,
}


def test_v_half_no_longer_than_its_authors_generator():
    for (stages, microbatches), theirs in REFERENCE_V_HALF.items():
        ours = _equal_costs(v_half(stages, microbatches))
        assert max(ours.peak_activations) <= BARS["v-half"](stages)
        assert round(2 * ours.makespan) <= theirs, (stages, microbatches)
        assert theirs == 6 * microbatches + v_idle_bound("v-half", stages)


# The bubble *fraction* (idle / makespan) against 1F1B's is stricter than the time at
# small M, because 1F1B's makespan holds its own larger bubble. V-Half is above 0.5x at
# these cells, and there the bound says that no schedule within its memory bar is not.
FRACTION_ABOVE_THE_BAR = {"v-half": {(10, 20), (12, 24), (14, 28), (14, 56), (15, 30),
                                     (16, 32), (16, 64)},
                          "v-min": set()}


@pytest.mark.parametrize("name", GENERATORS)
def test_bubble_fraction_against_1f1b(name):
    for stages, microbatches in SWEEP:
        ours = _equal_costs(GENERATORS[name](stages, microbatches)).bubble_fraction
        bar = BAR[name] * _bubble_1f1b(stages, microbatches)
        best_makespan = 6 * microbatches + v_idle_bound(name, stages)
        best = 1 - 6 * microbatches / best_makespan
        if (stages, microbatches) in FRACTION_ABOVE_THE_BAR[name]:
            assert best > bar and math.isclose(ours, best), (stages, microbatches)
        else:
            assert ours <= bar, (stages, microbatches, ours / bar)


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


@pytest.mark.parametrize("name", GENERATORS)
def test_a_bad_count_equal_to_a_built_one_is_still_refused(name):
    # The replays are cached by counts, and 2.0 == 2, True == 1: the check comes first.
    GENERATORS[name](3, 2)
    GENERATORS[name](1, 2)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1, got 2.0"):
        GENERATORS[name](3, 2.0)
    with pytest.raises(ValueError, match="stages must be an int >= 1, got True"):
        GENERATORS[name](True, 2)
