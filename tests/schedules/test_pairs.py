"""Overlapped forward-and-backward pairs as data: DualPipeV's with ``overlap``, their text,
their checks, and a comm plan that posts nothing inside a pair and still passes the proof."""

from __future__ import annotations

import re

import pytest

from schedules import (Costs, ScheduleError, comm_plan, get_schedule, one_f_one_b, simulate,
                       validate,
                       validate_comm)
from schedules.action import Op, Schedule
from schedules.plan_steps import PlanSteps


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 2), (2, 4), (2, 7), (3, 6), (4, 11)])
def test_dualpipe_v_pairs_its_steady_state_and_keeps_its_order(stages, microbatches) -> None:
    plain = get_schedule("dualpipe-v", stages, microbatches)
    paired = get_schedule("dualpipe-v", stages, microbatches, overlap=True)
    assert paired.order == plain.order and plain.pairs == ((),) * stages
    for stage, (actions, pairs) in enumerate(zip(paired.order, paired.pairs)):
        # phase 4: two pairs a round (M - 2P + s + 1 rounds); phase 5: one (P - 1 - s)
        assert len(pairs) == 2 * (microbatches - 2 * stages + stage + 1) + stages - 1 - stage
        for start in pairs:
            first, second = actions[start], actions[start + 1]
            assert first.op is Op.F and second.op is Op.B and first.chunk != second.chunk
    validate(paired)
    assert Schedule.parse(str(paired), "dualpipe-v") == paired != plain


def test_a_pair_reads_and_prints_as_f_and_b_joined() -> None:
    text = "stage 0: F0 F1 F0@c1 F2&B0@c1 B0 F1@c1&B1 F2@c1 B1@c1 B2@c1 B2"
    # (not a runnable timetable: read for its form)
    schedule = Schedule.parse(text)
    assert schedule.pairs == ((3, 6),)
    assert str(schedule) == text


@pytest.mark.parametrize(("pairs", "message"), [
    (((0,),), "a pair is a forward and then a backward (B or I), got F0&F1 at position 0"),
    (((3,),), "a pair starts at position 3, expected 0..2"),
    (((1, 2),), "the pairs at 1 and 2 share an action"),
    (((), ()), "one tuple of positions per stage: expected 1, got 2"),
])
def test_a_pair_that_is_not_a_forward_then_a_backward_is_refused(pairs, message) -> None:
    order = Schedule.parse("stage 0: F0 F1 B0 B1").order
    with pytest.raises(ScheduleError, match=re.escape(message)):
        Schedule(1, 2, order, pairs=pairs)


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (2, 9), (3, 6), (4, 8), (4, 13)])
@pytest.mark.parametrize("strategy", ["overlap", "ordered"])
def test_the_comm_plan_posts_nothing_inside_a_pair_and_is_proven(stages, microbatches,
                                                                  strategy) -> None:
    schedule = get_schedule("dualpipe-v", stages, microbatches, overlap=True)
    plan = comm_plan(schedule, strategy)
    validate_comm(plan)
    for stage, steps in enumerate(plan.stages):
        assert isinstance(steps, PlanSteps)
        for start in schedule.pairs[stage]:  # the backward right after its forward
            assert _action_step(steps, start + 1) == _action_step(steps, start) + 1
    # the plain timetable's plan does post inside them: the move is real
    plain = comm_plan(get_schedule("dualpipe-v", stages, microbatches), strategy)
    assert any(_action_step(plain.stages[s], start + 1) != _action_step(plain.stages[s], start) + 1
               for s in range(stages) for start in schedule.pairs[s])


def _action_step(steps: PlanSteps, action: int) -> int:
    """The step index at which action ``action`` of the stage runs."""
    seen = -1
    for at, step in enumerate(steps):
        if not hasattr(step, "ops"):
            seen += 1
            if seen == action:
                return at
    raise AssertionError(f"no action {action}")


@pytest.mark.parametrize(("exchange", "events", "makespan"), [
    # F 4 and B 8, each waiting `exchange` on all-to-alls; F1&B0 a pair
    (0.0, [(0, 4), (4, 8), (8, 16), (16, 24)], 24.0),  # nothing to hide: one after the other
    (1.0, [(0, 4), (4, 7), (7, 14), (14, 22)], 22.0),  # both exchanges hidden
    (3.0, [(0, 4), (4, 5), (5, 12), (12, 20)], 20.0),  # B's 3 under F's 1 of compute: 2 left
])
def test_a_pair_hides_each_ones_exchange_under_the_others_compute(exchange, events,
                                                                   makespan) -> None:
    order = Schedule.parse("stage 0: F0 F1 B0 B1").order
    paired = Schedule(1, 2, order, pairs=((1,),))
    timeline = simulate(paired, costs=Costs(forward=4, backward=8, exchange=exchange))
    assert [(event.start, event.end) for event in timeline.events] == events
    assert timeline.makespan == makespan
    # without the pair the exchanges are waited in full
    assert simulate(Schedule(1, 2, order), costs=Costs(forward=4, backward=8,
                                                       exchange=exchange)).makespan == 24.0


