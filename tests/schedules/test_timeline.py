"""Timeline: idle, bubble, makespan, peak activations and the Chrome trace, on known numbers."""

import json
import math
import random
from pathlib import Path

import pytest

import schedules.timeline as timeline_module
from schedules import (
    Action, Event, MemoryTrace, Timeline, one_f_one_b, simulate, zero_bubble_v,
)

A = Action.parse

# Stage 0 busy 6 of 9, stage 1 busy 6 of 9: idle 3 each, bubble 6 / 18.
HAND_BUILT = [
    (0, "F0", 0, 1), (0, "F1", 1, 2), (0, "B0", 5, 7), (0, "B1", 7, 9),
    (1, "F0@c1", 2, 3), (1, "B0@c1", 3, 5), (1, "F1@c1", 5, 6), (1, "B1@c1", 6, 8),
]


def _timeline(rows, offset=0.0, **kwargs):
    events = [Event(stage, A(text), start + offset, end + offset)
              for stage, text, start, end in rows]
    random.Random(0).shuffle(events)  # a Timeline keeps events in no particular order
    return Timeline(stages=1 + max(row[0] for row in rows), events=events, **kwargs)


def test_figures_of_a_hand_built_timeline():
    timeline = _timeline(HAND_BUILT)
    assert isinstance(timeline.events, tuple)
    assert timeline.start == 0
    assert timeline.makespan == 9
    assert timeline.busy == (6, 6)
    assert timeline.idle == (3, 3)
    assert timeline.bubble_fraction == pytest.approx(1 / 3, rel=1e-12)
    assert timeline.peak_activations == (2, 1)
    assert timeline.chunks_per_stage == (1, 1)
    assert timeline.bubble_bound is None


def test_measured_timeline_not_starting_at_zero():
    timeline = _timeline(HAND_BUILT, offset=1700000000.25)
    assert timeline.start == 1700000000.25
    assert timeline.makespan == 9
    assert timeline.idle == (3, 3)
    assert timeline.bubble_fraction == pytest.approx(1 / 3, rel=1e-12)
    assert timeline.peak_activations == (2, 1)


def test_stage_events_and_order_are_sorted_by_start():
    timeline = _timeline(HAND_BUILT)
    assert [str(a) for a in timeline.stage_order(1)] == ["F0@c1", "B0@c1", "F1@c1", "B1@c1"]
    events = timeline.stage_events(0)
    assert [e.start for e in events] == [0, 1, 5, 7]
    assert [e.duration for e in events] == [1, 1, 2, 2]


def test_bubble_bound_from_the_makespan_bound():
    timeline = _timeline(HAND_BUILT, makespan_bound=8.0)
    assert timeline.bubble_bound == pytest.approx(1 - 12 / 16)


def test_empty_timeline():
    timeline = Timeline(stages=2, events=())
    assert timeline.makespan == 0
    assert timeline.bubble_fraction == 0
    assert timeline.idle == (0, 0)
    assert timeline.peak_activations == (0, 0)


def test_idle_stage_counts_its_whole_makespan():
    timeline = Timeline(stages=3, events=[Event(0, A("F0"), 0, 2)])
    assert timeline.idle == (0, 2, 2)
    assert timeline.bubble_fraction == pytest.approx(4 / 6)


def test_split_backward_releases_at_the_weight_gradient():
    rows = [(0, "F0", 0, 1), (0, "F1", 1, 2), (0, "I0", 2, 3), (0, "F2", 3, 4),
            (0, "W0", 4, 5), (0, "I1", 5, 6), (0, "W1", 6, 7), (0, "B2", 7, 8)]
    assert _timeline(rows).peak_activations == (3,)


def test_several_chunks_count_a_share_each():
    rows = [(0, "F0", 0, 1), (0, "F0@c1", 1, 2), (0, "F1", 2, 3), (0, "B0@c1", 3, 4),
            (0, "F1@c1", 4, 5), (0, "B1@c1", 5, 6), (0, "B0", 6, 7), (0, "B1", 7, 8)]
    assert _timeline(rows, chunks_per_stage=(2,)).peak_activations == (1.5,)


