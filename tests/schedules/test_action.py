"""Op, Action and Schedule: compact text that parses back, and Schedule's own checks."""

from dataclasses import FrozenInstanceError

import pytest

from schedules import Action, Op, Schedule, ScheduleError
from schedules.action import format_order


@pytest.mark.parametrize(
    ("action", "text"),
    [
        (Action(Op.F, 3), "F3"),
        (Action(Op.B, 0), "B0"),
        (Action(Op.I, 3, 1), "I3@c1"),
        (Action(Op.W, 12, 7), "W12@c7"),
        (Action(Op.F, 0, 0), "F0"),
    ],
)
def test_action_prints_compactly(action, text):
    assert str(action) == text
    assert repr(action) == text
    assert f"{[action]}" == f"[{text}]"


@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("chunk", [0, 1, 13])
@pytest.mark.parametrize("microbatch", [0, 7, 1024])
def test_action_text_round_trips(op, chunk, microbatch):
    action = Action(op, microbatch, chunk)
    assert Action.parse(str(action)) == action


def test_parse_reads_an_explicit_chunk_zero_and_surrounding_space():
    assert Action.parse("F3@c0") == Action(Op.F, 3, 0)
    assert Action.parse("  B2@c4\n") == Action(Op.B, 2, 4)


@pytest.mark.parametrize(
    "text", ["", "F", "X3", "f3", "3F", "F-1", "F3@c", "F3@1", "F3@c-1", "F3@c1x", "F3 B4", "F3.0"]
)
def test_parse_rejects_bad_text(text):
    with pytest.raises(ValueError, match="expected an action like 'F3' or 'I3@c1'") as error:
        Action.parse(text)
    assert repr(text) in str(error.value)


def test_action_is_frozen_and_hashable():
    action = Action(Op.F, 1, 2)
    with pytest.raises(FrozenInstanceError):
        action.microbatch = 2  # type: ignore[misc]
    assert {action, Action(Op.F, 1, 2)} == {action}
    assert Action(Op.F, 1) != Action(Op.B, 1)
    assert Action(Op.F, 1) == Action(Op.F, 1, 0)


def _two_stage(order_text, placement=()):
    order = [[Action.parse(text) for text in line.split()] for line in order_text]
    return Schedule(len(order), 2, order, placement=placement)


def test_schedule_defaults_one_chunk_per_stage_and_freezes_the_order():
    schedule = _two_stage(["F0 F1 B0 B1", "F0@c1 F1@c1 B0@c1 B1@c1"])
    assert schedule.placement == (0, 1)
    assert schedule.chunks == 2
    assert schedule.chunks_of_stage == ((0,), (1,))
    assert isinstance(schedule.order, tuple) and isinstance(schedule.order[0], tuple)
    assert schedule.name == "custom"
    assert str(schedule) == "stage 0: F0 F1 B0 B1\nstage 1: F0@c1 F1@c1 B0@c1 B1@c1"


def test_schedule_with_several_chunks_per_stage():
    schedule = _two_stage(
        ["F0 F1 F0@c2 F1@c2 B0@c2 B1@c2 B0 B1", "F0@c1 F1@c1 F0@c3 F1@c3 B0@c3 B1@c3 B0@c1 B1@c1"],
        placement=(0, 1, 0, 1),
    )
    assert schedule.chunks == 4
    assert schedule.chunks_of_stage == ((0, 2), (1, 3))


def test_split_backward_and_backward_op():
    schedule = _two_stage(["F0 F1 I0 W0 B1", "F0@c1 F1@c1 I0@c1 B1@c1 W0@c1"])
    assert schedule.split_backward == {(0, 0), (0, 1)}
    assert schedule.backward_op(0, 1) is Op.I
    assert schedule.backward_op(1, 1) is Op.B


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stages": 0, "microbatches": 1, "order": ()}, "stages >= 1, got stages=0"),
        ({"stages": 1, "microbatches": 0, "order": ((),)}, "microbatches >= 1, got microbatches=0"),
        ({"stages": 2, "microbatches": 1, "order": ((),)}, "expected 2, got 1"),
        (
            {"stages": 2, "microbatches": 1, "order": ((), ()), "placement": (0, 2)},
            "stages 0..1, got stage 2",
        ),
        (
            {"stages": 2, "microbatches": 1, "order": ((), ()), "placement": (0, 0)},
            "leaves stage 1 without a model chunk",
        ),
    ],
)
def test_schedule_rejects_inconsistent_shapes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Schedule(**kwargs)


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


def test_format_order_marks_the_position_and_shows_a_window():
    schedule = Schedule(
        2, 20, [[Action(Op.F, m) for m in range(20)], [Action(Op.F, m, 1) for m in range(20)]]
    )
    text = format_order(schedule, around=(1, 10), width=2)
    assert text.splitlines() == [
        "stage 0: ... F8 F9 F10 F11 F12",
        "stage 1: ... F8@c1 F9@c1 [F10@c1] F11@c1 F12@c1",
    ]
    assert format_order(schedule, around=(0, 1), width=1).splitlines()[0] == "stage 0: F0 [F1] F2"


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (("F", 3), TypeError, r"op must be an Op member .*got 'F' \(str\); for text use Action.parse"),
        ((Op.F, "3"), TypeError, r"microbatch must be an int >= 0, got '3' \(str\)"),
        ((Op.F, 3, "1"), TypeError, r"chunk must be an int >= 0, got '1' \(str\)"),
        ((Op.F, 3.0), TypeError, r"microbatch must be an int >= 0, got 3.0 \(float\)"),
        ((Op.F, True), TypeError, r"microbatch must be an int >= 0, got True \(bool\)"),
        ((Op.F, -1), ValueError, r"microbatch must be an int >= 0, got -1"),
        ((Op.F, 0, -2), ValueError, r"chunk must be an int >= 0, got -2"),
    ],
)
def test_action_rejects_bad_fields_saying_expected_and_given(args, error, message):
    with pytest.raises(error, match=message):
        Action(*args)


def test_action_accepts_integer_likes_and_stores_ints():
    numpy = pytest.importorskip("numpy")
    action = Action(Op.I, numpy.int64(3), numpy.int32(1))
    assert action == Action(Op.I, 3, 1) and type(action.microbatch) is int
    assert str(action) == "I3@c1"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"stages": 1, "microbatches": 1, "order": (("F0",),)}, TypeError,
         r"order\[0\]\[0\] must be an Action, got 'F0' \(str\); build one with"),
        ({"stages": 2, "microbatches": 1, "order": ((Action(Op.F, 0),), (None,))}, TypeError,
         r"order\[1\]\[0\] must be an Action, got None"),
        ({"stages": "2", "microbatches": 1, "order": ((), ())}, TypeError,
         r"stages as an int >= 1, got '2' \(str\)"),
        ({"stages": 1, "microbatches": 1.5, "order": ((),)}, TypeError,
         r"microbatches as an int >= 1, got 1.5"),
        ({"stages": 1, "microbatches": 1, "order": ((),), "forward_only": "yes"}, TypeError,
         r"forward_only must be a bool, got 'yes'"),
    ],
)
def test_schedule_rejects_wrong_types(kwargs, error, message):
    with pytest.raises(error, match=message):
        Schedule(**kwargs)


def test_schedule_is_training_by_default():
    assert _two_stage(["F0 F1 B0 B1", "F0@c1 F1@c1 B0@c1 B1@c1"]).forward_only is False
