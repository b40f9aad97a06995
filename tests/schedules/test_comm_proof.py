"""The proof on arrays (``schedules.comm_proof``): yes for every sound plan, no for each kind
of fault, so that ``validate_comm`` names it on the objects."""

from dataclasses import replace

import pytest

from schedules import CommOp, CommPlan, Group, comm_plan, get_schedule
from schedules.comm_proof import plan_is_sound


def _plan(name="zb-v", stages=3, microbatches=5, strategy="overlap"):
    return comm_plan(get_schedule(name, stages, microbatches), strategy)


def _with(plan, stage, steps):
    """``plan`` with stage ``stage``'s steps replaced (as objects, made arrays again)."""
    stages = [tuple(steps_) for steps_ in plan.stages]
    stages[stage] = tuple(steps)
    return CommPlan(plan.schedule, tuple(stages), plan.strategy)


def _first_group(steps, kind):
    return next(at for at, step in enumerate(steps)
                if isinstance(step, Group) and any(op.kind == kind for op in step.ops))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h2", "zb-v"])
@pytest.mark.parametrize("strategy", ["overlap", "ordered"])
def test_sound_plans_are_proven(name, strategy):
    assert plan_is_sound(_plan(name, 4, 8, strategy))


def test_a_forward_only_plan_is_proven():
    from schedules import forward_only
    assert plan_is_sound(comm_plan(forward_only(get_schedule("zb-v", 3, 4))))


def test_the_naive_plan_stalls():
    assert not plan_is_sound(_plan("1f1b", 2, 2, "naive"))


def _edit_op(plan, kind, edit):
    """``plan`` with the first ``kind`` op of stage 1 changed by ``edit(op)``."""
    steps = list(plan.stages[1])
    at = _first_group(steps, kind)
    ops = list(steps[at].ops)
    first = next(n for n, op in enumerate(ops) if op.kind == kind)
    ops[first] = edit(ops[first])
    steps[at] = Group(tuple(ops))
    return _with(plan, 1, steps)


@pytest.mark.parametrize("kind", ["send", "recv"])
@pytest.mark.parametrize("edit", [
    lambda op: replace(op, peer=(op.peer + 1) % 3),
    lambda op: replace(op, channel=3),
    lambda op: replace(op, producer=replace(op.producer, microbatch=op.producer.microbatch + 1)),
    lambda op: replace(op, producer=replace(op.producer, chunk=op.producer.chunk + 1)),
    lambda op: replace(op, kind="recv" if op.kind == "send" else "send"),
], ids=["peer", "channel", "microbatch", "chunk", "kind"])
def test_a_changed_op_is_refused(kind, edit):
    assert not plan_is_sound(_edit_op(_plan(), kind, edit))


@pytest.mark.parametrize("kind", ["send", "recv"])
def test_a_missing_or_doubled_op_is_refused(kind):
    plan = _plan()
    steps = list(plan.stages[1])
    at = _first_group(steps, kind)
    group = steps[at]
    op = next(op for op in group.ops if op.kind == kind)
    rest = tuple(other for other in group.ops if other is not op)
    dropped = steps[:at] + ([Group(rest)] if rest else []) + steps[at + 1:]
    assert not plan_is_sound(_with(plan, 1, dropped))
    doubled = steps[:at] + [Group(group.ops + (op,))] + steps[at + 1:]
    assert not plan_is_sound(_with(plan, 1, doubled))


def test_a_send_before_its_producer_or_a_receive_after_its_consumer_is_refused():
    plan = _plan()
    for kind, shift in (("send", -1), ("recv", +1)):
        steps = list(plan.stages[1])
        at = _first_group(steps, kind)
        group = steps[at]
        op = next(op for op in group.ops if op.kind == kind)
        rest = tuple(other for other in group.ops if other is not op)
        steps[at:at + 1] = [Group(rest)] if rest else []
        # Across the action next to it: before the producer or after the consumer.
        actions = [n for n, step in enumerate(steps) if not isinstance(step, Group)]
        where = max(n for n in actions if n < at) if shift < 0 else \
            min(n for n in actions if n >= at) + 1
        steps.insert(where, Group((op,)))
        assert not plan_is_sound(_with(plan, 1, steps)), kind


def test_two_messages_in_swapped_order_on_one_side_are_refused():
    plan = _plan("1f1b", 2, 3, "ordered")
    steps = list(plan.stages[1])
    receives = [at for at, step in enumerate(steps) if isinstance(step, Group)
                and step.ops[0].kind == "recv"]
    # Swap the ops of stage 1's first two receive groups: same ops, the other order.
    first, second = receives[:2]
    steps[first], steps[second] = steps[second], steps[first]
    swapped = _with(plan, 1, steps)
    assert not plan_is_sound(swapped)


@pytest.mark.parametrize("strategy", ["naive", "paired", "overlap", "ordered"])
def test_the_proof_finds_a_stall_where_the_replay_on_objects_does(strategy):
    from schedules import schedule_names
    from schedules.comm_validate import _replay_comm
    for name in schedule_names():
        for stages in (2, 3, 4):
            try:
                schedule = get_schedule(name, stages, 2 * stages)
            except ValueError:
                continue
            plan = comm_plan(schedule, strategy)
            assert plan_is_sound(plan) == (not _replay_comm(plan)), (name, stages, strategy)