def test_chrome_trace_has_a_thread_per_stage_and_an_event_per_action(tmp_path):
    timeline = _timeline(HAND_BUILT, offset=100.5)
    written = timeline.to_chrome_trace(str(tmp_path / "trace.json"))
    assert written == tmp_path / "trace.json"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]  # no temporary left
    trace = json.loads(written.read_text())["traceEvents"]

    threads = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert threads == {0: "stage 0", 1: "stage 1"}
    slices = [e for e in trace if e["ph"] == "X"]
    assert len(slices) == len(HAND_BUILT)
    by_name = {(e["tid"], e["name"]): e for e in slices}
    for stage, text, start, end in HAND_BUILT:
        event = by_name[(stage, text)]
        assert event["ts"] == pytest.approx(start * 1e6)  # relative to the first start
        assert event["dur"] == pytest.approx((end - start) * 1e6)
        assert event["cat"] == text[0]
        assert event["args"] == {"microbatch": A(text).microbatch, "chunk": A(text).chunk}


def test_chrome_trace_of_a_simulated_schedule(tmp_path):
    timeline = simulate(one_f_one_b(4, 8))
    path = timeline.to_chrome_trace(tmp_path / "1f1b.json")
    trace = json.loads(Path(path).read_text())["traceEvents"]
    slices = [e for e in trace if e["ph"] == "X"]
    assert len(slices) == 4 * 8 * 2
    assert {e["tid"] for e in slices} == {0, 1, 2, 3}
    assert {e["tid"] for e in trace if e["ph"] == "M"} == {0, 1, 2, 3}
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(timeline.makespan * 1e6)


# --- Chrome trace: valid JSON or a clear error, never a file half written ---------------

@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_chrome_trace_rejects_non_finite_times(tmp_path, bad):
    rows = [(0, "F0", 0, 1), (0, "B0", 1, 3)]
    timeline = Timeline(1, [Event(0, A("F0"), 0, 1), Event(0, A("B0"), 1, bad)])
    with pytest.raises(ValueError, match=r"expected finite event times, got B0 on stage 0"):
        timeline.to_chrome_trace(tmp_path / "trace.json")
    assert list(tmp_path.iterdir()) == []
    assert _timeline(rows).to_chrome_trace(tmp_path / "ok.json").exists()


def test_chrome_trace_to_a_directory_leaves_no_temporary(tmp_path):
    target = tmp_path / "trace.json"
    target.mkdir()
    with pytest.raises(OSError):
        _timeline(HAND_BUILT).to_chrome_trace(target)
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]
    assert target.is_dir()


def test_chrome_trace_failing_midway_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "trace.json"
    target.write_text('{"old": true}')

    def dump_half(document, handle, **kwargs):
        handle.write('{"traceEvents": [')
        raise OSError("disk full")

    monkeypatch.setattr(timeline_module.json, "dump", dump_half)
    with pytest.raises(OSError, match="disk full"):
        _timeline(HAND_BUILT).to_chrome_trace(target)
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]
    assert json.loads(target.read_text()) == {"old": True}


# --- memory traces and the per-stage grouping -----------------------------------------------

def test_memory_trace_steps_and_peak():
    trace = MemoryTrace(times=(0.0, 1.0, 4.0), held=(5.0, 9.0, 2.0))
    assert trace.peak == 9.0
    assert [trace.at(t) for t in (-1, 0, 0.5, 1, 3.9, 4, 100)] == [5, 5, 5, 9, 9, 2, 2]
    with pytest.raises(ValueError, match=r"expected as many held values as times"):
        MemoryTrace(times=(0.0, 1.0), held=(1.0,))


def test_timeline_memory_is_one_trace_per_stage():
    trace = MemoryTrace(times=(0.0,), held=(3.0,))
    assert _timeline(HAND_BUILT, memory=[trace, trace]).peak_bytes == (3.0, 3.0)
    assert _timeline(HAND_BUILT).peak_bytes is None
    with pytest.raises(ValueError, match=r"expected one trace per stage \(2\), got 1"):
        _timeline(HAND_BUILT, memory=[trace])


def test_simulated_stage_events_equal_sorting_the_events():
    for schedule in (one_f_one_b(4, 8), zero_bubble_v(3, 5)):
        for costs in ({}, {"forward": 0, "backward": 0}):
            simulated = simulate(schedule, **costs)
            plain = Timeline(simulated.stages, simulated.events, simulated.chunks_per_stage)
            for stage in range(simulated.stages):
                assert simulated.stage_events(stage) == plain.stage_events(stage)
            assert simulated.peak_activations == plain.peak_activations
