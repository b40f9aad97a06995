"""1F1B: literal timetables, the closed-form bubble and makespan, and min(P - s, M) memory."""

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import Op, gpipe, one_f_one_b, simulate, validate

STAGES = range(1, 9)
MICROBATCHES = range(1, 33)


def test_timetable_for_three_stages_and_four_microbatches():
    assert str(one_f_one_b(stages=3, microbatches=4)) == (
        "stage 0: F0 F1 F2 B0 F3 B1 B2 B3\n"
        "stage 1: F0@c1 F1@c1 B0@c1 F2@c1 B1@c1 F3@c1 B2@c1 B3@c1\n"
        "stage 2: F0@c2 B0@c2 F1@c2 B1@c2 F2@c2 B2@c2 F3@c2 B3@c2"
    )


def test_timetable_with_fewer_microbatches_than_stages():
    # Warm-up is capped by M: stage 0 runs every forward before its first backward.
    assert str(one_f_one_b(stages=4, microbatches=2)) == (
        "stage 0: F0 F1 B0 B1\n"
        "stage 1: F0@c1 F1@c1 B0@c1 B1@c1\n"
        "stage 2: F0@c2 F1@c2 B0@c2 B1@c2\n"
        "stage 3: F0@c3 B0@c3 F1@c3 B1@c3"
    )


def test_one_stage_alternates_forward_and_backward():
    assert str(one_f_one_b(stages=1, microbatches=3)) == "stage 0: F0 B0 F1 B1 F2 B2"


def test_schedule_fields():
    schedule = one_f_one_b(stages=4, microbatches=8)
    assert (schedule.stages, schedule.microbatches, schedule.name) == (4, 8, "1f1b")
    assert schedule.placement == (0, 1, 2, 3)


@pytest.mark.parametrize("stages", STAGES)
def test_bubble_and_makespan_match_the_formula(stages):
    for microbatches in MICROBATCHES:
        schedule = one_f_one_b(stages, microbatches)
        validate(schedule)
        timeline = simulate(schedule, forward=1, backward=2, comm=0)
        expected = Fraction(stages - 1, microbatches + stages - 1)
        case = f"P={stages} M={microbatches}"
        assert math.isclose(timeline.bubble_fraction, expected, rel_tol=1e-12, abs_tol=0), case
        assert timeline.makespan == (microbatches + stages - 1) * 3, case


@pytest.mark.parametrize("stages", STAGES)
def test_stage_holds_at_most_stages_minus_its_index(stages):
    for microbatches in MICROBATCHES:
        timeline = simulate(one_f_one_b(stages, microbatches))
        expected = tuple(min(stages - s, microbatches) for s in range(stages))
        assert timeline.peak_activations == expected, f"P={stages} M={microbatches}"


@pytest.mark.parametrize("stages", STAGES)
def test_same_actions_as_gpipe_in_a_different_order(stages):
    for microbatches in (1, stages, 3 * stages):
        ours, theirs = one_f_one_b(stages, microbatches), gpipe(stages, microbatches)
        for stage in range(stages):
            assert sorted(ours.order[stage], key=str) == sorted(theirs.order[stage], key=str)


def test_phases_warmup_steady_cooldown():
    stages, microbatches = 5, 9
    for stage, actions in enumerate(one_f_one_b(stages, microbatches).order):
        ops = "".join(action.op.value for action in actions)
        warmup = stages - 1 - stage
        steady = microbatches - warmup
        assert ops == "F" * warmup + "FB" * steady + "B" * warmup
        # Micro-batches run in order within each op.
        assert [a.microbatch for a in actions if a.op is Op.F] == list(range(microbatches))
        assert [a.microbatch for a in actions if a.op is Op.B] == list(range(microbatches))



@settings(max_examples=40, deadline=None)
@given(
    stages=st.integers(1, 24),
    microbatches=st.integers(1, 96),
    scale=st.sampled_from([0.5, 1, 3]),
)
def test_formulas_beyond_the_grid(stages, microbatches, scale):
    # Any forward cost f with backward 2f: bubble (P-1)/(M+P-1), makespan 3f(M+P-1).
    timeline = simulate(one_f_one_b(stages, microbatches), forward=scale, backward=2 * scale)
    expected = Fraction(stages - 1, microbatches + stages - 1)
    assert math.isclose(timeline.bubble_fraction, expected, rel_tol=1e-12, abs_tol=0)
    assert math.isclose(timeline.makespan, 3 * scale * (microbatches + stages - 1), rel_tol=1e-12)
    assert timeline.peak_activations == tuple(min(stages - s, microbatches) for s in range(stages))


@pytest.mark.parametrize(
    ("stages", "microbatches", "message"),
    [
        (0, 4, "stages must be >= 1, got stages=0"),
        (3, -1, "microbatches must be >= 1, got microbatches=-1"),
        ("3", 4, "stages must be an int >= 1, got '3'"),
    ],
)
def test_bad_counts_raise_value_error(stages, microbatches, message):
    with pytest.raises(ValueError, match=message):
        one_f_one_b(stages, microbatches)
