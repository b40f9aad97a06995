"""simulate: start times are the critical path of the dependency graph, costs are checked."""

import math
import random

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import (
    Action, Costs, Event, Link, MemoryTrace, Op, Schedule, ScheduleError, Timeline, dependencies,
    get_schedule, gpipe, memory_traces, one_f_one_b, simulate, simulate_measured,
)

A = Action.parse


def _critical_path(schedule, forward, backward, comm):
    """Earliest start of every action and the makespan, from our own networkx DAG.

    Nodes are actions weighted by their stage's cost; edges are each stage's order
    (no delay) and the data rule for F/B one-chunk-per-stage schedules, with
    ``comm`` on the edges that cross stages.
    """
    graph = nx.DiGraph()
    cost = {Op.F: forward, Op.B: backward}
    stage_of = {}
    for stage, actions in enumerate(schedule.order):
        for action in actions:
            graph.add_node(action, cost=cost[action.op][stage])
            stage_of[action] = stage
        for before, after in zip(actions, actions[1:]):
            graph.add_edge(before, after, delay=0.0)
    for action, stage in stage_of.items():
        m, c = action.microbatch, action.chunk
        if action.op is Op.F:
            producers = [Action(Op.F, m, c - 1)] if c > 0 else []
        else:
            producers = [Action(Op.F, m, c)]
            if c + 1 < schedule.stages:
                producers.append(Action(Op.B, m, c + 1))
        for producer in producers:
            delay = comm if stage_of[producer] != stage else 0.0
            # Keep the larger delay if a stage-order edge is also a data edge.
            if graph.has_edge(producer, action):
                delay = max(delay, graph.edges[producer, action]["delay"])
            graph.add_edge(producer, action, delay=delay)
    start = {}
    for node in nx.topological_sort(graph):
        start[node] = max(
            (start[p] + graph.nodes[p]["cost"] + graph.edges[p, node]["delay"]
             for p in graph.predecessors(node)),
            default=0.0,
        )
    # Cross-check the makespan with networkx's own longest path on an edge-weighted copy.
    weighted = nx.DiGraph()
    for u, v, data in graph.edges(data=True):
        weighted.add_edge(u, v, weight=graph.nodes[u]["cost"] + data["delay"])
    for node, data in graph.nodes(data=True):
        weighted.add_edge(node, "end", weight=data["cost"])
    makespan = nx.dag_longest_path_length(weighted, weight="weight")
    return start, makespan


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
@pytest.mark.parametrize("seed", range(6))
def test_makespan_is_the_critical_path_with_random_costs_and_comm(generator, seed):
    rng = random.Random(seed)
    stages, microbatches = rng.randint(1, 7), rng.randint(1, 12)
    forward = [rng.uniform(0.1, 3.0) for _ in range(stages)]
    backward = [rng.uniform(0.1, 5.0) for _ in range(stages)]
    comm = rng.uniform(0.05, 2.0)
    schedule = generator(stages, microbatches)

    timeline = simulate(schedule, forward=forward, backward=backward, comm=comm)
    start, makespan = _critical_path(schedule, forward, backward, comm)

    assert math.isclose(timeline.makespan, makespan, rel_tol=1e-12)
    assert len(timeline.events) == len(start)
    for event in timeline.events:
        assert math.isclose(event.start, start[event.action], rel_tol=1e-12, abs_tol=1e-12), event
        cost = (forward if event.action.op is Op.F else backward)[event.stage]
        assert math.isclose(event.duration, cost, rel_tol=1e-12)


def test_comm_adds_to_each_hop_of_the_ramp():
    # GPipe, equal costs: M forwards after (P-1) hops, then the backward ramp.
    stages, microbatches, comm = 4, 6, 0.5
    timeline = simulate(gpipe(stages, microbatches), forward=1, backward=2, comm=comm)
    ramp = (stages - 1) * (1 + comm) + (stages - 1) * (2 + comm)
    assert math.isclose(timeline.makespan, 3 * microbatches + ramp, rel_tol=1e-12)


def test_events_follow_each_stage_order_without_overlap():
    schedule = one_f_one_b(5, 9)
    timeline = simulate(schedule, forward=[1, 2, 1, 3, 1], backward=2.5, comm=0.25)
    for stage in range(schedule.stages):
        events = timeline.stage_events(stage)
        assert tuple(e.action for e in events) == schedule.order[stage]
        assert all(a.end <= b.start for a, b in zip(events, events[1:]))
    assert all(e.stage == schedule.placement[e.action.chunk] for e in timeline.events)


