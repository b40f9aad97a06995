"""pipeline.predict.contention: stages slowed by computing at once, and the step that follows."""

from __future__ import annotations

import pytest

from pipeline.predict.contention import contended, others_computing
from schedules import Action, Costs, Event, Op, Timeline, get_schedule, simulate
from dist_harness import run_ranks
from predict_workers import predict_contention


def _timeline(events: list[tuple[int, float, float]]) -> Timeline:
    return Timeline(stages=2, events=tuple(
        Event(stage, Action(Op.F, index, stage), start, end)
        for index, (stage, start, end) in enumerate(events)))


def test_others_computing_is_the_share_of_busy_time_beside_another_stage() -> None:
    # stage 0 busy 0..4; stage 1 busy 2..6 and 8..10: they overlap from 2 to 4
    timeline = _timeline([(0, 0.0, 4.0), (1, 2.0, 6.0), (1, 8.0, 10.0)])
    assert others_computing(timeline) == pytest.approx((2.0 / 4.0, 2.0 / 6.0))


def test_back_to_back_events_do_not_overlap() -> None:
    timeline = _timeline([(0, 0.0, 1.0), (1, 1.0, 2.0), (0, 2.0, 3.0)])
    assert others_computing(timeline) == (0.0, 0.0)


def test_no_contention_keeps_the_costs() -> None:
    schedule = get_schedule("1f1b", stages=2, microbatches=8)
    costs = Costs(forward=[1.0, 1.0], backward=[2.0, 2.0])
    kept, timeline = contended(costs, schedule, [1.0, 1.01])
    assert kept is costs
    assert timeline.makespan == simulate(schedule, costs=costs).makespan


def test_contention_slows_each_stage_by_its_overlapped_share() -> None:
    schedule = get_schedule("gpipe", stages=2, microbatches=16)
    costs = Costs(forward=[1.0, 1.0], backward=[2.0, 2.0])
    alone = simulate(schedule, costs=costs)
    slowed_costs, timeline = contended(costs, schedule, [2.0, 2.0])
    share = others_computing(timeline)
    for stage in range(2):
        # Fixed point: each stage's compute is 1 + (2 - 1) x its overlapped share longer.
        expected = alone.busy[stage] * (1.0 + share[stage])
        assert timeline.busy[stage] == pytest.approx(expected, rel=0.05)
        assert 0.8 < share[stage] < 1.0  # GPipe at M=16: stages overlap most of the time
    assert timeline.makespan > 1.6 * alone.makespan


def test_predict_measures_one_factor_per_stage_the_same_on_every_rank() -> None:
    results = run_ranks(predict_contention, 2)
    factors = [r["contention"] for r in results]
    assert factors[0] == factors[1] and len(factors[0]) == 2
    assert all(0.2 < f < 20.0 for f in factors[0]), factors
    assert results[0]["makespan"] == results[1]["makespan"]