def test_dualpipe_v_pairs_hide_what_the_plain_timetable_waits() -> None:
    costs = Costs.from_stages(forward=1.0, backward=2.0, exchange=0.3)
    plain = simulate(get_schedule("dualpipe-v", 4, 16), costs=costs).makespan
    paired = simulate(get_schedule("dualpipe-v", 4, 16, overlap=True), costs=costs).makespan
    assert paired < 0.9 * plain
    nothing = Costs.from_stages(forward=1.0, backward=2.0)  # a pair also waits for both inputs
    assert simulate(get_schedule("dualpipe-v", 4, 16, overlap=True), costs=nothing).makespan \
        >= simulate(get_schedule("dualpipe-v", 4, 16), costs=nothing).makespan


def test_pairs_that_deadlock_are_refused_by_simulate_and_by_the_proof() -> None:
    order = Schedule.parse("stage 0: F0 B0\nstage 1: F0 B0").order
    paired = Schedule(2, 1, order, pairs=((0,), ()))  # B0 needs what F0 sends on first
    with pytest.raises(ScheduleError, match="the overlapped pairs deadlock the timetable"):
        simulate(paired)
    with pytest.raises(ScheduleError, match="deadlock under NCCL's rules"):
        validate_comm(comm_plan(paired))


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 1), (2, 4), (3, 7), (4, 12)])
def test_combined_1f1b_pairs_every_steady_forward_with_the_backward_after_it(stages,
                                                                             microbatches
                                                                             ) -> None:
    schedule = one_f_one_b(stages, microbatches, overlap=True)
    for stage, (actions, pairs) in enumerate(zip(schedule.order, schedule.pairs)):
        warmup = min(2 * (stages - stage) - 1, microbatches)  # see one_f_one_b
        assert [a.op for a in actions[:warmup]] == [Op.F] * warmup
        assert pairs == tuple(range(warmup, warmup + 2 * (microbatches - warmup), 2))
        for start in pairs:
            forward, backward = actions[start], actions[start + 1]
            assert backward.microbatch == forward.microbatch - warmup
    assert simulate(schedule).peak_activations == tuple(  # twice 1F1B's
        float(min(2 * (stages - stage), microbatches)) for stage in range(stages))
    for strategy in ("overlap", "ordered"):
        validate_comm(comm_plan(schedule, strategy))
    costs = Costs.from_stages(forward=1.0, backward=2.0, exchange=0.3)
    plain = simulate(get_schedule("1f1b", stages, microbatches), costs=costs).makespan
    hidden = simulate(schedule, costs=costs).makespan
    assert hidden < plain if any(schedule.pairs) else hidden == plain
    nothing = Costs.from_stages(forward=1.0, backward=2.0)  # 1F1B's pace without exchanges
    assert simulate(schedule, costs=nothing).makespan == \
        simulate(get_schedule("1f1b", stages, microbatches), costs=nothing).makespan


def test_the_exchange_lanes_split_every_exchange_into_hidden_and_exposed(tmp_path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from schedules import plot_timeline
    from schedules.plot_exchanges import draw_exchanges

    costs = Costs.from_stages(forward=1.0, backward=2.0, exchange=0.4)
    found = {}
    for overlap in (False, True):
        schedule = get_schedule("dualpipe-v", 3, 8, overlap=overlap)
        timeline = simulate(schedule, costs=costs)
        ax = plot_timeline(timeline)
        found[overlap] = draw_exchanges(ax, timeline, schedule, costs)
        ax.get_figure().savefig(tmp_path / f"lanes{overlap}.png")
        plt.close(ax.get_figure())
        assert (tmp_path / f"lanes{overlap}.png").read_bytes().startswith(b"\x89PNG")
    # every forward and full backward waits 0.4 / 2 chunks = 0.2; a W none; I and B alike
    total = 3 * 8 * 2 * 2 * 0.2
    for hidden, exposed in found.values():
        assert hidden + exposed == pytest.approx(total)
    assert found[False][0] == 0.0
    # a pair's two exchanges (0.2 each) hide under the other's compute (0.3 or more)
    pairs = sum(len(p) for p in get_schedule("dualpipe-v", 3, 8, overlap=True).pairs)
    assert found[True][0] == pytest.approx(pairs * 2 * 0.2)

