"""Interleaved 1F1B: literal timetables, chunk placement, the bubble time 1F1B's / v, memory."""

import math

import pytest

from schedules import (
    get_schedule, interleaved_1f1b, one_f_one_b, simulate, transfers, validate,
)

GRID = [(p, m) for p in range(2, 9) for m in range(p, 4 * p + 1)]
CHUNKS = (2, 3, 4)


def _idle_per_stage(timeline, microbatches):
    # Every stage does 3M units of work (F = 1, B = I + W = 2 per full stage).
    return timeline.makespan - 3 * microbatches


def test_timetable_for_two_stages_four_microbatches_two_chunks():
    assert str(interleaved_1f1b(stages=2, microbatches=4, chunks_per_stage=2)) == (
        "stage 0: F0 F1 F0@c2 F1@c2 F2 B0@c2 F3 B1@c2 F2@c2 B0 F3@c2 B1 B2@c2 B3@c2 B2 B3\n"
        "stage 1: F0@c1 F1@c1 F0@c3 B0@c3 F1@c3 B1@c3 F2@c1 B0@c1 F3@c1 B1@c1 F2@c3 B2@c3 "
        "F3@c3 B3@c3 B2@c1 B3@c1"
    )


def test_timetable_with_microbatches_not_a_multiple_of_stages():
    # M = 3, P = 2: one group of 3 micro-batches, so chunk 2 never waits for chunk 1.
    assert str(interleaved_1f1b(stages=2, microbatches=3, chunks_per_stage=2)) == (
        "stage 0: F0 F1 F2 F0@c2 F1@c2 F2@c2 B0@c2 B1@c2 B2@c2 B0 B1 B2\n"
        "stage 1: F0@c1 F1@c1 F2@c1 F0@c3 B0@c3 F1@c3 B1@c3 F2@c3 B2@c3 B0@c1 B1@c1 B2@c1"
    )


def test_one_chunk_per_stage_is_1f1b():
    for stages, microbatches in [(1, 3), (3, 4), (4, 2), (5, 12)]:
        schedule = interleaved_1f1b(stages, microbatches, chunks_per_stage=1)
        assert schedule.order == one_f_one_b(stages, microbatches).order
        assert schedule.name == "interleaved-1f1b"


def test_placement_and_name():
    schedule = interleaved_1f1b(stages=3, microbatches=6, chunks_per_stage=4)
    assert schedule.placement == tuple(chunk % 3 for chunk in range(12))
    assert schedule.chunks_of_stage[1] == (1, 4, 7, 10)
    assert (schedule.stages, schedule.microbatches, schedule.name) == (3, 6, "interleaved-1f1b")


@pytest.mark.parametrize("chunks", CHUNKS)
def test_valid_over_the_grid_and_never_slower_than_1f1b(chunks):
    for stages, microbatches in GRID:
        schedule = interleaved_1f1b(stages, microbatches, chunks)
        validate(schedule)
        ours = simulate(schedule, forward=1, backward=1, weight=1)
        theirs = simulate(one_f_one_b(stages, microbatches), forward=1, backward=1, weight=1)
        assert ours.makespan <= theirs.makespan + 1e-9, f"P={stages} M={microbatches}"


@pytest.mark.parametrize("stages", [1, 2, 3, 5, 8])
def test_valid_for_one_stage_and_fewer_microbatches_than_stages(stages):
    for microbatches in range(1, stages + 2):
        for chunks in (1, 2, 3):
            validate(interleaved_1f1b(stages, microbatches, chunks))


@pytest.mark.parametrize("chunks", CHUNKS)
def test_bubble_time_is_1f1b_divided_by_chunks_when_m_is_a_multiple_of_p(chunks):
    for stages, microbatches in GRID:
        if microbatches % stages:
            continue
        ours = simulate(interleaved_1f1b(stages, microbatches, chunks), 1, 1, weight=1)
        theirs = simulate(one_f_one_b(stages, microbatches), 1, 1, weight=1)
        expected = _idle_per_stage(theirs, microbatches) / chunks
        assert expected == 3 * (stages - 1) / chunks
        assert math.isclose(_idle_per_stage(ours, microbatches), expected, rel_tol=1e-9), (
            f"P={stages} M={microbatches} v={chunks}"
        )


def test_bubble_fraction_at_four_stages_eight_microbatches():
    ours = simulate(interleaved_1f1b(4, 8, chunks_per_stage=2), forward=1, backward=1, weight=1)
    theirs = simulate(one_f_one_b(4, 8), forward=1, backward=1, weight=1)
    assert round(ours.bubble_fraction, 3) == 0.158
    assert round(theirs.bubble_fraction, 3) == 0.273


@pytest.mark.parametrize("chunks", CHUNKS)
def test_peak_activations_follow_the_warmup(chunks):
    # Stage s runs (v-1) P + 2(P-1-s) forwards, then one more before its first backward;
    # a chunk's activations count 1/v of a stage's.
    for stages, microbatches in GRID:
        if microbatches % stages:
            continue
        timeline = simulate(interleaved_1f1b(stages, microbatches, chunks))
        expected = tuple(
            round(min((chunks - 1) * stages + 2 * (stages - 1 - s) + 1, chunks * microbatches)
                  / chunks, 9)
            for s in range(stages)
        )
        assert timeline.peak_activations == expected, f"P={stages} M={microbatches}"


def test_each_microbatch_crosses_stages_v_times_as_often():
    for stages, microbatches, chunks in [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 3)]:
        ours = transfers(interleaved_1f1b(stages, microbatches, chunks))
        theirs = transfers(one_f_one_b(stages, microbatches))
        # Each of the vP - 1 chunk boundaries is crossed by one activation and one gradient.
        assert len(ours) == 2 * (chunks * stages - 1) * microbatches
        assert len(theirs) == 2 * (stages - 1) * microbatches


def test_get_schedule_by_name():
    expected = interleaved_1f1b(4, 8, chunks_per_stage=3)
    assert get_schedule("interleaved-1f1b", 4, 8, chunks_per_stage=3) == expected
    assert get_schedule("Interleaved_1F1B", 4, 8) == interleaved_1f1b(4, 8)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((0, 4, 2), "stages must be >= 1, got stages=0"),
        ((2, 0, 2), "microbatches must be >= 1, got microbatches=0"),
        ((2, 4, 0), "chunks_per_stage must be >= 1, got chunks_per_stage=0"),
        ((2, 4, -3), "chunks_per_stage must be >= 1, got chunks_per_stage=-3"),
        ((2, 4, "2"), "chunks_per_stage must be an int >= 1, got '2'"),
        ((2, 4, True), "chunks_per_stage must be an int >= 1, got True"),
        ((2, 4, 2.0), "chunks_per_stage must be an int >= 1, got 2.0"),
    ],
)
def test_bad_arguments_raise_value_error(arguments, message):
    with pytest.raises(ValueError, match=message):
        interleaved_1f1b(*arguments)
