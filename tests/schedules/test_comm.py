"""comm_plan and validate_comm: every registered schedule gets a plan that is proven not to
stall under NCCL's rules; the runtime's naive posting order is shown to stall."""

import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from schedules import (
    Action, CommOp, CommPlan, Group, ScheduleError, comm_plan, get_schedule, gpipe,
    one_f_one_b, schedule_names, transfers, validate_comm,
)
from schedules.registry import schedule_info

A = Action.parse


def _low(name, stages):
    least = getattr(schedule_info(name), "min_microbatches", None)
    return least(stages) if least else 1


def _grid():
    for name in schedule_names():
        for stages in range(2, 9):
            for microbatches in range(_low(name, stages), 4 * stages + 1):
                yield name, stages, microbatches


def test_every_registered_schedule_gets_a_plan_that_validates():
    start = time.perf_counter()
    count = 0
    for name, stages, microbatches in _grid():
        schedule = get_schedule(name, stages, microbatches)
        plan = comm_plan(schedule)
        assert plan.strategy == "overlap" and plan.schedule is schedule
        try:
            validate_comm(plan)
        except ScheduleError as error:  # pragma: no cover - the failure names the case
            pytest.fail(f"{name} P={stages} M={microbatches}: {error}")
        count += 1
    assert count >= 6 * 140
    print(f"{count} plans in {time.perf_counter() - start:.1f} s")


def test_literal_plan_for_1f1b_two_stages_two_microbatches():
    plan = comm_plan(one_f_one_b(2, 2))
    assert str(plan).splitlines() == [
        "stage 0: F0 [send F0 -> 1] F1 [send F1 -> 1, recv B0@c1 <- 1 ch1] B0 "
        "[recv B1@c1 <- 1 ch1] B1",
        "stage 1: [recv F0 <- 0] F0@c1 [recv F1 <- 0] B0@c1 [send B0@c1 -> 0 ch1] F1@c1 B1@c1 "
        "[send B1@c1 -> 0 ch1]",
    ]
    fused = plan.stages[0][3]
    assert fused == Group((CommOp("send", 1, A("F1"), 0), CommOp("recv", 1, A("B0@c1"), 1)))
    assert fused.batches() == ((0, (fused.ops[0],)), (1, (fused.ops[1],)))
    assert [str(op) for op in plan.receives(1)] == ["recv F0 <- 0", "recv F1 <- 0"]
    assert [str(op) for op in plan.sends(1)] == ["send B0@c1 -> 0 ch1", "send B1@c1 -> 0 ch1"]
    assert plan.channels == (0, 1)
    assert plan.peers(0) == (1,)
    assert fused.ops[1].key == (A("B0@c1").op, 0, 1)


def test_naive_plan_deadlocks_1f1b_at_two_stages_and_names_the_cycle():
    plan = comm_plan(one_f_one_b(2, 4), strategy="naive")
    with pytest.raises(ScheduleError) as error:
        validate_comm(plan)
    message = str(error.value)
    assert message.startswith("1f1b comm plan (naive): deadlock under NCCL's rules")
    assert ("stage 0 waits in group [send F1 -> 1] for stage 1 to post its receive of F1"
            in message)
    assert ("stage 1 waits in group [send B0@c1 -> 0] for stage 0 to post its receive of B0@c1"
            in message)
    assert "the cycle 0 -> 1 -> 0 never moves" in message
    window = message.splitlines()[1:]
    assert window[0].startswith("stage 0: F0 [send F0 -> 1] F1 >>[send F1 -> 1]")
    assert ">>[send B0@c1 -> 0]" in window[1]


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v"])
@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_naive_plan_fails_every_overlapping_schedule(name, stages):
    with pytest.raises(ScheduleError, match="deadlock|mismatch"):
        validate_comm(comm_plan(get_schedule(name, stages, 2 * stages), strategy="naive"))


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 1), (2, 4), (4, 8), (8, 3)])
def test_naive_plan_passes_gpipe(stages, microbatches):
    validate_comm(comm_plan(gpipe(stages, microbatches), strategy="naive"))


