"""1F1B: literal timetables and its phases (bubble, makespan, min(P - s, M) memory:
test_generators)."""

import pytest

from schedules import Op, gpipe, one_f_one_b

STAGES = range(1, 9)


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