def test_timeline_metadata():
    timeline = simulate(one_f_one_b(4, 8))
    assert timeline.name == "1f1b (simulated)"
    assert timeline.stages == 4
    assert timeline.chunks_per_stage == (1, 1, 1, 1)
    assert timeline.start == 0.0


def test_makespan_bound_is_the_ramp_plus_the_busiest_stage():
    stages, microbatches = 4, 8
    timeline = simulate(one_f_one_b(stages, microbatches), forward=1, backward=2)
    assert timeline.makespan_bound == (stages - 1) + 3 * microbatches
    assert math.isclose(timeline.bubble_bound, (stages - 1) / (3 * microbatches + stages - 1))
    rng = random.Random(5)
    for _ in range(20):
        p, m = rng.randint(1, 6), rng.randint(1, 10)
        forward = [rng.uniform(0.1, 2) for _ in range(p)]
        backward = [rng.uniform(0.1, 4) for _ in range(p)]
        comm = rng.uniform(0, 1)
        # Stage s cannot start before micro-batch 0 crossed stages 0..s-1.
        expected = max(
            sum(forward[:s]) + s * comm + m * (forward[s] + backward[s]) for s in range(p)
        )
        for generator in (gpipe, one_f_one_b):
            timeline = simulate(generator(p, m), forward=forward, backward=backward, comm=comm)
            assert math.isclose(timeline.makespan_bound, expected, rel_tol=1e-12)
            assert timeline.makespan_bound <= timeline.makespan * (1 + 1e-12)


def test_split_backward_costs():
    split = Schedule(1, 1, [[A("F0"), A("I0"), A("W0")]])
    full = Schedule(1, 1, [[A("F0"), A("B0")]])
    # Without weight=, a split backward is half input grad, half weight grad.
    timeline = simulate(split, forward=1, backward=4)
    assert [e.duration for e in timeline.stage_events(0)] == [1, 2, 2]
    # With weight=, backward is the input grad alone and B costs both.
    timeline = simulate(split, forward=1, backward=4, weight=3)
    assert [e.duration for e in timeline.stage_events(0)] == [1, 4, 3]
    assert simulate(full, forward=1, backward=4, weight=3).makespan == 8
    assert simulate(full, forward=1, backward=4).makespan == 5


def test_several_chunks_per_stage_share_the_stage_cost():
    schedule = Schedule(
        2, 1,
        [
            [A("F0"), A("F0@c2"), A("B0@c2"), A("B0")],
            [A("F0@c1"), A("F0@c3"), A("B0@c3"), A("B0@c1")],
        ],
        placement=(0, 1, 0, 1),
    )
    timeline = simulate(schedule, forward=1, backward=2, comm=0)
    assert {e.duration for e in timeline.events if e.action.op is Op.F} == {0.5}
    assert {e.duration for e in timeline.events if e.action.op is Op.B} == {1.0}
    # Strictly sequential: 4 half-forwards, then 4 backwards of 1.
    assert timeline.makespan == 6.0
    assert timeline.chunks_per_stage == (2, 2)


def test_zero_costs():
    timeline = simulate(one_f_one_b(3, 4), forward=0, backward=0)
    assert timeline.makespan == 0.0
    assert timeline.bubble_fraction == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"forward": -1.0}, r"forward cost must be >= 0, got -1.0"),
        ({"backward": [1, -2, 1]}, r"backward cost must be >= 0, got -2.0"),
        ({"weight": -0.5}, r"weight cost must be >= 0, got -0.5"),
        ({"comm": -0.1}, r"comm must be >= 0, got -0.1"),
        ({"forward": [1, 2]}, r"forward cost: expected one number or 3 per-stage numbers, got 2"),
        ({"backward": [1, 2, 3, 4]}, r"backward cost: expected one number or 3 per-stage .*got 4"),
        ({"weight": []}, r"weight cost: expected one number or 3 per-stage numbers, got 0"),
    ],
)
def test_bad_costs_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate(one_f_one_b(3, 4), **kwargs)


@pytest.mark.parametrize("name", ["forward", "backward", "weight", "comm"])
def test_nan_cost_is_rejected(name):
    with pytest.raises(ValueError, match=name):
        simulate(one_f_one_b(3, 4), **{name: float("nan")})


def test_numpy_scalar_costs_are_scalars():
    np = pytest.importorskip("numpy")
    timeline = simulate(one_f_one_b(3, 4), forward=np.int64(1), backward=np.float32(2))
    assert timeline.makespan == (4 + 3 - 1) * 3