def test_paired_plan_fixes_1f1b_but_not_interleaved_or_zero_bubble_v():
    for name in ("1f1b", "zb-h1"):
        validate_comm(comm_plan(get_schedule(name, 4, 8), strategy="paired"))
    for name in ("interleaved-1f1b", "zb-h2", "zb-v"):
        with pytest.raises(ScheduleError, match="deadlock|mismatch"):
            validate_comm(comm_plan(get_schedule(name, 4, 8), strategy="paired"))


def test_overlap_fuses_sends_with_receives_and_synchronises_less_than_ordered():
    schedule = one_f_one_b(4, 8)
    overlap, ordered = comm_plan(schedule), comm_plan(schedule, strategy="ordered")
    validate_comm(ordered)
    groups = sum(len(overlap.groups(stage)) for stage in range(4))
    assert groups < sum(len(ordered.groups(stage)) for stage in range(4))
    # Steady state on a middle stage: a send and a receive posted as one batch.
    mixed = [g for g in overlap.groups(1) if {op.kind for op in g.ops} == {"send", "recv"}]
    assert len(mixed) >= 4


@st.composite
def _schedules(draw):
    name = draw(st.sampled_from(schedule_names()))
    stages = draw(st.integers(1, 6))
    microbatches = draw(st.integers(1, 14))
    assume(microbatches >= _low(name, stages))
    return get_schedule(name, stages, microbatches)


@settings(max_examples=40, deadline=None)
@given(_schedules(), st.sampled_from(["overlap", "ordered"]))
def test_plans_are_complete(schedule, strategy):
    plan = comm_plan(schedule, strategy=strategy)
    validate_comm(plan)
    assert isinstance(plan, CommPlan)
    wanted = Counter((t.producer, t.source, t.destination) for t in transfers(schedule))
    sent, received = Counter(), Counter()
    for stage, steps in enumerate(plan.stages):
        # The compute order is exactly the schedule's.
        assert tuple(s for s in steps if isinstance(s, Action)) == schedule.order[stage]
        place = {step: index for index, step in enumerate(steps) if isinstance(step, Action)}
        for index, step in enumerate(steps):
            if isinstance(step, Action):
                continue
            assert step.ops
            for op in step.ops:
                assert 0 <= op.channel < 4
                if op.kind == "send":
                    sent[(op.producer, stage, op.peer)] += 1
                    assert place[op.producer] < index  # after its producer
                else:
                    received[(op.producer, op.peer, stage)] += 1
                    consumers = [t.consumer for t in transfers(schedule)
                                 if t.producer == op.producer and t.destination == stage]
                    assert all(index < place[c] for c in consumers)  # before its consumers
        assert list(plan.receives(stage)) == [
            op for step in steps if isinstance(step, Group) for op in step.ops if op.kind == "recv"
        ]
    # Every transfer exactly once on each side (one message per producer and destination).
    assert set(sent) == set(received) == set(wanted)
    assert set(sent.values()) <= {1} and set(received.values()) <= {1}


def _edit(plan, stage, edit):
    stages = [list(steps) for steps in plan.stages]
    stages[stage] = edit(stages[stage])
    return CommPlan(plan.schedule, stages, "edited")


def test_mismatched_channel_order_is_detected():
    plan = comm_plan(gpipe(2, 2), strategy="naive")

    def both_first_in_the_wrong_order(steps):
        swapped = Group((CommOp("recv", 0, A("F1")), CommOp("recv", 0, A("F0"))))
        return [swapped] + [s for s in steps if str(s) not in ("[recv F0 <- 0]", "[recv F1 <- 0]")]

    bad = _edit(plan, 1, both_first_in_the_wrong_order)
    with pytest.raises(ScheduleError) as error:
        validate_comm(bad)
    message = str(error.value)
    assert ("mismatch on channel 0 from stage 0 to stage 1: send number 0 carries F0, but "
            "stage 1's receive number 0 there expects F1") in message
    assert "wrong tensor" in message


def test_a_message_on_the_wrong_channel_is_a_mismatch():
    plan = comm_plan(one_f_one_b(2, 2))

    def recv_f1_on_channel_2(steps):
        return [Group(tuple(CommOp(op.kind, op.peer, op.producer, 2) if str(op) == "recv F1 <- 0"
                            else op for op in step.ops)) if isinstance(step, Group) else step
                for step in steps]

    with pytest.raises(ScheduleError, match="mismatch on channel 0 from stage 0 to stage 1"):
        validate_comm(_edit(plan, 1, recv_f1_on_channel_2))


