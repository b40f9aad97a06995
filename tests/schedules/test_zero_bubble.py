"""Zero-bubble schedules ZB-H1, ZB-H2 and ZB-V: timetables, bounds reached, memory held."""

import itertools
import math

import matplotlib

matplotlib.use("Agg")  # files only, never a window

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402

from schedules import (  # noqa: E402
    Action, Op, Schedule, ScheduleError, get_schedule, one_f_one_b, plot_timeline, simulate,
    validate, zero_bubble_h1, zero_bubble_h2, zero_bubble_v,
)
from schedules.plot import OP_COLOURS  # noqa: E402

GRID = [(p, m) for p in range(2, 9) for m in range(p, 4 * p + 1)]
GENERATORS = {"zb-h1": zero_bubble_h1, "zb-h2": zero_bubble_h2, "zb-v": zero_bubble_v}


def _equal_costs(schedule, weight=1.0):
    """F = I = W = 1 per full stage (a chunk of a V stage costs half), no comm."""
    return simulate(schedule, forward=1, backward=1, weight=weight)


def _peak_1f1b(stages, microbatches):
    return max(simulate(one_f_one_b(stages, microbatches)).peak_activations)


# Literal timetables


def test_h1_timetable_for_three_stages_four_microbatches():
    # Stage s runs W(m) right after I(m + s): the later the stage, the later its Ws.
    assert str(zero_bubble_h1(stages=3, microbatches=4)) == (
        "stage 0: F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3\n"
        "stage 1: F0@c1 F1@c1 I0@c1 F2@c1 I1@c1 W0@c1 F3@c1 I2@c1 W1@c1 I3@c1 W2@c1 W3@c1\n"
        "stage 2: F0@c2 I0@c2 F1@c2 I1@c2 F2@c2 I2@c2 W0@c2 F3@c2 I3@c2 W1@c2 W2@c2 W3@c2"
    )


def test_h1_timetable_for_one_stage():
    assert str(zero_bubble_h1(stages=1, microbatches=2)) == "stage 0: F0 I0 W0 F1 I1 W1"


def test_h2_timetable_for_two_stages_three_microbatches():
    assert str(zero_bubble_h2(stages=2, microbatches=3)) == (
        "stage 0: F0 F1 F2 I0 W0 I1 W1 I2 W2\n"
        "stage 1: F0@c1 I0@c1 F1@c1 I1@c1 F2@c1 I2@c1 W0@c1 W1@c1 W2@c1"
    )


def test_v_timetable_for_three_stages_three_microbatches():
    assert str(zero_bubble_v(stages=3, microbatches=3)) == (
        "stage 0: F0 F1 F2 F0@c5 I0@c5 F1@c5 I1@c5 F2@c5 I2@c5 I0 W0@c5 I1 W1@c5 I2 W2@c5 "
        "W0 W1 W2\n"
        "stage 1: F0@c1 F1@c1 F2@c1 F0@c4 F1@c4 I0@c4 F2@c4 I1@c4 I0@c1 I2@c4 I1@c1 W0@c4 "
        "I2@c1 W1@c4 W0@c1 W2@c4 W1@c1 W2@c1\n"
        "stage 2: F0@c2 F0@c3 F1@c2 F1@c3 F2@c2 F2@c3 I0@c3 I0@c2 I1@c3 I1@c2 I2@c3 I2@c2 "
        "W0@c3 W0@c2 W1@c3 W1@c2 W2@c3 W2@c2"
    )


# Shape: names, placement, every backward split


@pytest.mark.parametrize("name", GENERATORS)
def test_name_and_get_schedule(name):
    schedule = GENERATORS[name](4, 8)
    assert schedule.name == name
    assert get_schedule(name, 4, 8) == schedule
    assert get_schedule(name.upper().replace("-", "_"), 4, 8) == schedule


def test_placement():
    assert zero_bubble_h1(4, 8).placement == (0, 1, 2, 3)
    assert zero_bubble_h2(4, 8).placement == (0, 1, 2, 3)
    schedule = zero_bubble_v(4, 8)
    assert schedule.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.chunks_of_stage == ((0, 7), (1, 6), (2, 5), (3, 4))


@pytest.mark.parametrize("name", GENERATORS)
def test_valid_over_the_grid(name):
    for stages, microbatches in GRID:
        validate(GENERATORS[name](stages, microbatches))


