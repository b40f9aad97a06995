"""Events: a simulated timeline's events stored as arrays read as the tuple of Events they hold."""

import pickle
from array import array

import pytest

from schedules import Timeline, simulate, zero_bubble_v
from schedules.events import Event, Events, StageColumns


def _simulated() -> Timeline:
    return simulate(zero_bubble_v(stages=3, microbatches=4), forward=1.0, backward=2.0,
                    weight=1.0, comm=0.5)


def test_simulated_events_are_arrays_that_read_as_a_tuple_of_events():
    timeline = _simulated()
    events = timeline.events
    assert isinstance(events, Events) and isinstance(events, tuple)
    plain = tuple(events)
    assert all(type(event) is Event for event in plain)
    assert len(events) == len(plain) == 3 * 4 * 2 * 3  # stages x micro-batches x chunks x F/I/W
    assert events == plain and plain == events and not events != plain
    assert events[0] == plain[0] and events[-1] == plain[-1] and events[5:9] == plain[5:9]
    assert list(reversed(events)) == list(reversed(plain))
    assert hash(events) == hash(plain)
    assert repr(events) == repr(plain)
    assert plain[7] in events and events.index(plain[7]) == 7 and events.count(plain[7]) == 1
    with pytest.raises(IndexError):
        events[len(plain)]


def test_events_run_stage_after_stage_each_in_its_order():
    timeline = _simulated()
    stages = [event.stage for event in timeline.events]
    assert stages == sorted(stages)
    for stage in range(timeline.stages):
        starts = [event.start for event in timeline.stage_events(stage)]
        assert starts == sorted(starts)
        assert timeline.stage_order(stage) == tuple(
            event.action for event in timeline.stage_events(stage))


def test_figures_on_arrays_equal_the_figures_on_events():
    timeline = _simulated()
    plain = Timeline(timeline.stages, tuple(timeline.events), timeline.chunks_per_stage)
    assert not isinstance(plain.events, Events)
    for figure in ("start", "makespan", "busy", "idle", "bubble_fraction", "peak_activations"):
        assert getattr(timeline, figure) == getattr(plain, figure), figure
    for stage in range(timeline.stages):
        assert timeline.stage_events(stage) == plain.stage_events(stage)


def test_equal_replays_are_equal_timelines_and_other_costs_are_not():
    assert _simulated() == _simulated()
    schedule = zero_bubble_v(stages=3, microbatches=4)
    assert simulate(schedule, forward=1.0) != simulate(schedule, forward=2.0)


def test_events_pickle_and_a_timeline_keeps_them_compact():
    timeline = _simulated()
    again = pickle.loads(pickle.dumps(timeline))
    assert isinstance(again.events, Events)
    assert again == timeline and again.makespan == timeline.makespan


def test_stage_columns_need_one_start_and_end_per_action():
    order = zero_bubble_v(stages=1, microbatches=1).orders[0]
    with pytest.raises(ValueError, match="as many starts and ends as actions"):
        StageColumns(order, array("d", [0.0]), array("d", [1.0]))
