"""zb with max_inflight: ZB-H1 at k = P, ZB-H2 from 2P-1, a memory/bubble frontier between."""

import pytest

from schedules import (get_schedule, simulate, validate, zero_bubble_capped, zero_bubble_h1,
                       zero_bubble_h2)

SWEEP = [(p, m) for p in range(4, 17) for m in (2 * p, 4 * p)]


def test_default_and_k_equal_p_is_zb_h1():
    for stages, microbatches in SWEEP + [(1, 1), (3, 2), (5, 5)]:
        h1 = zero_bubble_h1(stages, microbatches)
        theirs = simulate(h1, forward=1, backward=1, weight=1)
        for schedule in (zero_bubble_capped(stages, microbatches),
                         get_schedule("zb", stages, microbatches, max_inflight=stages)):
            assert schedule.order == h1.order
            ours = simulate(schedule, forward=1, backward=1, weight=1)
            assert ours.bubble_fraction == theirs.bubble_fraction
            assert ours.peak_activations == theirs.peak_activations


def test_from_2p_minus_1_it_is_zb_h2():
    for stages in range(1, 9):
        for microbatches in range(1, 3 * stages):
            for cap in (2 * stages - 1, 3 * stages):
                schedule = zero_bubble_capped(stages, microbatches, max_inflight=cap)
                assert schedule.order == zero_bubble_h2(stages, microbatches).order


def test_every_cap_is_valid_and_held_and_the_frontier_falls():
    for stages in range(2, 9):
        for microbatches in (stages, 2 * stages, 4 * stages):
            bubbles = []
            for cap in range(stages, 2 * stages):
                schedule = zero_bubble_capped(stages, microbatches, max_inflight=cap)
                validate(schedule)
                peaks = simulate(schedule).peak_activations
                extra = max(0, min(cap - stages, microbatches - stages))
                assert peaks == (min(stages + extra, microbatches),) * stages
                # W costing half an F: the extra memory fills the cool-down.
                timeline = simulate(schedule, forward=1, backward=1, weight=0.5)
                bubbles.append(timeline.bubble_fraction)
            assert bubbles == sorted(bubbles, reverse=True), (stages, microbatches)
            if microbatches > stages:
                assert bubbles[-1] < bubbles[0]


@pytest.mark.parametrize(("cap", "message"), [
    (3, "max_inflight must be >= stages: expected at least 4 .*got max_inflight=3"),
    (4.0, "max_inflight must be an int >= stages, got 4.0"),
    (True, "max_inflight must be an int >= stages, got True"),
])
def test_bad_cap(cap, message):
    with pytest.raises(ValueError, match=message):
        zero_bubble_capped(4, 8, max_inflight=cap)