@pytest.mark.parametrize("name", GENERATORS)
def test_valid_for_one_stage_and_few_microbatches_within_1f1b_memory(name):
    for stages in range(1, 9):
        for microbatches in range(1, stages + 1):
            schedule = GENERATORS[name](stages, microbatches)
            validate(schedule)
            peak = max(simulate(schedule).peak_activations)
            assert peak <= _peak_1f1b(stages, microbatches), f"P={stages} M={microbatches}"


def test_validate_knows_the_split_backward_dependencies():
    schedule = zero_bubble_h1(2, 2)
    swapped = list(schedule.order[0])
    first_i, first_w = swapped.index(Action(Op.I, 0)), swapped.index(Action(Op.W, 0))
    swapped[first_i], swapped[first_w] = swapped[first_w], swapped[first_i]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(Schedule(2, 2, (swapped, schedule.order[1]), name="zb-h1"))
    # A V chunk run by the wrong stage is caught by the placement check.
    v = zero_bubble_v(2, 2)
    moved = (v.order[0] + (Action(Op.F, 0, 2),), v.order[1][1:])
    with pytest.raises(ScheduleError, match="chunk 2 lives on stage 1"):
        validate(Schedule(2, 2, moved, v.placement, name="zb-v"))


# ZB-H1


def test_h1_reaches_the_ramp_up_bound_over_the_grid():
    for stages, microbatches in GRID:
        timeline = _equal_costs(zero_bubble_h1(stages, microbatches))
        case = f"P={stages} M={microbatches}"
        assert timeline.makespan == 3 * microbatches + stages - 1, case
        assert math.isclose(
            timeline.bubble_fraction, (stages - 1) / (3 * microbatches + stages - 1), rel_tol=1e-12
        ), case
        assert math.isclose(timeline.bubble_fraction, timeline.bubble_bound, rel_tol=1e-12), case


def test_h1_bubble_is_a_third_of_1f1b():
    for stages, microbatches in [(4, 8), (8, 16)]:
        ours = _equal_costs(zero_bubble_h1(stages, microbatches))
        theirs = _equal_costs(one_f_one_b(stages, microbatches))
        idle, idle_1f1b = ours.idle[0], theirs.idle[0]
        assert idle == stages - 1 and idle_1f1b == 3 * (stages - 1)
    assert round(_equal_costs(zero_bubble_h1(4, 8)).bubble_fraction, 3) == 0.111


def test_h1_holds_1f1b_peak_on_every_stage():
    # The peak of 1F1B (its stage 0's, min(P, M)) on every stage; see the next test for
    # why stage s cannot keep 1F1B's own min(P - s, M) and still reach the bound.
    for stages, microbatches in GRID:
        timeline = simulate(zero_bubble_h1(stages, microbatches))
        expected = min(stages, microbatches)
        assert expected == _peak_1f1b(stages, microbatches)
        assert timeline.peak_activations == (expected,) * stages, f"P={stages} M={microbatches}"


def _orders_within(stage, microbatches, limit):
    """Every order of one stage's F, I, W (one chunk) holding at most ``limit`` at once."""
    actions = [Action(op, m, stage) for m in range(microbatches) for op in (Op.F, Op.I, Op.W)]
    for order in itertools.permutations(actions):
        done, held = set(), 0
        for action in order:
            before = {Op.F: None, Op.I: Op.F, Op.W: Op.I}[action.op]
            if before is not None and (before, action.microbatch) not in done:
                break
            held += {Op.F: 1, Op.I: 0, Op.W: -1}[action.op]
            if held > limit:
                break
            done.add((action.op, action.microbatch))
        else:
            yield order


def test_no_schedule_reaches_the_bound_with_1f1b_memory_per_stage():
    # P = M = 2, every order with 1F1B's memory (2 on stage 0, 1 on stage 1): the best
    # makespan is 8 > 7 = the bound. ZB-H1 lets stage 1 hold 2 and reaches 7.
    bound = _equal_costs(zero_bubble_h1(2, 2)).makespan_bound
    makespans = []
    for first in _orders_within(0, 2, limit=2):
        for second in _orders_within(1, 2, limit=1):
            try:
                makespans.append(_equal_costs(Schedule(2, 2, (first, second))).makespan)
            except ScheduleError:  # the stages take the micro-batches in different orders
                continue
    assert (bound, min(makespans)) == (7, 8)
    assert _equal_costs(zero_bubble_h1(2, 2)).makespan == 7


