"""GPipe: the literal timetable and its fields (bubble, makespan, memory: test_generators)."""

from schedules import Action, Op, gpipe


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
