"""GPipe: the literal timetable, the closed-form bubble and makespan, and its memory."""

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import Action, Op, gpipe, simulate, validate

STAGES = range(1, 9)
MICROBATCHES = range(1, 33)


def test_timetable_for_three_stages_and_four_microbatches():
    assert str(gpipe(stages=3, microbatches=4)) == (
        "stage 0: F0 F1 F2 F3 B0 B1 B2 B3\n"
        "stage 1: F0@c1 F1@c1 F2@c1 F3@c1 B0@c1 B1@c1 B2@c1 B3@c1\n"
        "stage 2: F0@c2 F1@c2 F2@c2 F3@c2 B0@c2 B1@c2 B2@c2 B3@c2"
    )


def test_schedule_fields():
    schedule = gpipe(stages=2, microbatches=3)
    assert (schedule.stages, schedule.microbatches, schedule.name) == (2, 3, "gpipe")
    assert schedule.placement == (0, 1)
    assert schedule.order[1] == tuple(
        [Action(Op.F, m, 1) for m in range(3)] + [Action(Op.B, m, 1) for m in range(3)]
    )


@pytest.mark.parametrize("stages", STAGES)
def test_bubble_and_makespan_match_the_formula(stages):
    for microbatches in MICROBATCHES:
        schedule = gpipe(stages, microbatches)
        validate(schedule)
        timeline = simulate(schedule, forward=1, backward=2, comm=0)
        expected = Fraction(stages - 1, microbatches + stages - 1)
        case = f"P={stages} M={microbatches}"
        assert math.isclose(timeline.bubble_fraction, expected, rel_tol=1e-12, abs_tol=0), case
        assert timeline.makespan == (microbatches + stages - 1) * 3, case
        assert timeline.idle == ((stages - 1) * 3.0,) * stages, case


@pytest.mark.parametrize("stages", STAGES)
def test_every_stage_holds_all_microbatches(stages):
    for microbatches in MICROBATCHES:
        timeline = simulate(gpipe(stages, microbatches))
        assert timeline.peak_activations == (microbatches,) * stages, f"P={stages} M={microbatches}"



@settings(max_examples=40, deadline=None)
@given(
    stages=st.integers(1, 24),
    microbatches=st.integers(1, 96),
    scale=st.sampled_from([0.5, 1, 3]),
)
def test_formulas_beyond_the_grid(stages, microbatches, scale):
    # Any forward cost f with backward 2f: bubble (P-1)/(M+P-1), makespan 3f(M+P-1).
    timeline = simulate(gpipe(stages, microbatches), forward=scale, backward=2 * scale)
    expected = Fraction(stages - 1, microbatches + stages - 1)
    assert math.isclose(timeline.bubble_fraction, expected, rel_tol=1e-12, abs_tol=0)
    assert math.isclose(timeline.makespan, 3 * scale * (microbatches + stages - 1), rel_tol=1e-12)
    assert timeline.peak_activations == (microbatches,) * stages


@pytest.mark.parametrize(
    ("stages", "microbatches", "message"),
    [
        (0, 4, "stages must be >= 1, got stages=0"),
        (-2, 4, "stages must be >= 1, got stages=-2"),
        (3, 0, "microbatches must be >= 1, got microbatches=0"),
        (3, 2.0, "microbatches must be an int >= 1, got 2.0"),
        (True, 2, "stages must be an int >= 1, got True"),
    ],
)
def test_bad_counts_raise_value_error(stages, microbatches, message):
    with pytest.raises(ValueError, match=message):
        gpipe(stages, microbatches)