# ZB-H2


def test_h2_is_h1_when_there_is_nothing_more_to_fill():
    for stages in range(1, 9):
        for microbatches in range(1, stages + 1):
            assert zero_bubble_h2(stages, microbatches).order == \
                zero_bubble_h1(stages, microbatches).order


def test_h2_reaches_the_bound_with_equal_costs_and_beats_h1_with_cheaper_w():
    for stages, microbatches in GRID:
        case = f"P={stages} M={microbatches}"
        schedule = zero_bubble_h2(stages, microbatches)
        equal = _equal_costs(schedule)
        assert math.isclose(equal.bubble_fraction, equal.bubble_bound, rel_tol=1e-12), case
        cheap_w = _equal_costs(schedule, weight=0.5)
        h1 = _equal_costs(zero_bubble_h1(stages, microbatches), weight=0.5)
        if microbatches > stages:
            assert cheap_w.makespan < h1.makespan, case
        else:
            assert cheap_w.makespan == h1.makespan, case
        if microbatches >= 2 * stages - 1:
            assert math.isclose(cheap_w.makespan, cheap_w.makespan_bound, rel_tol=1e-12), case
            assert cheap_w.makespan == stages - 1 + 2.5 * microbatches, case


def test_h2_figures_at_four_stages_eight_microbatches():
    h2 = _equal_costs(zero_bubble_h2(4, 8), weight=0.5)
    h1 = _equal_costs(zero_bubble_h1(4, 8), weight=0.5)
    assert (round(h2.bubble_fraction, 3), round(h1.bubble_fraction, 3)) == (0.130, 0.184)


def test_h2_holds_at_most_twice_1f1b_peak():
    for stages, microbatches in GRID:
        extra = min(stages - 1, microbatches - stages)
        peaks = simulate(zero_bubble_h2(stages, microbatches)).peak_activations
        assert peaks == (min(stages + extra, microbatches),) * stages
        assert max(peaks) <= 2 * _peak_1f1b(stages, microbatches)


# ZB-V


def test_v_reaches_the_ramp_up_bound_over_the_grid():
    for stages, microbatches in GRID:
        timeline = _equal_costs(zero_bubble_v(stages, microbatches))
        case = f"P={stages} M={microbatches}"
        ramp = (stages - 1) / 2  # the first micro-batch crossing P-1 half-stage chunks
        assert timeline.makespan == 3 * microbatches + ramp, case
        assert math.isclose(timeline.bubble_fraction, timeline.bubble_bound, rel_tol=1e-12), case
        assert math.isclose(
            timeline.bubble_fraction, ramp / (3 * microbatches + ramp), rel_tol=1e-12
        ), case


def test_v_bubble_figures():
    assert round(_equal_costs(zero_bubble_v(4, 8)).bubble_fraction, 3) == 0.059
    assert round(_equal_costs(zero_bubble_v(8, 16)).bubble_fraction, 3) == 0.068


def test_v_holds_at_most_1f1b_peak():
    # Asserted: no stage holds more than 1F1B's peak, max over stages (its stage 0's),
    # two half-size chunk activations counting as one.
    for stages, microbatches in GRID:
        peaks = simulate(zero_bubble_v(stages, microbatches)).peak_activations
        assert max(peaks) <= _peak_1f1b(stages, microbatches), f"P={stages} M={microbatches}"
    assert simulate(zero_bubble_v(4, 8)).peak_activations == (4.0, 4.0, 4.0, 4.0)


# Drawing


def test_plot_shows_i_and_w_in_their_own_colours():
    axes = plot_timeline(_equal_costs(zero_bubble_v(2, 3)))
    colours = {tuple(c[:3]) for collection in axes.collections for c in collection.get_facecolors()}
    colours |= {tuple(patch.get_facecolor()[:3]) for patch in axes.patches}
    input_colour, weight_colour = to_rgb(OP_COLOURS[Op.I]), to_rgb(OP_COLOURS[Op.W])
    assert input_colour != weight_colour
    assert input_colour in colours and weight_colour in colours
    plt.close("all")