def _drop(text):
    return lambda steps: [s for s in steps if str(s) != text]


@pytest.mark.parametrize(
    ("stage", "edit", "message"),
    [
        (1, _drop("[recv F1 <- 0]"), r"stage 1 never receives F1 from stage 0, needed at step"),
        (0, _drop("[send F0 -> 1]"), r"stage 0 never sends F0 to stage 1"),
        (1, lambda s: s + [Group((CommOp("recv", 0, A("F1")),))],
         r"stage 1 posts recv F1 <- 0 twice"),
        (0, lambda s: [Group((CommOp("send", 1, A("F1")),))] + s,
         r"stage 0 sends F1 at step 0, before producing it at step"),
        (0, lambda s: s + [Group((CommOp("send", 1, A("F1"), 4),))], r"channel must be 0\.\.3"),
        (0, lambda s: s + [Group((CommOp("send", 0, A("F1")),))], r"peer is the stage itself"),
        (0, lambda s: s + [Group((CommOp("send", 1, A("B1")),))],
         r"no action on stage 1 needs B1 from stage 0"),
        (0, lambda s: [x for x in s if str(x) != "F1"], r"stage 0 computes B0 at step \d+, but the "
         r"schedule's order has F1 there"),
        (0, lambda s: s + ["F9"], r"stage 0 step \d+ must be an Action or a Group, got 'F9'"),
    ],
)
def test_broken_plans_are_named(stage, edit, message):
    plan = comm_plan(one_f_one_b(2, 2))
    with pytest.raises(ScheduleError, match=message):
        validate_comm(_edit(plan, stage, edit))


def test_late_receive_is_named():
    plan = comm_plan(one_f_one_b(2, 2), strategy="naive")

    def late(steps):  # [recv F1 <- 0] moved after F1@c1, which needs it
        texts = [str(s) for s in steps]
        at = texts.index("[recv F1 <- 0]")
        receive = steps.pop(at)
        steps.insert(at + 1, receive)
        return steps

    with pytest.raises(ScheduleError, match=r"stage 1 receives F1 at step \d+, after F1@c1 needs"):
        validate_comm(_edit(plan, 1, late))


def test_plan_and_group_checks():
    with pytest.raises(ValueError, match="at least one op"):
        Group(())
    with pytest.raises(ValueError, match="one step list per stage: expected 2, got 1"):
        CommPlan(one_f_one_b(2, 2), [[]])
    with pytest.raises(ValueError, match=r"unknown strategy 'eager'; expected one of: overlap"):
        comm_plan(one_f_one_b(2, 2), strategy="eager")


def test_single_stage_has_no_messages():
    plan = comm_plan(one_f_one_b(1, 3))
    validate_comm(plan)
    assert plan.stages == one_f_one_b(1, 3).order and plan.channels == ()


def test_deadlock_window_marks_each_stage_in_the_cycle():
    plan = comm_plan(get_schedule("zb-v", 4, 8), strategy="paired")
    with pytest.raises(ScheduleError) as error:
        validate_comm(plan)
    message = str(error.value)
    if "deadlock" in message:
        cycle = re.search(r"the cycle ([\d >-]+) never moves", message).group(1).split(" -> ")
        window = message.splitlines()[1:]
        assert {line.split(":")[0] for line in window} == {f"stage {s}" for s in set(cycle)}
        assert all(">>[" in line for line in window)


def test_a_plan_makes_a_stage_s_arrays_on_its_first_read_only():
    schedule = get_schedule("zb-v", 4, 8)
    plan = comm_plan(schedule)
    assert not any(steps.made for steps in plan.stages)  # building paid for no stage
    ops = plan.stages[2].ops
    assert [steps.made for steps in plan.stages] == [False, False, True, False]
    assert plan.stages[2].ops is ops  # made once
    eager = CommPlan(schedule, tuple(tuple(steps) for steps in plan.stages), "overlap")
    assert all(steps.made for steps in eager.stages)
    assert plan.stages == eager.stages and str(plan) == str(eager)


def test_threads_reading_one_stage_share_its_arrays():
    plan = comm_plan(get_schedule("zb-v", 8, 32))
    with ThreadPoolExecutor(8) as pool:
        read = list(pool.map(lambda _: plan.stages[5].ops, range(16)))
    assert all(ops is read[0] for ops in read)