def test_deadlocked_schedule_raises_schedule_error():
    order = [[A("F0"), A("B0"), A("F1"), A("B1")], [A("F0@c1"), A("F1@c1"), A("B0@c1"), A("B1@c1")]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(Schedule(2, 2, order))


def test_incomplete_schedule_raises_schedule_error():
    with pytest.raises(ScheduleError, match="B0@c1 is missing from stage 1"):
        simulate(Schedule(2, 1, [[A("F0"), A("B0")], [A("F0@c1")]]))


def test_simulate_measured_reproduces_a_timeline_from_its_own_costs() -> None:
    for name in ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v"):
        schedule = get_schedule(name, 4, 8)
        costs = simulate(schedule, forward=[1, 2, 1, 1], backward=[2, 3, 2, 2], weight=[1, 1, 2, 1])
        again = simulate_measured(schedule, costs)
        assert again.makespan == pytest.approx(costs.makespan, rel=1e-12), name
        assert again.bubble_fraction == pytest.approx(costs.bubble_fraction, rel=1e-12), name


# --- Costs: every kind of cost changes the makespan as computed by hand ----------------
# 1F1B, P=2, M=2: stage 0 runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1 (of chunk 1).

def _1f1b_2x2(**costs):
    return simulate(one_f_one_b(2, 2), costs=Costs(**costs))


def test_hand_computed_1f1b_with_comm():
    # F0 [0,1] F1 [1,2] | F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5]
    # B0 waits for 4.5 + 0.5 -> [5,7]; B1 for 7.5 + 0.5 -> [8,10].
    timeline = _1f1b_2x2(forward=1, backward=2, comm=0.5)
    assert timeline.makespan == 10.0
    assert [e.start for e in timeline.stage_events(0)] == [0.0, 1.0, 5.0, 8.0]
    assert simulate(one_f_one_b(2, 2), forward=1, backward=2, comm=0.5).makespan == 10.0


def test_hand_computed_per_hop_matrix_and_link():
    # 0.5 down, 1.5 back: B0 waits for 4.5 + 1.5 -> [6,8], B1 for 7.5 + 1.5 -> [9,11].
    assert _1f1b_2x2(comm=[[0, 0.5], [1.5, 0]]).makespan == 11.0
    # latency 0.25 + 2 bytes at 4 bytes per unit = 0.75 a hop:
    # F0 [1.75,2.75] B0 [2.75,4.75] F1 [4.75,5.75] B1 [5.75,7.75] on stage 1,
    # then B0 [5.5,7.5] and B1 [8.5,10.5] on stage 0.
    timeline = _1f1b_2x2(comm=Link(latency=0.25, bandwidth=4), input_bytes=(0, 2))
    assert timeline.makespan == 10.5


def test_hand_computed_per_chunk_costs():
    # F0 [0,1] F1 [1,2] | F0 [1,3] B0 [3,4] F1 [4,6] B1 [6,7] | B0 [4,7] B1 [7,10]
    assert _1f1b_2x2(forward=(1, 2), backward=(3, 1)).makespan == 10.0


def test_hand_computed_per_op_costs_of_a_split_backward():
    order = [[A("F0"), A("F1"), A("I0"), A("W0"), A("I1"), A("W1")],
             [A("F0@c1"), A("I0@c1"), A("F1@c1"), A("I1@c1"), A("W0@c1"), A("W1@c1")]]
    timeline = simulate(Schedule(2, 2, order),
                        costs=Costs(forward=1, input_grad=(2, 1), weight_grad=(0.5, 3)))
    # stage 1: F0 [1,2] I0 [2,3] F1 [3,4] I1 [4,5] W0 [5,8] W1 [8,11]
    # stage 0: F0 [0,1] F1 [1,2] I0 [3,5] W0 [5,5.5] I1 [5.5,7.5] W1 [7.5,8]
    assert [(e.start, e.end) for e in timeline.stage_events(0)] == [
        (0, 1), (1, 2), (3, 5), (5, 5.5), (5.5, 7.5), (7.5, 8)]
    assert timeline.makespan == 11.0


def test_hand_computed_per_microbatch_scale():
    # micro-batch 1 twice as large: F1 [1,3] | F0 [1,2] B0 [2,4] F1 [4,6] B1 [6,10]
    # | B0 [4,6] B1 [10,14]
    assert _1f1b_2x2(forward=1, backward=2, microbatch_scale=(1, 2)).makespan == 14.0


def test_recomputation_adds_a_forward_to_each_recomputed_backward():
    assert _1f1b_2x2(forward=1, backward=2).makespan == 9.0
    # B costs 3: B0 [2,5] F1 [5,6] B1 [6,9] on stage 1; B0 [5,8] B1 [9,12] on stage 0.
    assert _1f1b_2x2(forward=1, backward=2, recompute="always").makespan == 12.0
    # The last micro-batch is not recomputed: B1 [6,8], then B1 [8,10] on stage 0.
    assert _1f1b_2x2(forward=1, backward=2, recompute="except_last").makespan == 10.0
    assert _1f1b_2x2(forward=1, backward=2, recompute=[False, True]).makespan == 11.0


def test_costs_from_stages_equal_the_keywords():
    for name in ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v"):
        schedule = get_schedule(name, 4, 8)
        keywords = dict(forward=[1, 2, 1, 1], backward=[2, 3, 2, 2], weight=[1, 1, 2, 1], comm=0.3)
        ours = simulate(schedule, costs=Costs.from_stages(**keywords))
        theirs = simulate(schedule, **keywords)
        assert ours.events == theirs.events, name
        assert ours.makespan_bound == theirs.makespan_bound, name


def test_costs_and_keywords_together_are_rejected():
    with pytest.raises(ValueError, match=r"expected costs= or the keywords, got both .*comm="):
        simulate(one_f_one_b(2, 2), comm=0.5, costs=Costs())


@settings(max_examples=40, deadline=None)
@given(stages=st.integers(1, 8), microbatches=st.integers(1, 24),
       forward=st.sampled_from([0.5, 1.0, 3.0]))
def test_closed_form_bubble_with_costs(stages, microbatches, forward):
    expected = (stages - 1) / (microbatches + stages - 1)
    for generator in (gpipe, one_f_one_b):
        costs = Costs(forward=forward, backward=2 * forward)
        timeline = simulate(generator(stages, microbatches), costs=costs)
        assert math.isclose(timeline.bubble_fraction, expected, rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(timeline.makespan, 3 * forward * (microbatches + stages - 1))


# --- predicted memory ---------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(stages=st.integers(1, 6), microbatches=st.integers(1, 12))
def test_peak_bytes_gpipe_holds_every_microbatch_and_1f1b_at_most_p_minus_s(stages, microbatches):
    saved = [1000.0 * (s + 1) for s in range(stages)]
    fixed = [7.0 + s for s in range(stages)]
    costs = Costs(activation_bytes=saved, fixed_bytes=fixed, comm=0.25)
    gpipe_peaks = simulate(gpipe(stages, microbatches), costs=costs).peak_bytes
    assert gpipe_peaks == tuple(fixed[s] + microbatches * saved[s] for s in range(stages))
    ofob = simulate(one_f_one_b(stages, microbatches), costs=costs).peak_bytes
    assert ofob == tuple(fixed[s] + min(stages - s, microbatches) * saved[s]
                         for s in range(stages))


def test_memory_trace_of_1f1b_by_hand():
    timeline = _1f1b_2x2(forward=1, backward=2, activation_bytes=10, fixed_bytes=(100, 200))
    # Stage 0: F0 at 0, F1 at 1, B0 ends at 6, B1 at 9. Stage 1: F0 at 1, B0 ends at 4
    # when F1 starts (one step), B1 ends at 7.
    assert timeline.memory == (
        MemoryTrace(times=(0.0, 1.0, 6.0, 9.0), held=(110.0, 120.0, 110.0, 100.0)),
        MemoryTrace(times=(0.0, 1.0, 4.0, 7.0), held=(200.0, 210.0, 210.0, 200.0)),
    )
    assert timeline.peak_bytes == (120.0, 210.0)
    assert timeline.memory[0].at(0.5) == 110.0 and timeline.memory[0].at(6.0) == 110.0


def test_recomputation_lowers_peak_bytes_and_raises_makespan():
    plain = _1f1b_2x2(forward=1, backward=2, activation_bytes=10, input_bytes=1,
                      fixed_bytes=(100, 200))
    again = _1f1b_2x2(forward=1, backward=2, activation_bytes=10, input_bytes=1,
                      fixed_bytes=(100, 200), recompute="always")
    # Stage 0 keeps two inputs (102), then holds one micro-batch's activations again
    # during each backward: B0 [5,8] -> 111, B1 [9,12] -> 110.
    assert again.memory[0].times == (0.0, 1.0, 5.0, 8.0, 9.0, 12.0)
    assert again.memory[0].held == (101.0, 102.0, 111.0, 101.0, 110.0, 100.0)
    assert again.peak_bytes == (111.0, 210.0)
    assert plain.peak_bytes == (120.0, 210.0)
    assert (plain.makespan, again.makespan) == (9.0, 12.0)


def test_memory_scales_with_the_microbatch_and_is_absent_without_bytes():
    timeline = _1f1b_2x2(activation_bytes=10, microbatch_scale=(1, 0.5))
    assert timeline.peak_bytes == (15.0, 10.0)
    assert _1f1b_2x2().memory == () and _1f1b_2x2().peak_bytes is None


def test_memory_of_a_split_backward_is_released_by_the_weight_gradient():
    order = [[A("F0"), A("F1"), A("I0"), A("F2"), A("W0"), A("I1"), A("W1"), A("B2")]]
    schedule = Schedule(1, 3, order)
    costs = Costs(activation_bytes=4)
    timeline = simulate(schedule, costs=costs)
    assert timeline.peak_bytes == (12.0,)  # three held at once, as peak_activations says
    assert timeline.peak_activations == (3,)
    # The same model reads a measured timeline (here: the simulated one, shifted).
    shifted = Timeline(1, [Event(e.stage, e.action, e.start + 5, e.end + 5)
                           for e in timeline.events])
    traces = memory_traces(shifted, costs.resolve(schedule))
    assert traces[0].held == timeline.memory[0].held
    assert traces[0].times == tuple(t + 5 for t in timeline.memory[0].times)


# --- hardening ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["forward", "backward", "weight", "comm"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_infinite_cost_is_rejected_by_name(name, bad):
    with pytest.raises(ValueError, match=rf"{name}.* must be finite, got -?inf"):
        simulate(one_f_one_b(3, 4), **{name: bad})


def test_infinite_item_of_a_per_stage_cost_is_rejected():
    with pytest.raises(ValueError, match=r"backward cost must be finite, got inf \(item 2\)"):
        simulate(one_f_one_b(3, 4), backward=[1, 2, math.inf])


def test_simulate_measured_with_another_stage_count():
    measured = simulate(one_f_one_b(2, 4))
    with pytest.raises(ValueError, match=r"expected a timeline of 3 stages .*got 2"):
        simulate_measured(one_f_one_b(3, 4), measured)


def test_simulate_measured_uses_each_chunk_means():
    schedule = get_schedule("interleaved-1f1b", 2, 4, chunks_per_stage=2)
    costs = Costs(forward=(1, 2, 3, 4), backward=(2, 3, 5, 7), comm=0.5)
    measured = simulate(schedule, costs=costs)
    again = simulate_measured(schedule, measured, comm=0.5)
    assert again.events == measured.events


@pytest.mark.parametrize("name", ["zb-v", "interleaved-1f1b", "zb-h1", "1f1b"])
def test_every_event_starts_when_its_stage_and_inputs_are_ready(name):
    rng = random.Random(name)
    schedule = get_schedule(name, 3, 5)
    chunks = schedule.chunks
    costs = Costs(
        forward=[rng.uniform(0.5, 2) for _ in range(chunks)],
        input_grad=[rng.uniform(0.5, 2) for _ in range(chunks)],
        weight_grad=[rng.uniform(0.1, 1) for _ in range(chunks)],
        microbatch_scale=[rng.uniform(0.5, 2) for _ in range(5)],
        recompute="except_last",
        comm=Link(latency=0.1, bandwidth=50.0),
        input_bytes=[rng.uniform(0, 20) for _ in range(chunks)],
    )
    table = costs.resolve(schedule)
    timeline = simulate(schedule, costs=costs)
    end = {event.action: event.end for event in timeline.events}
    for stage in range(schedule.stages):
        previous = 0.0
        for event in timeline.stage_events(stage):
            action = event.action
            ready = max([previous] + [
                end[needed] + table.hop(needed.chunk, action.chunk, action.microbatch)
                for needed in dependencies(schedule, action)])
            assert event.start == pytest.approx(ready, abs=1e-12), action
            assert event.duration == pytest.approx(
                table.duration(action.op, action.microbatch, action.chunk), rel=1e-12)
            previous = event.end


def test_memory_traces_of_a_timeline_of_other_stages():
    costs = Costs(activation_bytes=1).resolve(one_f_one_b(3, 2))
    with pytest.raises(ValueError, match=r"expected costs resolved for 2 stages .*got 3"):
        memory_traces(simulate(one_f_one_b(2, 2)), costs)
    with pytest.raises(ValueError, match=r"expected costs with activation_bytes, got None"):
        memory_traces(simulate(one_f_one_b(2, 2)), Costs().resolve(one_f_one_b(2, 2)))
