"""forward_only: the inference timetable, valid on its own and with its comm plan."""

import pytest

from schedules import (
    Action, Op, Schedule, ScheduleError, comm_plan, forward_only, get_schedule,
    interleaved_1f1b, one_f_one_b, schedule_names, validate, validate_comm,
)
from schedules.registry import schedule_info


def test_literal_order_chunk_by_chunk():
    schedule = forward_only(interleaved_1f1b(2, 3))
    assert str(schedule).splitlines() == [
        "stage 0: F0 F1 F2 F0@c2 F1@c2 F2@c2",
        "stage 1: F0@c1 F1@c1 F2@c1 F0@c3 F1@c3 F2@c3",
    ]
    assert schedule.forward_only and schedule.placement == (0, 1, 0, 1)
    assert schedule.name == "interleaved-1f1b forward"


@pytest.mark.parametrize("name", schedule_names())
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_every_registered_placement_validates_with_its_plan(name, stages):
    least = getattr(schedule_info(name), "min_microbatches", None)
    microbatches = max(5, least(stages) if least else 1)
    training = get_schedule(name, stages, microbatches)
    schedule = forward_only(training)
    validate(schedule)
    assert all(a.op is Op.F for actions in schedule.order for a in actions)
    assert sorted(map(str, (a for acts in schedule.order for a in acts))) == sorted(
        str(a) for acts in training.order for a in acts if a.op is Op.F)
    plan = comm_plan(schedule)
    validate_comm(plan)
    assert all(op.channel == 0 for stage in range(stages) for op in plan.receives(stage))


def test_literal_plan():
    plan = comm_plan(forward_only(one_f_one_b(2, 2)))
    assert str(plan).splitlines() == [
        "stage 0: F0 [send F0 -> 1] F1 [send F1 -> 1]",
        "stage 1: [recv F0 <- 0] F0@c1 [recv F1 <- 0] F1@c1",
    ]


def test_validate_rejects_backwards_in_a_forward_only_schedule():
    order = [[Action(Op.F, 0), Action(Op.B, 0)]]
    with pytest.raises(ScheduleError, match="stage 0 runs B0, but a forward-only schedule"):
        validate(Schedule(1, 1, order, forward_only=True))
    with pytest.raises(ScheduleError, match="B0 is missing from stage 0"):
        validate(Schedule(1, 1, [[Action(Op.F, 0)]]))  # a training schedule still needs it
    with pytest.raises(ScheduleError, match="F1 is missing from stage 0"):
        validate(Schedule(1, 2, [[Action(Op.F, 0)]], forward_only=True))
